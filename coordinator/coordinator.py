"""ClusterCoordinator: schedule closures onto workers, collect results, survive worker and PS failures.

    coord = ClusterCoordinator(load_settings("cluster.yaml"))   # workers register with it
    w = coord.create_variable("w", initial_value=np.zeros((784, 10), np.float32), optimizer=SGD(0.5))
    it = iter(coord.create_per_worker_dataset(make_batches))
    results = [coord.schedule(step, args=(it,)) for _ in range(1000)]
    coord.join()                      # raises the first error raised inside a closure
    losses = coord.fetch(results)

One thread (`coordinator-loop`) owns the scheduler state and applies `scheduler.decide`'s actions; RPC
completions, registrations, heartbeats and ticks reach it as events on a queue.
"""

from __future__ import annotations

import itertools
import logging
from collections import defaultdict, deque
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import grpc

from pscluster import context, metrics, rpc
from pscluster.client import PSClient
from pscluster.config import Settings, load_settings
from pscluster.coordinator import scheduler as sch
from pscluster.coordinator.dispatch import FramedDispatcher
from pscluster.coordinator.ps_monitor import PsMonitor
from pscluster.coordinator.api import CoordinatorAPI
from pscluster.coordinator.values import RemoteValue
from pscluster.framing import STATUS_BY_VALUE
from pscluster.errors import AbortedError, DeadlineExceededError, NotFoundError, PsclusterError, UnavailableError
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc
from pscluster.closures import ClosureEncoder

log = logging.getLogger(__name__)
_STOP = object()


class ClusterCoordinator(CoordinatorAPI):
    """Schedules step closures onto the cluster's workers (TF's ClusterCoordinator, plus failure handling)."""

    def __init__(self, cluster: Settings | str | None = None, *, serve: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = cluster if isinstance(cluster, Settings) else load_settings(cluster)
        self.client = PSClient(self.settings)
        context.set_default_client(self.client)
        self._clock = clock
        self._state = sch.SchedulerState(
            max_inflight=self.settings.max_inflight_per_worker,
            heartbeat_timeout=self.settings.heartbeat_timeout_s,
            no_worker_timeout=self.settings.no_worker_timeout_s)
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._values: dict[int, RemoteValue] = {}
        self._payloads: dict[int, bytes] = {}
        self._replies: dict[int, pb.RunClosureReply] = {}  # staged until the scheduler resolves them
        self._encoder = ClosureEncoder()
        self._rpcs: dict[tuple[int, str], grpc.Future] = {}
        self._closure_addresses: dict[str, str] = {}
        self._dispatcher = FramedDispatcher(self.settings.token_value(), self._framed_reply, self._framed_failure)
        self._stubs: dict[str, tuple[grpc.Channel, pb_grpc.WorkerStub]] = {}
        # Closure ids are unique across coordinator restarts: push ids derive from them.
        self._ids = itertools.count((int.from_bytes(os.urandom(3), "little") << 32) + 1)
        self._cond = threading.Condition()
        self._outstanding = 0
        self._join_error: tuple[int, BaseException] | None = None
        self.sync_mode = "async"
        self.known_workers: set[str] = set()
        self.worker_index: dict[str, int] = {}
        self._stop = threading.Event()
        self.initial_step = max(s.global_step for s in self.client.status())
        self._monitor = PsMonitor(self.client, on_down=lambda: self._events.put((sch.PsDown(), None)),
                                  on_up=lambda: self._events.put((sch.PsUp(), None))).start()
        self._loop = threading.Thread(target=self._run, name="coordinator-loop", daemon=True)
        self._ticker = threading.Thread(target=self._tick, name="coordinator-tick", daemon=True)
        self._loop.start()
        self._ticker.start()
        self._completions: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=512))
        self.metrics_port = 0
        if self.settings.metrics_port is not None:
            self.metrics_port = metrics.serve(metrics.coordinator_registry(self._metrics_snapshot),
                                              self.settings.bind_host, self.settings.metrics_port)
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

    def schedule_payload(self, payload: bytes) -> RemoteValue:
        """Queue an already-serialized closure (used by the coordinator daemon's clients)."""
        cid = next(self._ids)
        value = RemoteValue(cid)
        with self._cond:
            self._values[cid] = value
            self._payloads[cid] = payload
            self._outstanding += 1
        self._events.put((sch.Submit(cid), None))
        return value

    def remote_value(self, closure_id: int) -> RemoteValue:
        """The RemoteValue of a closure scheduled on this coordinator.

        Raises:
            NotFoundError: no such closure here.
        """
        value = self._values.get(closure_id)
        if value is None:
            raise NotFoundError(f"no closure {closure_id} on this coordinator")
        return value

    def join(self, timeout: float | None = None) -> None:
        """Wait for every scheduled closure; raise the first error raised inside one (then clear it).

        Raises:
            DeadlineExceededError: closures still outstanding after timeout.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._outstanding == 0, timeout):
                raise DeadlineExceededError(f"join: {self._outstanding} closures still outstanding after {timeout} s")
        self._raise_pending_error()

    def done(self) -> bool:
        """True when nothing is outstanding; raises a pending closure error like join()."""
        with self._cond:
            finished = self._outstanding == 0
        self._raise_pending_error()
        return finished

    def configure_sync(self, mode: str = "sync", replicas_to_aggregate: int | None = None,
                       total_num_replicas: int | None = None, staleness: int = 0) -> int:
        """Choose the update mode: "async", "sync" (token queue) or "bounded" (staleness tau).

        sync defaults to R = N = the number of live workers; N > R makes the slowest N - R backups.
        Call it while no closure runs. Returns the global step.
        """
        self.join()
        r = replicas_to_aggregate or max(1, self.num_workers())
        n = total_num_replicas or r
        step = self.client.configure_sync(mode, r, n, staleness)
        self.sync_mode = mode
        self._events.put((sch.SetConcurrency(n if mode == "sync" else None), None))
        return step

    def sync_stats(self) -> dict[str, float]:
        """Global step, stale gradients dropped (all PS), and bounded mode's widest admitted spread."""
        reply = self.client.sync_step()
        return {"global_step": reply.global_step, "dropped_stale": reply.dropped_stale,
                "max_spread": reply.max_spread}

    def checkpoint(self, step: int | None = None) -> list[str]:
        """Join, then write a checkpoint of every PS at one global step (consistent: no push in flight)."""
        self.join()
        return self.client.checkpoint(self.global_step if step is None else step)

    @property
    def lost_updates(self) -> int:
        """Updates applied on a PS after its last checkpoint and lost when it restarted."""
        return self._monitor.lost_updates

    @property
    def global_step(self) -> int:
        """Async: the PS's step at start plus closures completed since; sync/bounded: PS 0's step."""
        if self.sync_mode != "async":
            return int(self.client.sync_step().global_step)
        return self.initial_step + self._state.completed

    def status(self) -> pb.CoordinatorStatus:
        """Queue, counters and workers, as reported by `pscluster status`."""
        st = self._state
        rates = self.worker_rates()
        workers = [pb.WorkerState(worker_id=w.wid, address=w.address, state=w.state, closures_done=w.done,
                                  steps_per_s=rates.get(w.wid, 0.0))
                   for w in list(st.workers.values())]
        return pb.CoordinatorStatus(queued=len(st.queue), running=st.running(), done=st.completed,
                                    retried=st.retried, failed=st.failed, workers=workers,
                                    lost_updates=self.lost_updates)

    def worker_rates(self, window: float = 10.0) -> dict[str, float]:
        """Closures completed per second by each live worker over the last `window` seconds."""
        now = time.monotonic()
        out = {}
        for w in list(self._state.workers.values()):
            times = list(self._completions.get(w.wid, ()))
            out[w.wid] = sum(1 for t in times if now - t <= window) / window
        return out

    def _metrics_snapshot(self) -> dict[str, Any]:
        st = self._state
        return {"queued": len(st.queue), "running": st.running(), "done": st.completed, "retried": st.retried,
                "failed": st.failed, "workers_alive": self.num_workers(), "lost_updates": self.lost_updates,
                "rates": self.worker_rates()}

    def num_workers(self) -> int:
        """Workers currently registered and alive."""
        return sum(1 for w in list(self._state.workers.values()) if w.state == "alive")

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
        self._monitor.stop()
        self._events.put((_STOP, None))
        self._loop.join(timeout=5)
        self._ticker.join(timeout=5)
        if self._server is not None:
            self._server.stop(grace=0.5).wait()
        for channel, _ in list(self._stubs.values()):
            channel.close()
        self._dispatcher.close()
        self.client.close()
        context.set_default_client(None)

    def __enter__(self) -> ClusterCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- entry points for the servicer -------------------------------------------------------------
    def register(self, worker_id: str, address: str, closure_port: int = 0, timeout: float = 5.0) -> int:
        """Register a worker (or refresh it); returns its index."""
        if closure_port and self.settings.bulk_transport:
            self._closure_addresses[worker_id] = f"{address.rpartition(':')[0]}:{closure_port}"
        reply: Future[list[sch.Action]] = Future()
        self._events.put((sch.Register(worker_id, address), reply))
        for action in reply.result(timeout):
            if isinstance(action, sch.Registered) and action.wid == worker_id:
                return action.index
        raise UnavailableError(f"worker {worker_id} could not register")

    def heartbeat(self, worker_id: str, leaving: bool) -> bool:
        """Record a heartbeat (or a leaving notice); False if the worker must re-register."""
        known = worker_id in self.known_workers
        if known:
            self._events.put((sch.Leave(worker_id) if leaving else sch.Heartbeat(worker_id), None))
        return known

    # -- the loop that owns the state ------------------------------------------------------------
    def _tick(self) -> None:
        period = min(0.25, self.settings.heartbeat_interval_s / 2)
        while not self._stop.wait(period):
            self._events.put((sch.Tick(), None))

    def _run(self) -> None:
        while True:
            event, reply = self._events.get()
            if event is _STOP:
                return
            if isinstance(event, tuple):  # (Finished, RunClosureReply) from an RPC callback
                event, closure_reply = event
                self._store_reply(event.cid, closure_reply)
            try:
                actions = sch.decide(self._state, event, self._clock())
                for action in actions:
                    self._perform(action)
            except Exception as exc:  # noqa: BLE001 - the loop must survive; a bug is logged loudly
                log.exception("coordinator loop: failed on %s", event)
                actions = []
                if reply is not None:
                    reply.set_exception(exc)
                    continue
            if reply is not None:
                reply.set_result(actions)

    def _store_reply(self, cid: int, reply: pb.RunClosureReply) -> None:
        if reply.versions:
            self._monitor.record(list(reply.versions))
        value = self._values.get(cid)
        if value is not None and not value.done():
            self._replies[cid] = reply  # published by the Resolve action

    def _perform(self, action: sch.Action) -> None:
        if isinstance(action, sch.Dispatch):
            self._dispatch(action)
        elif isinstance(action, sch.Resolve):
            value = self._values[action.cid]
            reply = self._replies.pop(action.cid)
            value._set_reply(reply)
            if reply.HasField("error"):
                log.warning("closure %d raised %s: %s", action.cid, reply.error.type_name, reply.error.message)
                self._finish(action.cid, value.outcome()[1])
            else:
                self._finish(action.cid, None)
        elif isinstance(action, sch.Cancel):
            self._values[action.cid]._set_error(AbortedError(f"closure {action.cid} {action.reason}"))
            self._finish(action.cid, None)
        elif isinstance(action, sch.FailUnscheduled):
            err = UnavailableError(action.reason)
            self._values[action.cid]._set_error(err)
            log.error("closure %d failed: %s", action.cid, action.reason)
            self._finish(action.cid, err)
        elif isinstance(action, sch.Abandon):
            fut = self._rpcs.pop((action.cid, action.wid), None)
            if fut is not None:
                fut.cancel()
            self._dispatcher.abandon(action.cid, action.wid)
        elif isinstance(action, sch.WorkerGone):
            self.known_workers.discard(action.wid)
            log.warning("%s; closures %s rescheduled", action.reason, list(action.rescheduled) or "none")
            entry = self._stubs.pop(action.address, None)
            if entry is not None:
                entry[0].close()
            self._dispatcher.forget(action.wid)
            self._closure_addresses.pop(action.wid, None)
        elif isinstance(action, sch.Registered):
            if action.wid not in self.known_workers:
                log.info("worker %d (%s) joined", action.index, action.wid)
            self.known_workers.add(action.wid)
            self.worker_index[action.wid] = action.index
        elif isinstance(action, sch.WatchPs):
            self._monitor.wake()

    def _finish(self, cid: int, error: BaseException | None) -> None:
        self._payloads.pop(cid, None)
        with self._cond:
            if error is not None and self._join_error is None:
                self._join_error = (cid, error)
            self._outstanding -= 1
            self._cond.notify_all()

    def _raise_pending_error(self) -> None:
        with self._cond:
            pending, self._join_error = self._join_error, None
        if pending is not None:
            self._events.put((sch.ErrorReported(), None))
            raise pending[1]

    def _dispatch(self, action: sch.Dispatch) -> None:
        request = pb.RunClosureRequest(closure_id=action.cid, attempt=action.attempt,
                                       payload=self._payloads[action.cid], sync_mode=self.sync_mode,
                                       worker_index=self.worker_index.get(action.wid, 0))
        framed = self._closure_addresses.get(action.wid)
        if framed is not None:
            self._dispatcher.dispatch(action.wid, framed, request)
            return
        entry = self._stubs.get(action.address)
        if entry is None:
            channel = rpc.open_channel(action.address, self.settings)
            entry = (channel, pb_grpc.WorkerStub(channel))
            self._stubs[action.address] = entry
        fut = entry[1].RunClosure.future(request, timeout=self.settings.rpc_timeout_s * 100)
        self._rpcs[(action.cid, action.wid)] = fut
        fut.add_done_callback(lambda f, cid=action.cid, wid=action.wid: self._completed(cid, wid, f))

    def _completed(self, cid: int, wid: str, fut: grpc.Future) -> None:
        if fut.cancelled():
            return  # abandoned by the scheduler
        try:
            reply = fut.result()
        except grpc.RpcError as exc:
            err = rpc.translate(exc, "RunClosure")
            self._events.put((sch.TransportFailed(cid, wid, f"failed a closure RPC ({err})"), None))
            return
        finally:
            self._rpcs.pop((cid, wid), None)
        self._closure_reply(cid, wid, reply)

    def _framed_reply(self, cid: int, wid: str, reply: pb.BulkReply) -> None:
        if reply.code:
            self._framed_failure(cid, wid, f"refused a closure ({STATUS_BY_VALUE.get(reply.code)}: {reply.message})")
        else:
            self._closure_reply(cid, wid, reply.closure)

    def _framed_failure(self, cid: int, wid: str, reason: str) -> None:
        self._events.put((sch.TransportFailed(cid, wid, reason), None))

    def _closure_reply(self, cid: int, wid: str, reply: pb.RunClosureReply) -> None:
        if reply.retryable:
            log.warning("closure %d hit an unavailable PS: %s", cid, reply.error.message)
            self._events.put((sch.Finished(cid, wid, "retry"), None))
        else:
            if not reply.HasField("error"):
                self._completions[wid].append(time.monotonic())
            outcome = "user_error" if reply.HasField("error") else "ok"
            self._events.put(((sch.Finished(cid, wid, outcome), reply), None))
