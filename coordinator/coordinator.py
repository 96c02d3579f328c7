"""ClusterCoordinator: schedule closures onto workers, collect results, survive worker and PS failures.

    coord = ClusterCoordinator(load_settings("cluster.yaml"))   # workers register with it
    w = coord.create_variable("w", initial_value=np.zeros((784, 10), np.float32), optimizer=SGD(0.5))
    it = iter(coord.create_per_worker_dataset(make_batches))
    results = [coord.schedule(step, args=(it,)) for _ in range(1000)]
    coord.join()                      # raises the first error raised inside a closure
    losses = coord.fetch(results)

One thread (`coordinator-loop`) owns the scheduler state and applies `scheduler.decide`'s actions; RPC
completions, registrations, heartbeats and ticks reach it as events on its `Inbox`. After each batch of
events it publishes an immutable `Snapshot` that every other thread reads. Nothing here grows with
the closures a job has run: a finished closure's record is dropped, and its RemoteValue is held only
weakly (the caller owns it) unless a remote client still has to fetch it (`RetainedValues`).

No background thread dies unnoticed: the loop survives a failing event; a thread that ends on an
exception (loop, ticker, PS monitor giving up) fails `join()`/`done()` with that exception as cause.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import grpc
from pscluster.coordinator import scheduler as sch
from pscluster.coordinator.api import CoordinatorAPI
from pscluster.coordinator.checkpoints import AutoCheckpointer
from pscluster.coordinator.clients import LongPolls, RetainedValues
from pscluster.coordinator.curves import TrainingCurves
from pscluster.coordinator.dispatch import ClosureSender
from pscluster.coordinator.elastic import JOIN_GRACE_S, Elastic, ScaleReport, never
from pscluster.coordinator.inbox import Inbox, Posted
from pscluster.coordinator.job_queues import MAIN
from pscluster.coordinator.joins import JobJoins, JobSessions
from pscluster.coordinator.ps_watch import start_ps_watch
from pscluster.coordinator.replicas import Copies
from pscluster.coordinator.snapshot import RateMeter, Snapshot, take, to_status
from pscluster.coordinator.values import RemoteValue, reply_error
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc

from pscluster.client import context
from pscluster.client.client import PSClient
from pscluster.closures import ClosureEncoder
from pscluster.config import Settings, load_settings
from pscluster.errors import (
    AbortedError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    NotFoundError,
    PsclusterError,
    UnavailableError,
)
from pscluster.net import rpc

log = logging.getLogger(__name__)
_BATCH = 256  # events applied between two snapshots
REPLICAS_1_REFUSAL = ("moving shards between PS tasks needs the replica table: with replicas: 1 and elastic: false "
                      "clients find a shard by its handle's placement (k mod P), so a moved shard could not be found; "
                      "start the cluster with elastic: true (one copy, routed by the table) or replicas: 2 "
                      "(docs/elastic.md)")
JOIN_REFUSAL = ("a PS joining (--join) needs the replica table (replicas: 2, or elastic: true); this cluster runs with "
                "replicas: 1 and elastic: false, where clients find a shard by its handle's placement (docs/elastic.md)")
LONG_POLL_SLICE_S = 2.0  # a remote Join/Fetch waits at most this long in a server thread, then re-polls


class ClusterCoordinator(CoordinatorAPI):
    """Schedules step closures onto the cluster's workers (TF's ClusterCoordinator, plus failure handling)."""

    def __init__(self, cluster: Settings | str | None = None, *, serve: bool = True,
                 clock: Callable[[], float] = time.monotonic, ps_resolver: Callable[[int], str] | None = None) -> None:
        self.settings = cluster if isinstance(cluster, Settings) else load_settings(cluster)
        self.client = PSClient(self.settings, resolver=ps_resolver)
        context.set_default_client(self.client)
        self._clock = clock
        self._state = sch.SchedulerState(
            max_inflight=self.settings.max_inflight_per_worker,
            heartbeat_timeout=self.settings.heartbeat_timeout_s,
            no_worker_timeout=self.settings.no_worker_timeout_s,
            job_idle_timeout=self.settings.job_idle_timeout_s)
        self._inbox = Inbox()
        # Held weakly: the caller's reference keeps a RemoteValue alive; remote clients' are retained.
        self._values: weakref.WeakValueDictionary[int, RemoteValue] = weakref.WeakValueDictionary()
        self._retained = RetainedValues(self.settings.result_retention_s, clock)
        self.long_polls = LongPolls(max(1, self.settings.server_threads // 2), LONG_POLL_SLICE_S)
        self._payloads: dict[int, tuple[str, bytes]] = {}  # queued/running closure -> (job, payload)
        self._encoder = ClosureEncoder()
        self._sender = ClosureSender(self.settings, self._inbox.post)
        # Closure ids are unique across coordinator restarts: push ids derive from them.
        self._ids = itertools.count((int.from_bytes(os.urandom(3), "little") << 32) + 1)
        self._submit_lock = threading.Lock()
        self._joins = JobJoins(on_error_reported=lambda job: self._inbox.post(sch.ErrorReported(job)))
        self._joins.open(MAIN)
        self.job = MAIN
        self.sessions = JobSessions(self._joins, self._inbox.post,
                                    self.settings.job_idle_timeout_s)
        # per job: (closures finished, first error) in the loop's current batch (loop only)
        self._batch: dict[str, tuple[int, tuple[int, BaseException] | None]] = {}
        self._rates = RateMeter()
        self._snapshot = Snapshot()
        self.sync_mode = "async"
        self._sync_config: pb.SyncConfigRequest | None = None
        self._stop = threading.Event()
        self.initial_step = max(s.global_step for s in self.client.status())
        # replicas: 2: the keeper owns shard -> (primary, backup, epoch) and promotes backups (docs/ps_failures.md)
        watch = start_ps_watch(self.settings, self.client, on_down=lambda: self._inbox.post(sch.PsDown()),
                               on_up=lambda: self._inbox.post(sch.PsUp()),
                               on_fatal=lambda exc: self._fail("ps-monitor", exc))
        self._watch = watch
        self._keeper, self._elastic, self._monitor = watch.keeper, watch.elastic, watch.monitor
        self._checkpointer = AutoCheckpointer.from_settings(
            self.settings, self.initial_step, step=lambda: self.global_step, save=self.client.checkpoint,
            clock=clock, on_fatal=lambda exc: self._fail("auto-checkpoint", exc))
        self._curves = TrainingCurves(self.settings.logdir, self.settings.curve_interval_s) \
            if self.settings.logdir is not None else None
        self._hyperparameters: dict[str, float] = {}  # what the driver set, for metrics and curves
        self._loop = self._thread(self._run, "coordinator-loop")
        self._ticker = self._thread(self._tick, "coordinator-tick")
        self.metrics_port = 0
        if self.settings.metrics_port is not None:
            from pscluster.ops import metrics  # prometheus_client only where metrics are served

            self.metrics_port = metrics.serve(metrics.coordinator_registry(self._metrics_snapshot),
                                              self.settings.metrics_host, self.settings.metrics_port)
        self._server: grpc.Server | None = None
        self.port = 0
        if serve:
            from pscluster.coordinator.servicer import CoordinatorServicer

            servicer = CoordinatorServicer(self)
            address = self.settings.cluster.coordinator or f"{self.settings.bind_host}:0"
            if self.settings.port is not None:
                address = f"{self.settings.bind_host}:{self.settings.port}"
            elif self.settings.cluster.coordinator:
                address = f"{self.settings.bind_host}:{address.rpartition(':')[2]}"
            self._server, self.port = rpc.create_server(
                self.settings, lambda s: pb_grpc.add_CoordinatorServicer_to_server(servicer, s),
                address=address, name="coordinator")

    # -- public API (TF names) -------------------------------------------------------------------
    def schedule(self, fn: Callable[..., Any], args: tuple[Any, ...] = (),
                 kwargs: dict[str, Any] | None = None) -> RemoteValue:
        """Queue fn(*args, **kwargs) to run on some worker; returns a RemoteValue at once."""
        return self.schedule_payload(self._encoder.encode(fn, tuple(args), dict(kwargs or {})))

    def schedule_payload(self, payload: bytes, *, retain: bool = False, job: str = MAIN) -> RemoteValue:
        """Queue an already-serialized closure in job; retain=True holds its result for a remote client.

        Raises:
            NotFoundError: job has ended (or never existed).
        """
        joins = self._joins.get(job)
        with self._submit_lock:  # ids reach the loop in increasing order (SchedulerState.final_below)
            cid = next(self._ids)
            value = RemoteValue(cid)
            joins.add()
            self._values[cid] = value
            self._payloads[cid] = (job, payload)
            if retain:
                self._retained.add(value)
            self._inbox.post(sch.Submit(cid, job))
        return value

    def remote_value(self, closure_id: int) -> RemoteValue:
        """The RemoteValue of a closure scheduled on this coordinator.

        Found while somebody holds it: the embedded caller's own reference (values are held weakly
        here), or, for closures a remote client scheduled through the daemon, until the client has
        fetched the result or `result_retention_s` after the closure finished (see clients.py).

        Raises:
            NotFoundError: no such closure here, or its result was fetched or expired.
        """
        value = self._values.get(closure_id)
        if value is None:
            raise NotFoundError(f"no closure {closure_id} on this coordinator (never scheduled here, or its "
                                f"result was already fetched or kept longer than result_retention_s="
                                f"{self.settings.result_retention_s:g})")
        return value

    def release(self, closure_id: int) -> None:
        """A remote client fetched closure_id's result: stop retaining it."""
        self._retained.release(closure_id)

    def join(self, timeout: float | None = None) -> None:
        """Wait for every scheduled closure; raise the first error raised inside one (then clear it).

        Raises:
            DeadlineExceededError: closures still outstanding after timeout.
            InternalError: a coordinator thread died (its exception is the cause).
        """
        self._joins.get(MAIN).wait(timeout)

    def done(self) -> bool:
        """True when nothing is outstanding; raises a pending closure error like join()."""
        return self._joins.get(MAIN).done()

    def configure_sync(self, mode: str = "sync", replicas_to_aggregate: int | None = None,
                       total_num_replicas: int | None = None, staleness: int = 0, *, job: str = MAIN) -> int:
        """Choose the update mode: "async", "sync" (token queue) or "bounded" (staleness tau).

        sync defaults to R = N = the number of live workers; N > R makes the slowest N - R backups.
        Call it while no closure runs: it waits for the calling job's closures (a daemon's other jobs
        are not waited for; the mode applies to every job) and leaves a closure error for join().
        Returns the global step.
        """
        self._joins.get(job).drain(None)
        r = replicas_to_aggregate or max(1, self.num_workers())
        n = total_num_replicas or r
        step = self.client.configure_sync(mode, r, n, staleness)
        self.sync_mode = mode
        self._sync_config = pb.SyncConfigRequest(mode=mode, replicas_to_aggregate=r, total_num_replicas=n,
                                                 staleness=staleness)  # for a PS that joins later
        self._inbox.post(sch.SetConcurrency(n if mode == "sync" else None))
        return step

    def checkpoint(self, step: int | None = None, *, job: str = MAIN) -> list[str]:
        """Wait for the calling job's closures, then write a checkpoint of every PS at one global step.

        A closure error is left for join() to report: a failed closure does not prevent the save.
        Consistent (no push in flight) when no other job runs closures at the same time.
        """
        self._joins.get(job).drain(None)
        return self.client.checkpoint(self.global_step if step is None else step)

    @property
    def lost_updates(self) -> int:
        """Shard updates of completed closures rolled back by PS restarts (summed over shards)."""
        return self._monitor.lost_updates

    def replica_table(self) -> dict[tuple[str, int], Copies]:
        """shard (variable, index) -> its primary, backup and epoch now (replicas: 2 or elastic); else empty."""
        return self._keeper.table() if self._keeper is not None else {}

    def scale_ps(self, count: int, cancelled: Callable[[], bool] = never) -> ScaleReport:
        """Make PS tasks 0..count-1 the active ones: shards move onto or off the others, joined tasks left
        drained leave the PS list (docs/elastic.md); `cancelled()` true stops it between moves (AbortedError)."""
        return self._elastic_ready().scale_to(count, cancelled)

    def add_ps(self, task: int, cancelled: Callable[[], bool] = never) -> ScaleReport:
        """A drained PS task, or one that joined the PS list, takes its share of the shards (docs/elastic.md)."""
        elastic = self._elastic_ready()
        if self._sync_config is not None and elastic.joined(task):  # it missed the mode's fan-out
            self.client.configure_sync_on(task, self._sync_config, retry_for=JOIN_GRACE_S)
        return elastic.add(task, cancelled)

    def remove_ps(self, task: int, cancelled: Callable[[], bool] = never) -> ScaleReport:
        """Drain a PS task: its shard copies move to the other active tasks; one that joined (not in the cluster
        file) and is the last of the PS list then leaves it (docs/elastic.md)."""
        return self._elastic_ready().remove(task, cancelled)

    def join_ps(self, address: str) -> tuple[int, list[str], int]:
        """A PS the cluster file does not list joins the PS list: (its task index, the list, its epoch). It holds
        nothing until add_ps(index) (docs/elastic.md)."""
        if self._elastic is None:
            raise FailedPreconditionError(JOIN_REFUSAL)
        return self._elastic.join(address)

    def _elastic_ready(self) -> Elastic:
        if self._elastic is None:
            raise FailedPreconditionError(REPLICAS_1_REFUSAL)
        return self._elastic

    def lost_updates_by_variable(self) -> dict[str, int]:
        """Lost shard updates per variable; for a one-shard counter, completed closures it lost."""
        return self._monitor.lost_updates_by_variable()

    @property
    def global_step(self) -> int:
        """Async: the PS's step at start plus closures completed since; sync/bounded: PS 0's step."""
        if self.sync_mode != "async":
            return int(self.client.sync_step().global_step)
        return self.initial_step + self._snapshot.completed

    def snapshot(self) -> Snapshot:
        """Counters and workers as of the loop's last batch of events (immutable; any thread)."""
        return self._snapshot

    def status(self) -> pb.CoordinatorStatus:
        """Queue, counters, workers and jobs, as reported by `pscluster status` (global_step -1: PS 0 down)."""
        try:
            step = self.global_step  # sync/bounded: asks PS 0, which may be down while status is wanted most
        except PsclusterError:
            step = -1
        return to_status(self._snapshot, self._clock(), lost_updates=self.lost_updates, global_step=step,
                         sync_mode=self.sync_mode, lost_by_variable=self.lost_updates_by_variable())

    def worker_rates(self) -> dict[str, float]:
        """Closures completed per second by each registered worker over the last 10 s (as of the last tick)."""
        return {w.wid: w.steps_per_s for w in self._snapshot.workers}

    def _metrics_snapshot(self) -> dict[str, Any]:
        snap = self._snapshot
        return {"queued": snap.queued, "running": snap.running, "done": snap.completed, "retried": snap.retried,
                "failed": snap.failed, "workers_alive": snap.alive, "lost_updates": self.lost_updates,
                "rates": {w.wid: w.steps_per_s for w in snap.workers}, "hyperparameters": self._hyperparameters}

    def record_hyperparameters(self, values: dict[str, float], variables: list[str] | None) -> None:
        scope = "" if variables is None else "[" + ",".join(variables) + "]"
        named = {f"{k}{scope}": v for k, v in values.items()}
        self._hyperparameters = {**self._hyperparameters, **named}  # a new dict: scrapes read it unlocked
        if self._curves is not None:
            self._curves.hyperparameters(named)

    def num_workers(self) -> int:
        """Workers currently registered and alive."""
        return self._snapshot.alive

    def wait_for_workers(self, n: int, timeout: float = 60.0) -> None:
        """Block until at least n workers have registered."""
        deadline = time.monotonic() + timeout
        while self.num_workers() < n:
            if time.monotonic() > deadline:
                raise DeadlineExceededError(f"only {self.num_workers()} of {n} workers registered after {timeout} s")
            time.sleep(0.02)

    def shutdown(self) -> None:
        """Stop the loop, the server and every connection."""
        self._stop.set()
        if self._checkpointer is not None:
            self._checkpointer.stop()
        if self._curves is not None:
            self._curves.stop()
        self._watch.stop()
        self._inbox.close()
        self._loop.join(timeout=5)
        self._ticker.join(timeout=5)
        if self._server is not None:
            self._server.stop(grace=0.5).wait()
        self._sender.close()
        self.client.close()
        context.set_default_client(None)

    # -- entry points for the servicer -------------------------------------------------------------
    def register(self, worker_id: str, address: str, closure_port: int = 0, timeout: float = 5.0) -> int:
        """Register a worker (or refresh it); returns its index."""
        framed = ""
        if closure_port and self.settings.bulk_transport:
            framed = f"{address.rpartition(':')[0]}:{closure_port}"
        try:
            actions = self._inbox.ask(sch.Register(worker_id, address, framed)).result(timeout)
        except TimeoutError:  # a busy event loop: retryable, so the worker tries again rather than giving up
            raise DeadlineExceededError(f"worker {worker_id}: the coordinator did not take the registration within "
                                        f"{timeout:.0f} s (busy); retry") from None
        for action in actions:
            if isinstance(action, sch.Registered) and action.wid == worker_id:
                return action.index
        raise UnavailableError(f"worker {worker_id} could not register")

    def heartbeat(self, worker_id: str, leaving: bool) -> bool:
        """Record a heartbeat (or a leaving notice); False if the worker must re-register."""
        known = self._snapshot.knows(worker_id)
        if known:
            self._inbox.post(sch.Leave(worker_id) if leaving else sch.Heartbeat(worker_id))
        return known

    # -- background threads ----------------------------------------------------------------------
    def _thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # noqa: BLE001 - reported through join(), never lost
                self._fail(name, exc)
        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return thread

    def _fail(self, name: str, exc: BaseException) -> None:
        """A background thread ended on exc: log it and make join()/done()/schedule() raise it."""
        if self._stop.is_set():
            return
        log.error("coordinator: thread %s died; join() will raise the cause", name, exc_info=exc)
        error = InternalError(f"coordinator thread {name} died: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        self._joins.fail(error)

    def _tick(self) -> None:
        period = min(0.25, self.settings.heartbeat_interval_s / 2)
        while not self._stop.wait(period):
            self._inbox.post(sch.Tick())

    # -- the loop that owns the state ------------------------------------------------------------
    def _run(self) -> None:
        while True:
            answers = []
            for posted in self._inbox.take(_BATCH):
                if posted is None:
                    return
                answers.append((posted.answer, self._apply(posted)))
            self._publish()
            for answer, outcome in answers:  # after the snapshot, so a registered worker is known
                if answer is None:
                    continue
                if isinstance(outcome, BaseException):
                    answer.set_exception(outcome)
                else:
                    answer.set_result(outcome)

    def _apply(self, posted: Posted) -> list[sch.Action] | BaseException:
        event, closure_reply = posted.event, posted.reply
        try:
            if closure_reply is not None and closure_reply.versions:
                self._monitor.record(list(closure_reply.versions))
            now = self._clock()
            actions = sch.decide(self._state, event, now)
            for action in actions:
                self._perform(action, closure_reply)
            if isinstance(event, sch.Tick):
                self._rates.sample(self._state, now)
            return actions
        except Exception as exc:
            log.exception("coordinator loop: failed on %s", event)
            return exc

    def _publish(self) -> None:
        """Swap in a new snapshot, then account the batch's finished closures (so join sees both)."""
        self._snapshot = take(self._state, self._rates)
        for job, (finished, error) in self._batch.items():
            self._joins.settle(job, finished, error)
        self._batch = {}

    def _perform(self, action: sch.Action, reply: pb.RunClosureReply | None) -> None:
        _PERFORMERS[type(action)](self, action, reply)

    def _resolved(self, action: sch.Resolve, reply: pb.RunClosureReply | None) -> None:
        assert reply is not None, f"closure {action.cid} resolved without a reply"
        if reply.HasField("report") and self._watch.reports is not None:
            self._watch.reports.reported(action.cid, reply.report)
        value = self._values.get(action.cid)
        if value is not None:
            value._set_reply(reply)
        error = None
        if reply.HasField("error"):
            log.warning("closure %d raised %s: %s", action.cid, reply.error.type_name, reply.error.message)
            error = value.outcome()[1] if value is not None else reply_error(action.cid, reply.error)
        elif self._curves is not None:
            self._curves.add(reply.scalars)
        self._finish(action.cid, error)

    def _cancelled(self, action: sch.Cancel, reply: object) -> None:
        self._resolve_with(action.cid, AbortedError(f"closure {action.cid} {action.reason}"))
        self._finish(action.cid, None)

    def _failed(self, action: sch.FailUnscheduled, reply: object) -> None:
        err = UnavailableError(action.reason)
        self._resolve_with(action.cid, err)
        log.error("closure %d failed: %s", action.cid, action.reason)
        self._finish(action.cid, err)

    def _worker_gone(self, action: sch.WorkerGone, reply: object) -> None:
        moved = list(action.rescheduled)
        log.warning("%s; %s", action.reason, f"closures {moved} rescheduled" if moved else "no closure to reschedule")
        self._sender.forget(action.wid)

    def _job_ended(self, action: sch.JobEnded, reply: object) -> None:
        log.info("job %s ended: %s", action.job, action.reason)
        self._joins.end(action.job, AbortedError(f"job {action.job} ended: {action.reason}"))

    def _resolve_with(self, cid: int, error: BaseException) -> None:
        value = self._values.get(cid)
        if value is not None:
            value._set_error(error)

    def _finish(self, cid: int, error: BaseException | None) -> None:
        job, _ = self._payloads.pop(cid, (None, b""))
        self._retained.touch(cid)
        if job is None:
            return
        finished, first = self._batch.get(job, (0, None))
        self._batch[job] = (finished + 1, first if first is not None or error is None else (cid, error))

    def _dispatch(self, action: sch.Dispatch, reply: object = None) -> None:
        request = pb.RunClosureRequest(closure_id=action.cid, attempt=action.attempt,
                                       payload=self._payloads[action.cid][1], sync_mode=self.sync_mode,
                                       worker_index=self._state.workers[action.wid].index,
                                       final_below=self._state.final_below(),
                                       push_pull=self.settings.push_pull and self.sync_mode == "async")
        self._sender.send(action, request)


def _registered(coord: ClusterCoordinator, action: sch.Registered, reply: object) -> None:
    if action.new:
        log.info("worker %d (%s) joined", action.index, action.wid)


# The loop's handler for each scheduler action (the action's own type picks it; every Action has one).
_PERFORMERS: dict[type, Callable[[ClusterCoordinator, Any, pb.RunClosureReply | None], None]] = {
    sch.Dispatch: ClusterCoordinator._dispatch, sch.Resolve: ClusterCoordinator._resolved,
    sch.Cancel: ClusterCoordinator._cancelled, sch.FailUnscheduled: ClusterCoordinator._failed,
    sch.Abandon: lambda coord, action, reply: coord._sender.abandon(action.cid, action.wid),
    sch.WorkerGone: ClusterCoordinator._worker_gone, sch.Registered: _registered,
    sch.WatchPs: lambda coord, action, reply: coord._monitor.wake(), sch.JobEnded: ClusterCoordinator._job_ended,
}
