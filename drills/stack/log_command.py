"""A service's ``log_command`` (drills/stack/stackfile.py): the command that prints its log as it grows
(``journalctl -u vllm -f``, ``docker logs -f``, a supervisor's tail), run for the length of a drill on an
attached stack with its output appended to the run's ``logs/NAME.log``, where reports and the log checks
read a service's log like any file.

On this host it runs in its own session (so its whole group is stopped at the end, by its pid, never by
name) with the run's ``KVDRILL_RUN`` tag, so ``kvdrill rollback`` stops it after a SIGKILL of kvdrill as it
stops any process the run started; on a stack file's SSH host it runs over one SSH channel, which sshd hangs up when kvdrill closes it.
It is the user's declared command, run as declared (an argv list, no shell here; on another machine it is
quoted word by word for that machine's shell). It must not end on its own: if it does, its output so far is
kept and the journal says it ended by itself.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from drills.procstat import start_ticks
from drills.stack import ssh
from drills.stack.process import RUN_TAG_ENV

if TYPE_CHECKING:
    from drills.stack.stackfile import SshHost


@dataclass
class LogCommand:
    service: str
    argv: list[str]
    local: Path  # the run's logs/NAME.log
    host: SshHost | None = None
    run_tag: str = ""  # KVDRILL_RUN for a local one (the stack directory)
    started_at: float = 0.0
    popen: subprocess.Popen | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> dict:
        """Start it; what the journal records of it."""
        self.local.parent.mkdir(parents=True, exist_ok=True)
        self.started_at = time.time()
        if self.host is None:
            with self.local.open("ab") as out:
                self.popen = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True, env={**os.environ, RUN_TAG_ENV: self.run_tag})
            return {"service": self.service, "argv": self.argv, "pgid": self.popen.pid, "tag": self.run_tag,
                    "start_ticks": start_ticks(self.popen.pid), "log": str(self.local)}
        self._thread = threading.Thread(target=ssh.stream, args=(self.host, shlex.join(self.argv), self.local,
                                                                 self._stop),
                                        daemon=True, name=f"log-command-{self.service}")
        self._thread.start()
        return {"service": self.service, "argv": self.argv, "host": f"{self.host.user}@{self.host.address}",
                "log": str(self.local)}

    def stop(self, grace: float = 5.0) -> dict:
        """Stop it (its group on this host, its channel on another); what the journal records."""
        self._stop.set()
        if self.popen is not None:
            ended = self.popen.poll()
            if ended is None:
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(self.popen.pid, sig)
                    except ProcessLookupError:
                        break
                    try:
                        self.popen.wait(timeout=grace)
                        break
                    except subprocess.TimeoutExpired:
                        continue
            return {"service": self.service, "pgid": self.popen.pid, "ended_by_itself": ended is not None,
                    "returncode": self.popen.returncode, "bytes": _size(self.local)}
        if self._thread is not None:
            self._thread.join(timeout=grace)
        return {"service": self.service, "host": f"{self.host.user}@{self.host.address}" if self.host else None,
                "bytes": _size(self.local)}


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None
