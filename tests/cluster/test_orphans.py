"""Daemons a program started stop when that program dies, even by SIGKILL (no orphans holding ports)."""

import os
import signal
import subprocess
import sys
import time

PROGRAM = """
import sys, threading
from pscluster.ops.launcher import LocalCluster
cluster = LocalCluster(2, 0, workdir=sys.argv[1], supervise=False).start()
print(" ".join(str(d.pid) for d in cluster.ps), flush=True)
threading.Event().wait()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended; only its reaper is late
    except FileNotFoundError:
        return False


def test_daemons_stop_when_the_program_that_started_them_is_sigkilled(tmp_path):
    program = subprocess.Popen([sys.executable, "-c", PROGRAM, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    pids: list[int] = []
    try:
        line = program.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, line
        assert all(_alive(p) for p in pids)
        os.kill(program.pid, signal.SIGKILL)
        program.wait(timeout=10)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "daemons outlived the program that started them"
        logs = "".join((tmp_path / f"ps{i}.log").read_text() for i in range(2))
        assert logs.count("has ended; stopping") == 2, logs
    finally:
        if program.poll() is None:
            os.kill(program.pid, signal.SIGKILL)
            program.wait(timeout=10)
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        program.stdout.close()
