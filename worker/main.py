"""Start a worker daemon: serve closures, register and heartbeat with the coordinator, drain on SIGTERM."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable

from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc
from pscluster.worker.frames import closure_server
from pscluster.worker.runner import ClosureRunner
from pscluster.worker.servicer import InflightGate, WorkerServicer

from pscluster.client import context
from pscluster.client.client import PSClient
from pscluster.client.datasets import WorkerDatasets, WorkerInfo
from pscluster.config import Settings
from pscluster.errors import PsclusterError, StartupError
from pscluster.net import frame_server, rpc, shm, tls
from pscluster.net.frame_server import Listeners
from pscluster.ops import daemon
from pscluster.ops.daemon import Waiter

log = logging.getLogger(__name__)


class Heartbeater:
    """Registers with the coordinator and heartbeats every interval; re-registers when forgotten."""

    def __init__(self, settings: Settings, worker_id: str, address: str, on_index: WorkerDatasets,
                 closure_port: int = 0, on_give_up: Callable[[], None] = lambda: None) -> None:
        assert settings.cluster.coordinator is not None
        self._channel = rpc.open_channel(settings.cluster.coordinator, settings)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._settings = settings
        self._worker_id = worker_id
        self._address = address
        self._datasets = on_index
        self._closure_port = closure_port
        self._stop = threading.Event()
        self._registered = False
        self.registered = threading.Event()  # set by the first successful registration (READY waits on it)
        self._on_give_up = on_give_up
        self.failure: StartupError | None = None  # set when start-up gave up on the coordinator
        self._subject = f"the coordinator at {settings.cluster.coordinator}"
        self._waiter: Waiter | None = None  # start-up's wait; None once registered
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def start(self) -> None:
        """Try to register once here (a refused token fails before SERVING), then heartbeat in a thread
        (`registered` is set once a registration succeeded).

        Raises:
            StartupError: the coordinator refused this worker (e.g. a wrong token).
        """
        self._waiter = Waiter(f"worker {self._worker_id}", self._subject, self._settings.startup_timeout_s)
        try:
            self._register()
            self._waiter = None
        except PsclusterError as exc:
            if not exc.retryable:
                self._channel.close()
                assert self._waiter is not None  # still waiting: registration has not succeeded yet
                self._waiter.failed(exc)  # raises StartupError naming the refusal
        self._thread.start()

    def _register(self) -> None:
        reply = rpc.call(self._stub.Register, pb.RegisterRequest(worker_id=self._worker_id, address=self._address,
                                                                 closure_port=self._closure_port),
                         timeout=2.0, what="register with coordinator")
        self._datasets.info = WorkerInfo(self._worker_id, reply.worker_index)
        self._registered = True
        log.info("worker %s: registered as worker %d at %s", self._worker_id, reply.worker_index, self._address)
        self.registered.set()

    def _loop(self) -> None:
        interval = self._settings.heartbeat_interval_s
        subject, waiter = self._subject, self._waiter
        while not self._stop.is_set():
            delay = interval
            try:
                if not self._registered:
                    self._register()
                    if waiter is not None:
                        waiter.succeeded()
                        waiter = None  # start-up is over: later losses are coordinator restarts
                else:
                    reply = rpc.call(self._stub.Heartbeat, pb.HeartbeatRequest(worker_id=self._worker_id),
                                     timeout=max(interval, 1.0), what="heartbeat")
                    self._registered = reply.known
            except PsclusterError as exc:
                if waiter is not None:
                    try:
                        delay = waiter.failed(exc)
                    except StartupError as give_up:
                        self.failure = give_up
                        self._on_give_up()
                        return
                elif self._registered:
                    log.warning("worker %s: lost %s (%s); re-registering when it is back",
                                self._worker_id, subject, type(exc).__name__)
                self._registered = False
            self._stop.wait(delay)

    def leave(self, notify: bool = True) -> None:
        """Stop heartbeating; with notify, tell the coordinator this worker is leaving (best effort)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        if notify and self._registered:
            try:
                rpc.call(self._stub.Heartbeat, pb.HeartbeatRequest(worker_id=self._worker_id, leaving=True),
                         timeout=1.0, what="leave")
            except PsclusterError:
                pass
        self._channel.close()


def start(settings: Settings, ps_resolver: Callable[[int], str] | None = None
          ) -> tuple[Listeners, int, WorkerServicer]:
    """Start the worker's gRPC server (and its framed closure port); returns (server, port, servicer).

    ps_resolver: where PS i is now, for PS tasks a scheduler may move (see PSClient).
    """
    worker_id = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(2).hex()}"
    client = PSClient(settings, retry_for=1.0, resolver=ps_resolver)
    context.set_default_client(client)
    datasets = WorkerDatasets(WorkerInfo(worker_id, settings.task_index))
    runner = ClosureRunner(client, datasets, metrics=settings.metrics_port is not None)
    servicer = WorkerServicer(runner, worker_id, InflightGate())
    address = settings.listen_address() if settings.task_index < len(settings.cluster.worker) \
        else f"{settings.bind_host}:{settings.port or 0}"
    server, port = rpc.create_server(settings, lambda s: pb_grpc.add_WorkerServicer_to_server(servicer, s),
                                     address=address, name="worker")
    frames = None
    if settings.bulk_transport:
        frames = closure_server(servicer, settings.bind_host, settings.token_value(),
                                settings.max_message_bytes, port=settings.framed_port or 0,
                                **frame_server.limits(settings, tls.CLOSURE_ROLES)).start()
        servicer.closure_port = frames.port
    return Listeners(server, frames), port, servicer


def serve(settings: Settings) -> None:
    """Run a worker daemon until SIGTERM (drain, then leave) or SIGINT.

    Raises:
        StartupError: the coordinator did not answer within startup_timeout_s, or refused our token.
    """
    stop = daemon.stop_on_signals(settings.parent_pid)
    shm.sweep()  # segments a killed process left behind (pscluster/net/shm.py)
    server, port, servicer = start(settings)
    advertised = f"{settings.advertise_host or settings.bind_host}:{port}"
    heart = None
    try:
        if settings.cluster.coordinator:
            heart = Heartbeater(settings, servicer.worker_id, advertised, servicer.runner.datasets,
                                servicer.closure_port, on_give_up=stop.set)
            heart.start()
        metrics = ""
        if settings.metrics_port is not None and servicer.runner.metrics is not None:
            from pscluster.ops.metrics import serve as metrics_serve

            bound = metrics_serve(servicer.runner.metrics.registry, settings.metrics_host, settings.metrics_port)
            metrics = f" metrics={bound}"
        # SERVING: its ports are open (a launcher that starts the coordinator afterwards waits for this);
        # READY: it has also registered with the coordinator, so closures can reach it
        print(f"SERVING worker {servicer.worker_id} {advertised}{metrics}", flush=True)
        while heart is not None and not heart.registered.is_set() and not stop.is_set():
            heart.registered.wait(0.05)  # a give-up (startup_timeout_s) or a signal sets stop
        if not stop.is_set():
            print(f"READY worker {servicer.worker_id} {advertised}{metrics}", flush=True)
        stop.wait()
        if heart is not None and heart.failure is not None:
            heart.leave(notify=False)
            raise heart.failure
        log.info("worker %s: stopping; draining closures for up to %.1f s", servicer.worker_id,
                 settings.drain_timeout_s)
        if heart is not None:
            threading.Thread(target=heart.leave, name="leave", daemon=True).start()
        drained = servicer.gate.drain(settings.drain_timeout_s)
        if not drained:
            log.warning("worker %s: closures still running after drain timeout; they will be rescheduled",
                        servicer.worker_id)
    finally:
        server.stop(grace=0.5).wait()
