"""Stand-in services for tests of the process driver and of rollback."""

import textwrap

# A leader serving /health that forks a stubborn child; the child names a /dev/shm file after its own
# pid, the way a vLLM worker names lmcache_kv_<pid>_0, and ignores SIGTERM.
STUBBORN_SERVICE = textwrap.dedent("""
    import http.server, os, signal, sys, time
    port = int(sys.argv[1])
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(f"/dev/shm/lmcache_kv_{os.getpid()}_0", "wb").write(b"x" * 4096)
        while True:
            time.sleep(1)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")
