"""The compile worker (``compiler/compile_worker.py``) stops when the process that started it is gone."""
from __future__ import annotations

import os
import subprocess
import sys
import time

WATCHED = ("import os, time; from autoshard.compiler.compile_worker import exit_with_parent; "
           "exit_with_parent(os.getppid(), 0.05); print('watching', flush=True); time.sleep(60)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its new parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_whose_parent_is_gone_exits_instead_of_compiling_for_nobody(tmp_path):
    # the shell starts the watcher and waits for its first line, then exits: the watcher is orphaned
    script = f'{sys.executable} -c "{WATCHED}" > "$1" & echo $!; until [ -s "$1" ]; do sleep 0.1; done'
    out = tmp_path / "watching.txt"
    shell = subprocess.run(["sh", "-c", script, "sh", str(out)], capture_output=True, text=True, timeout=60,
                           check=True)
    pid = int(shell.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the orphaned worker kept running"


def test_a_worker_whose_parent_lives_keeps_running():
    proc = subprocess.Popen([sys.executable, "-c", WATCHED], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "watching"
        time.sleep(0.3)  # several polls
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
