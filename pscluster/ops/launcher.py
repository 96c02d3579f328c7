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
import random
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

from pscluster.config import Settings, load_settings, load_token
from pscluster.errors import ConfigError, DeadlineExceededError, FailedPreconditionError, StartupError
from pscluster.ops import daemon

log = logging.getLogger(__name__)


def _ephemeral_floor() -> int:
    try:
        return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on host right now, chosen below the kernel's ephemeral range.

    The port is bound later (a daemon's start, a PS restart, the embedded coordinator): a port from
    the ephemeral range could meanwhile be handed to any process's bind(0) or outgoing connect().
    """
    floor = _ephemeral_floor()
    low = max(1024, floor - 12000)
    for _ in range(200):
        port = random.randrange(low, floor)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the whole low range busy: fall back to the kernel's choice
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class PortPlan:
    """Fixed ports from a base: coordinator, PS tasks, workers, then the PS and worker framed listeners.

    With base 0 every method returns 0 (pick a free port). Workers beyond the planned count get free ports.
    """

    base: int
    num_ps: int
    num_workers: int

    def _at(self, offset: int) -> int:
        return self.base + offset if self.base else 0

    def coordinator(self) -> int:
        """The coordinator's port."""
        return self._at(0)

    def ps(self, i: int) -> int:
        """PS i's gRPC port."""
        return self._at(1 + i)

    def worker(self, i: int) -> int:
        """Worker i's gRPC port."""
        return self._at(1 + self.num_ps + i) if i < self.num_workers else 0

    def framed(self, role: str, i: int) -> int:
        """The framed listener's port of PS i (bulk tensors) or worker i (closures)."""
        first = 1 + self.num_ps + self.num_workers
        if role == "ps":
            return self._at(first + i)
        return self._at(first + self.num_ps + i) if role == "worker" and i < self.num_workers else 0

    def last(self) -> int:
        """The highest port of the plan."""
        return self._at(2 * (self.num_ps + self.num_workers))


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
                 extra: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                 checkpoint_dir: str | os.PathLike[str] | None = None, restore: bool = False,
                 base_port: int = 0, replicas: int = 1, elastic: bool = False) -> None:
        """replicas: copies of every shard (2: a backup on another PS, docs/ps_failures.md); elastic: one copy
        routed by the replica table, so shards can move (docs/elastic.md)."""
        if replicas != 1:
            extra = {**(extra or {}), "replicas": replicas}
        if elastic:
            extra = {**(extra or {}), "elastic": True}
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="pscluster-")
        self.workdir = pathlib.Path(workdir or self._tmp.name).resolve()  # type: ignore[union-attr]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_dir = pathlib.Path(checkpoint_dir).resolve() if checkpoint_dir else self.workdir / "checkpoints"
        self.restore_at_start = restore
        self.token = token
        self.supervise = supervise
        self.ports = PortPlan(base_port, num_ps, num_workers)
        self.spec: dict[str, Any] = {
            "ps": [f"127.0.0.1:{self.ports.ps(i) or free_port()}" for i in range(num_ps)],
            "coordinator": f"127.0.0.1:{self.ports.coordinator() or coordinator_port or free_port()}",
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
        # -P: the working directory is not put on sys.path, so a `pscluster/` folder there (a checkout
        # next to a non-editable install) cannot shadow the installed package in the daemons.
        argv = [sys.executable, "-P", "-m", "pscluster.ops.cli", role, "--cluster", str(self.cluster_file),
                "--exit-with-parent", str(os.getpid())]
        if role == "ps":
            argv += ["--index", str(index), "--checkpoint-dir", str(self.checkpoint_dir)]
            if restore or self.restore_at_start:
                argv.append("--restore")
        framed = self.ports.framed(role, index)
        if role == "worker" and self.ports.worker(index):
            argv += ["--port", str(self.ports.worker(index))]
        if framed:
            argv += ["--framed-port", str(framed)]
        return argv

    def start(self, wait: float = 60.0) -> LocalCluster:
        """Start every PS and worker; wait until each serves (PS: READY; worker: SERVING, since it
        registers with a coordinator that may start later: ClusterCoordinator.wait_for_workers)."""
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

    def add_ps(self, wait: float = 60.0) -> Daemon:
        """Start a PS the cluster file does not list (`pscluster ps --join`): it asks the running coordinator
        (replicas: 2) for a task index, d.index once it is ready; `coord.add_ps(d.index)` gives it shards."""
        with self._lock:
            argv = self._argv("ps", 0)
            at = argv.index("--index")
            argv[at:at + 2] = ["--join", "--port", str(free_port())]
            d = self._spawn(Daemon("ps", -1, argv, self.workdir / f"ps-joined{len(self.ps)}.log",
                                   supervised=self.supervise))
            self.ps.append(d)
        self.wait_ready(d, wait)
        ready = [line for line in d.log_path.read_text().splitlines() if line.startswith("READY ps ")]
        d.index = int(ready[-1].split()[2])
        return d

    def address_of(self, d: Daemon) -> str:
        """Where PS d's gRPC server listens (host:port; a joined PS's comes from its --port)."""
        if "--join" in d.argv:
            return f"127.0.0.1:{d.argv[d.argv.index('--port') + 1]}"
        return str(self.spec["ps"][d.index])

    def scale(self, coordinator: Any, count: int) -> Any:
        """Hold the shards on `count` PS tasks: start joined PS tasks up to count, move shards (coordinator's
        scale_ps), then stop the joined ones that left the PS list; the ScaleReport (docs/elastic.md)."""
        joined = [d for d in self.ps if "--join" in d.argv and d.supervised]
        for _ in range(count - len(self.spec["ps"]) - len(joined)):
            joined.append(self.add_ps())
        report = coordinator.scale_ps(count)
        for d in joined:
            if d.index >= max(count, len(self.spec["ps"])):
                self.retire_ps(d)
        return report

    def retire_ps(self, d: Daemon, grace: float = 5.0) -> None:
        """Stop a PS that left the PS list (a drained joined PS: coord.remove_ps), by pid; not restarted."""
        d.supervised = False
        if d.proc is not None and d.proc.poll() is None:
            d.proc.terminate()
            try:
                d.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait(timeout=5)

    def _spawn(self, d: Daemon) -> Daemon:
        with open(d.log_path, "ab") as logf:
            d.lines_seen = _count_ready(d.log_path, d.role)
            d.proc = subprocess.Popen(d.argv, stdout=logf, stderr=subprocess.STDOUT, env=self._env,
                                      start_new_session=True)
        return d

    def wait_ready(self, d: Daemon, timeout: float = 60.0) -> None:
        """Wait until d's current process printed READY (a worker: SERVING, its ports open)."""
        deadline = time.monotonic() + timeout
        while _count_ready(d.log_path, d.role) <= d.lines_seen:
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
            if "--join" in d.argv:  # a PS that joined: the same address gets the same index back
                d.argv = d.argv + ["--restore"] * ("--restore" not in d.argv)
            else:
                d.argv = self._argv(d.role, d.index, restore=d.role == "ps")
            self._spawn(d)
            d.restarts += 1  # only once the new process exists: watchers of `restarts` see it
        if wait:
            self.wait_ready(d, wait)

    def kill(self, d: Daemon, sig: int = signal.SIGKILL) -> None:
        """Send sig to d's process (by pid)."""
        assert d.proc is not None
        # send_signal, not os.kill(pid): it signals nothing once the process was reaped, so a pid the
        # system handed to another process since is never hit
        d.proc.send_signal(sig)
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

    def _terminate(self) -> list[subprocess.Popen[bytes]]:
        """Stop supervising and send SIGTERM to every live process this cluster started; returns them."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=2)
        with self._lock:
            procs = [d.proc for d in self.ps + self.workers if d.proc is not None and d.proc.poll() is None]
        for p in procs:
            try:
                p.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        return procs

    def stop(self, grace: float = 5.0) -> None:
        """Stop every process this cluster started: SIGTERM, then SIGKILL after grace."""
        procs = self._terminate()
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


def _count_ready(path: pathlib.Path, role: str) -> int:
    # A worker prints READY once it has registered with the coordinator, which a LocalCluster's user
    # starts after start() returns: the launcher waits for its SERVING line (ports open) instead.
    marker = b"SERVING " if role == "worker" else b"READY "
    try:
        data = path.read_bytes()
        return data.count(b"\n" + marker) + data.startswith(marker)
    except FileNotFoundError:
        return 0


def up_main(args: argparse.Namespace) -> int:
    """`pscluster up`: a supervised local cluster with a coordinator, until Ctrl-C/SIGTERM (exit 0)."""
    from pscluster.coordinator.coordinator import ClusterCoordinator

    stop = daemon.stop_on_signals()
    plan = PortPlan(args.base_port, args.ps, args.workers)
    if plan.last() > 65535:
        raise ConfigError(f"--base-port {args.base_port}: the cluster needs ports {plan.base}..{plan.last()}, "
                          "beyond 65535")
    extra: dict[str, Any] = {}
    if args.tls_dir:
        extra["tls_dir"] = str(pathlib.Path(args.tls_dir).resolve())  # clients read it from --write-cluster
        extra["require_client_cert"] = bool(args.require_client_cert)
    elif args.require_client_cert:
        raise ConfigError("--require-client-cert needs --tls-dir (pscluster certs --out DIR)")
    cluster = LocalCluster(args.ps, args.workers, workdir=args.checkpoint_dir, token=load_token(args.token_file),
                           checkpoint_dir=args.checkpoint_dir, restore=True, base_port=args.base_port, extra=extra)
    coord = None
    try:
        try:
            cluster.start()
        except (FailedPreconditionError, DeadlineExceededError) as exc:
            raise StartupError(f"up: {exc}") from exc
        coord = ClusterCoordinator(cluster.settings(task_type="coordinator"))
        if args.write_cluster:
            pathlib.Path(args.write_cluster).write_text(cluster.cluster_file.read_text())
        try:  # READY means usable: every worker started here has registered
            coord.wait_for_workers(len(cluster.workers), timeout=coord.settings.startup_timeout_s)
        except DeadlineExceededError as exc:
            raise StartupError(f"up: {exc}") from exc
        step = coord.global_step
        print(f"READY up: {len(cluster.ps)} PS, {_plural(len(cluster.workers), 'worker')}, coordinator at "
              f"{cluster.spec['coordinator']}, global_step={step}; cluster spec: "
              f"{args.write_cluster or cluster.cluster_file}", flush=True)
        stop.wait()
        print("up: stopping: coordinator, then workers and PS tasks (up to 1 s for running closures)", flush=True)
    finally:
        if coord is not None:
            coord.shutdown()  # first: its PS monitor would warn about PS tasks going down
        cluster.stop(grace=1.0)  # Ctrl-C means now: a closure still running after 1 s is killed with its worker
    print("up: stopped", flush=True)
    return 0


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
