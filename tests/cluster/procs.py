"""Real `pscluster` daemons started as processes by tests, always ended by pid."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml
from pscluster.coordinator.remote import RemoteCoordinator

import pscluster as ps
from pscluster.ops.launcher import free_port

BIN = [sys.executable, "-P", "-m", "pscluster.ops.cli"]


class Procs:
    """Processes one test started; `close()` kills whichever still run."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[str]] = []

    def start(self, *args: str, env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.Popen[str]:
        """Start `pscluster *args` with stdout and stderr merged into one pipe."""
        proc = subprocess.Popen([*BIN, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True)
        self.started.append(proc)
        return proc

    def close(self) -> None:
        """SIGKILL every process still running, by pid."""
        for proc in self.started:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()


def read_until(proc: subprocess.Popen[str], needle: str, timeout: float = 60.0) -> list[str]:
    """Lines of proc's output up to the first one containing needle (fails on exit or timeout)."""
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"process exited ({proc.wait(timeout=10)}) before {needle!r}:\n" + "".join(lines))
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no {needle!r} after {timeout} s:\n" + "".join(lines))


def free_range(count):
    """A base port whose next `count` ports are all free right now."""
    for _ in range(50):
        base = free_port()
        if base + count >= 65536:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free port range")


@pytest.fixture(params=["embedded", "remote"])
def make_coord(request, tmp_path):
    """make_coord(cluster, **overrides): a ClusterCoordinator, or a RemoteCoordinator of a daemon started here."""
    daemons = []

    def make(cluster, **overrides):
        if request.param == "embedded":
            return ps.ClusterCoordinator(cluster.settings(**overrides))
        spec = {**yaml.safe_load(cluster.cluster_file.read_text()), **overrides}
        path = tmp_path / f"coordinator{len(daemons)}.yaml"
        path.write_text(yaml.safe_dump(spec))
        log_path = tmp_path / f"coordinator{len(daemons)}.log"
        with open(log_path, "wb") as log:
            argv = [*BIN, "coordinator", "--cluster", str(path), "--exit-with-parent", str(os.getpid())]
            daemons.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 60
        while b"READY coordinator" not in log_path.read_bytes():
            assert daemons[-1].poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "coordinator daemon not READY after 60 s"
            time.sleep(0.05)
        return RemoteCoordinator(cluster.settings(**overrides))

    yield make
    for proc in daemons:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
