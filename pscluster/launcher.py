"""Local launcher: run P PS tasks and W workers on this machine as supervised subprocesses.

    with LocalCluster(num_ps=2, num_workers=2) as cluster:       # ports picked on 127.0.0.1
        coord = ClusterCoordinator(cluster.settings())           # workers register with it
        ...

The supervisor restarts a daemon that exits unexpectedly (a PS with --restore, from the cluster's
checkpoint directory). `stop()` ends every process it started, by pid, SIGTERM then SIGKILL.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from pscluster.config import Settings, load_settings
from pscluster.errors import DeadlineExceededError, FailedPreconditionError

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on host right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Daemon:
    """One supervised process."""

    role: str
    index: int
    argv: list[str]
    log_path: pathlib.Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    supervised: bool = True
    ready_at: float = 0.0
    lines_seen: int = field(default=0)

    @property
    def pid(self) -> int:
        """The current process's pid."""
        assert self.proc is not None
        return self.proc.pid


class LocalCluster:
    """P PS tasks and W workers on 127.0.0.1, plus the spec a coordinator needs."""

    def __init__(self, num_ps: int = 2, num_workers: int = 2, *, workdir: str | os.PathLike[str] | None = None,
                 token: str | None = None, supervise: bool = True, coordinator_port: int | None = None,
                 extra: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> None:
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="pscluster-")
        self.workdir = pathlib.Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_dir = self.workdir / "checkpoints"
        self.token = token
        self.supervise = supervise
        self.spec: dict[str, Any] = {
            "ps": [f"127.0.0.1:{free_port()}" for _ in range(num_ps)],
            "coordinator": f"127.0.0.1:{coordinator_port or free_port()}",
        }
        self.cluster_file = self.workdir / "cluster.yaml"
        self.cluster_file.write_text(yaml.safe_dump({"cluster": self.spec, **(extra or {})}))
        self.ps: list[Daemon] = []
        self.workers: list[Daemon] = []
        # One BLAS thread per daemon: P + W processes sharing a few cores slow down ~4x when each
        # also spins a BLAS thread pool (measured: MNIST MLP 37 vs 146 steps/s on 2 cores).
        blas = {k: "1" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        self._env = {**blas, **os.environ, **(env or {})}
        if token:
            self._env["PSCLUSTER_TOKEN"] = token
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._num_workers = num_workers
        self._supervisor: threading.Thread | None = None

    def settings(self, **overrides: Any) -> Settings:
        """Client/coordinator settings for this cluster."""
        env = {"PSCLUSTER_TOKEN": self.token} if self.token else {}
        return load_settings(self.cluster_file, env=env, overrides=overrides)

    def _argv(self, role: str, index: int, restore: bool = False) -> list[str]:
        argv = [sys.executable, "-m", "pscluster.cli", role, "--cluster", str(self.cluster_file)]
        if role == "ps":
            argv += ["--index", str(index), "--checkpoint-dir", str(self.checkpoint_dir)]
            if restore:
                argv.append("--restore")
        return argv

    def start(self, wait: float = 60.0) -> LocalCluster:
        """Start every PS and worker; wait until each printed READY."""
        for i in range(len(self.spec["ps"])):
            self.ps.append(self._spawn(Daemon("ps", i, self._argv("ps", i), self.workdir / f"ps{i}.log")))
        for _ in range(self._num_workers):
            self.add_worker(wait=0)
        for d in self.ps + self.workers:
            self.wait_ready(d, wait)
        if self.supervise:
            self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
            self._supervisor.start()
        return self

    def add_worker(self, wait: float = 60.0) -> Daemon:
        """Start one more worker (it registers with the coordinator on its own)."""
        with self._lock:
            i = len(self.workers)
            d = self._spawn(Daemon("worker", i, self._argv("worker", i), self.workdir / f"worker{i}.log",
                                   supervised=self.supervise))
            self.workers.append(d)
        if wait:
            self.wait_ready(d, wait)
        return d

    def _spawn(self, d: Daemon) -> Daemon:
        with open(d.log_path, "ab") as logf:
            d.lines_seen = _count_ready(d.log_path)
            d.proc = subprocess.Popen(d.argv, stdout=logf, stderr=subprocess.STDOUT, env=self._env,
                                      start_new_session=True)
        return d

    def wait_ready(self, d: Daemon, timeout: float = 60.0) -> None:
        """Wait until d's current process printed READY."""
        deadline = time.monotonic() + timeout
        while _count_ready(d.log_path) <= d.lines_seen:
            assert d.proc is not None
            if d.proc.poll() is not None:
                raise FailedPreconditionError(
                    f"{d.role} {d.index} exited with {d.proc.returncode} before ready; log: {d.log_path}\n"
                    + d.log_path.read_text()[-3000:])
            if time.monotonic() > deadline:
                raise DeadlineExceededError(f"{d.role} {d.index} not ready after {timeout} s; log: {d.log_path}")
            time.sleep(0.02)
        d.ready_at = time.monotonic()

    def restart(self, d: Daemon, wait: float = 60.0) -> None:
        """Start d again (a PS restores from the newest checkpoint)."""
        with self._lock:
            d.argv = self._argv(d.role, d.index, restore=d.role == "ps")
            self._spawn(d)
            d.restarts += 1  # only once the new process exists: watchers of `restarts` see it
        if wait:
            self.wait_ready(d, wait)

    def kill(self, d: Daemon, sig: int = signal.SIGKILL) -> None:
        """Send sig to d's process (by pid)."""
        assert d.proc is not None
        os.kill(d.proc.pid, sig)
        if sig == signal.SIGKILL:
            d.proc.wait(timeout=10)

    def _supervise(self) -> None:
        while not self._stopping.wait(0.1):
            for d in list(self.ps + self.workers):
                if d.supervised and d.proc is not None and d.proc.poll() is not None and not self._stopping.is_set():
                    log.warning("%s %d exited with %s; restarting", d.role, d.index, d.proc.returncode)
                    try:
                        self.restart(d, wait=0)
                    except OSError:
                        log.exception("restart of %s %d failed", d.role, d.index)

    def stop(self, grace: float = 5.0) -> None:
        """Stop every process this cluster started: SIGTERM, then SIGKILL after grace."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=2)
        procs = [d.proc for d in self.ps + self.workers if d.proc is not None and d.proc.poll() is None]
        for p in procs:
            try:
                os.kill(p.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                os.kill(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _count_ready(path: pathlib.Path) -> int:
    try:
        return path.read_bytes().count(b"\nREADY ") + path.read_bytes().startswith(b"READY ")
    except FileNotFoundError:
        return 0


def up_main(args: argparse.Namespace) -> int:
    """`pscluster up`: a supervised local cluster with a coordinator daemon, until Ctrl-C/SIGTERM."""
    from pscluster.coordinator.coordinator import ClusterCoordinator

    token = pathlib.Path(args.token_file).read_text().strip() if args.token_file else None
    cluster = LocalCluster(args.ps, args.workers, workdir=args.checkpoint_dir, token=token,
                           coordinator_port=args.base_port or None)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    coord = None
    try:
        cluster.start()
        coord = ClusterCoordinator(cluster.settings(task_type="coordinator"))
        if args.write_cluster:
            pathlib.Path(args.write_cluster).write_text(cluster.cluster_file.read_text())
        print(f"READY up: {len(cluster.ps)} PS, {len(cluster.workers)} workers, coordinator at "
              f"{cluster.spec['coordinator']}; cluster spec: {args.write_cluster or cluster.cluster_file}", flush=True)
        stop.wait()
    finally:
        if coord is not None:
            coord.shutdown()
        cluster.stop()
    return 0
