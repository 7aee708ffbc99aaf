"""/proc/<pid>/stat fields, read for this test process and for one whose name holds ") (" and spaces."""

from __future__ import annotations

import os
import subprocess
import sys

from drills.procstat import PGRP, PPID, START_TIME, STATE, stat_fields


def test_fields_of_this_process_match_what_os_says():
    fields = stat_fields(os.getpid())
    assert fields is not None and fields[STATE] == "R"
    assert (int(fields[PPID]), int(fields[PGRP])) == (os.getppid(), os.getpgrp())
    assert int(fields[START_TIME]) > 0


def test_a_command_name_with_parentheses_and_spaces_does_not_shift_the_fields():
    # the kernel takes the name from the executable's file name: make one that looks like a field end
    odd = f"/tmp/kvdrill test ) (x {os.getpid()}"
    os.symlink(sys.executable, odd)
    try:
        child = subprocess.Popen([odd, "-c", "import time; time.sleep(5)"], stdin=subprocess.DEVNULL)
        try:
            fields = stat_fields(child.pid)
            assert fields is not None and int(fields[PPID]) == os.getpid() and fields[STATE] in ("R", "S")
        finally:
            child.kill()
            child.wait()
    finally:
        os.unlink(odd)


def test_a_gone_process_has_no_fields():
    child = subprocess.Popen(["true"])
    child.wait()
    assert stat_fields(child.pid) is None
