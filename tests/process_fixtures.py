"""Stand-in services for tests of the process driver and of rollback."""

import os
import signal
import subprocess
import textwrap
import time

from injectors.process import process_states

# A leader serving /health on argv[1] that forks one child; the child runs CHILD, then sleeps forever.
_SERVICE = textwrap.dedent("""
    import http.server, os, signal, sys, time
    port = int(sys.argv[1])
    FIFO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "release.fifo")
    if os.fork() == 0:
        CHILD
        while True:
            time.sleep(1)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")

# The stubborn child names a /dev/shm file after its own pid, the way a vLLM worker names
# lmcache_kv_<pid>_0, and ignores SIGTERM.
STUBBORN_SERVICE = _SERVICE.replace("CHILD", "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                             "open(f'/dev/shm/lmcache_kv_{os.getpid()}_0', 'wb').write(b'x' * 4096)")

# A process that sits in uninterruptible sleep (D) until someone opens the FIFO: glibc's posix_spawn is a
# vfork, so the caller waits in the kernel (killable only: a SIGSTOP does not wake it) until the spawned
# process has done its file actions and exec'd, and its file action here is opening the FIFO for reading.
# The spawned process has a process group of its own, so a signal to the caller's group misses it. This
# is a vLLM worker page-faulting its weights in, or LMCache writing a chunk to its fs L2: a SIGSTOP
# lands only once the sleep ends. FIFO is a path expression in the script that uses this.
SPAWN_BLOCKED_ON_FIFO = ("os.waitpid(os.posix_spawn(sys.executable, [sys.executable, '-c', ''], {}, file_actions="
                         "[(os.POSIX_SPAWN_OPEN, 0, FIFO, os.O_RDONLY, 0)], setpgroup=0), 0)")

# the same service, its child blocked as above on release.fifo next to the script until the test
# releases it
BLOCKED_SERVICE = _SERVICE.replace("CHILD", SPAWN_BLOCKED_ON_FIFO)


def release(fifo) -> int:
    """Let the process blocked on ``fifo`` go: a read-write open never blocks and gives the FIFO the
    writer its reader waits for. Close the returned fd when done."""
    return os.open(fifo, os.O_RDWR | os.O_NONBLOCK)


def wait_for_state(pids, state: str, within: float = 10.0) -> int:
    """The first of ``pids()`` seen in ``state`` (a /proc/<pid>/stat letter), polled up to ``within`` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = [pid for pid, s in process_states(pids()).items() if s == state]
        if found:
            return found[0]
        time.sleep(0.01)
    raise AssertionError(f"no process in state {state} within {within}s")


def stop_group(proc: subprocess.Popen, timeout: float = 10) -> None:
    """A test server started in its own session: SIGTERM its process group, SIGKILL it if it lingers."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)
