"""RemoteCoordinator: submit closures to a coordinator daemon from another process, same API.

    with RemoteCoordinator(load_settings("cluster.yaml")) as coord:   # opens a job on the daemon
        v = coord.schedule(step, args=(it,)); coord.join(); print(v.fetch())
        coord.checkpoint()
    # shutdown() (or leaving the with block) ends the job: its queued closures are cancelled.
    # close() only detaches: RemoteCoordinator(settings, job=coord.job) re-attaches while the job lives,
    # and any connection fetches a result by id: coord.remote_value(v.closure_id).fetch()

Each client is one job on the daemon: its own closures, errors and join, served round-robin with the
other jobs. A thread (`job-keepalive`, owned here, stopped by close) sends KeepJob; a client that
stops sending it (killed, hung) has its job ended after the daemon's job_idle_timeout_s.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from pscluster.coordinator.api import CoordinatorAPI
from pscluster.coordinator.elastic import ScaleReport
from pscluster.coordinator.values import RemoteValue, reply_error
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc

from pscluster.client import context
from pscluster.client.client import PSClient
from pscluster.closures import ClosureEncoder
from pscluster.config import Settings
from pscluster.errors import DeadlineExceededError, FailedPreconditionError, PsclusterError, ResourceExhaustedError
from pscluster.net import rpc

log = logging.getLogger(__name__)


class _RemoteValue(RemoteValue):
    """A RemoteValue whose result is long-polled from the coordinator daemon."""

    def __init__(self, closure_id: int, owner: RemoteCoordinator) -> None:
        super().__init__(closure_id)
        self._owner = owner

    def done(self) -> bool:
        """True once the closure has finished on the daemon (asks it when not known here yet)."""
        if not super().done():
            reply = self._owner._call("Fetch", pb.FetchRequest(closure_id=self.closure_id, timeout_s=0))
            if reply.done:
                self._set_reply(reply.reply)
        return super().done()

    def fetch(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not super().done():
            wait = 10.0 if deadline is None else max(0.0, deadline - time.monotonic())
            reply = self._owner._poll("Fetch", pb.FetchRequest(closure_id=self.closure_id, timeout_s=wait))
            if reply is not None and reply.done:
                self._set_reply(reply.reply)
            elif deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceededError(f"closure {self.closure_id} not finished after {timeout} s")
        return super().fetch(0)


class RemoteCoordinator(CoordinatorAPI):
    """Client of a `pscluster coordinator` daemon with ClusterCoordinator's API."""

    def __init__(self, settings: Settings, job: str = "") -> None:
        """Open a new job on the daemon (job="": new; a live job's name: re-attach to it).

        Raises:
            NotFoundError: the named job has ended.
        """
        if settings.cluster.coordinator is None:
            raise FailedPreconditionError("the cluster spec names no coordinator address")
        self.settings = settings
        self._channel = rpc.open_channel(settings.cluster.coordinator, settings)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._encoder = ClosureEncoder()
        self._busy = 0.0  # backoff after RESOURCE_EXHAUSTED long polls
        try:
            opened = self._call("OpenJob", pb.JobRequest(job=job))
        except BaseException:
            self._channel.close()
            raise
        self.job: str = opened.job
        self.client = PSClient(settings)
        context.set_default_client(self.client)
        self._stop = threading.Event()
        self._keepalive = threading.Thread(target=self._keep, args=(opened.keepalive_interval_s,),
                                           name="job-keepalive", daemon=True)
        self._keepalive.start()

    def _keep(self, interval: float) -> None:
        """Tell the daemon this job's client is alive, until close() (or the daemon says the job ended)."""
        while not self._stop.wait(interval):
            try:
                reply = rpc.call(self._stub.KeepJob, pb.JobRequest(job=self.job), timeout=max(1.0, interval),
                                 what="coordinator KeepJob")
            except PsclusterError as exc:  # the daemon is down or busy: the next beat tries again
                log.warning("job %s: keepalive failed (%s); retrying in %.1f s", self.job, exc, interval)
                continue
            if not reply.known:
                log.error("job %s has ended on the coordinator; this client can no longer schedule", self.job)
                return

    def _call(self, method: str, request: Any) -> Any:
        return rpc.call(getattr(self._stub, method), request, timeout=60.0, what=f"coordinator {method}",
                        retry_for=30.0)

    def _poll(self, method: str, request: Any) -> Any | None:
        """One long poll (Join/Fetch); None when the daemon has no free poll slot (after a short backoff).

        The daemon caps concurrent long polls to keep threads for heartbeats (see clients.py) and
        answers RESOURCE_EXHAUSTED beyond the cap: that means "not done yet", so callers poll again.
        """
        try:
            reply = self._call(method, request)
        except ResourceExhaustedError:
            self._busy = min(max(2 * self._busy, 0.02), 0.5)
            time.sleep(self._busy * (0.5 + random.random()))
            return None
        self._busy = 0.0
        return reply

    def schedule(self, fn: Callable[..., Any], args: tuple[Any, ...] = (),
                 kwargs: dict[str, Any] | None = None) -> RemoteValue:
        """Submit fn(*args, **kwargs) to the coordinator daemon; returns a RemoteValue."""
        payload = self._encoder.encode(fn, tuple(args), dict(kwargs or {}))
        reply = self._call("Schedule", pb.ScheduleRequest(payload=payload, job=self.job))
        return _RemoteValue(reply.closure_id, self)

    def remote_value(self, closure_id: int) -> RemoteValue:
        """Re-attach to a closure scheduled earlier (e.g. by a previous connection)."""
        return _RemoteValue(closure_id, self)

    def join(self, timeout: float | None = None) -> None:
        """Wait for every closure this job scheduled; raise the first closure error (once)."""
        self._wait(timeout, keep_error=False)

    def _wait(self, timeout: float | None, keep_error: bool) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 10.0 if deadline is None else max(0.0, deadline - time.monotonic())
            reply = self._poll("Join", pb.JoinRequest(timeout_s=wait, job=self.job, keep_error=keep_error))
            if reply is not None and reply.done:
                if reply.HasField("error"):
                    raise reply_error(reply.closure_id_of_error, reply.error)
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceededError(f"join: closures still outstanding after {timeout} s")

    def done(self) -> bool:
        """True when this job has nothing outstanding; raises a pending closure error like join()."""
        reply = self._call("Join", pb.JoinRequest(timeout_s=0, job=self.job))
        if reply.done and reply.HasField("error"):
            raise reply_error(reply.closure_id_of_error, reply.error)
        return bool(reply.done)

    def status(self) -> pb.CoordinatorStatus:
        """The daemon's queue, counters, workers and jobs."""
        status: pb.CoordinatorStatus = self._call("Status", pb.CoordinatorStatusRequest())
        return status

    def configure_sync(self, mode: str = "sync", replicas_to_aggregate: int | None = None,
                       total_num_replicas: int | None = None, staleness: int = 0) -> int:
        """Choose the update mode on the daemon (see ClusterCoordinator.configure_sync); returns the global step."""
        self._wait(None, keep_error=True)
        config = pb.SyncConfigRequest(mode=mode, replicas_to_aggregate=replicas_to_aggregate or 0,
                                      total_num_replicas=total_num_replicas or 0, staleness=staleness)
        return int(self._call("ConfigureSync", pb.CoordinatorSyncRequest(job=self.job, config=config)).global_step)

    def checkpoint(self, step: int | None = None) -> list[str]:
        """Wait for this job's closures, then checkpoint every PS at one global step; returns the files written.

        A closure error is left for join() to report (see ClusterCoordinator.checkpoint).
        """
        self._wait(None, keep_error=True)
        request = pb.CoordinatorCheckpointRequest(job=self.job, has_step=step is not None, step=step or 0)
        return list(self._call("Checkpoint", request).paths)

    def scale_ps(self, count: int) -> ScaleReport:
        """Make PS tasks 0..count-1 the active ones (see ClusterCoordinator.scale_ps)."""
        return self._scale(pb.ScaleRequest(count=count))

    def add_ps(self, task: int) -> ScaleReport:
        """A drained PS task takes its share of the shards again (see ClusterCoordinator.add_ps)."""
        return self._scale(pb.ScaleRequest(add=task))

    def remove_ps(self, task: int) -> ScaleReport:
        """Drain a PS task (see ClusterCoordinator.remove_ps)."""
        return self._scale(pb.ScaleRequest(remove=task))

    def _scale(self, request: pb.ScaleRequest) -> ScaleReport:
        return scale(self._stub, request)

    @property
    def lost_updates(self) -> int:
        """Updates applied on a PS after its last checkpoint and lost when it restarted."""
        return int(self.status().lost_updates)

    def lost_updates_by_variable(self) -> dict[str, int]:
        """Lost shard updates per variable (see ClusterCoordinator.lost_updates_by_variable); a variable that lost
        none is left out."""
        return dict(self.status().lost_updates_by_variable)

    @property
    def global_step(self) -> int:
        """The daemon's global step (see ClusterCoordinator.global_step)."""
        return int(self.status().global_step)

    def num_workers(self) -> int:
        """Workers currently registered with the daemon and alive."""
        return sum(1 for w in self.status().workers if w.state == "alive")

    def worker_rates(self) -> dict[str, float]:
        """Closures completed per second by each registered worker over the last 10 s."""
        return {w.worker_id: w.steps_per_s for w in self.status().workers}

    def wait_for_workers(self, n: int, timeout: float = 60.0) -> None:
        """Block until at least n workers have registered with the daemon."""
        deadline = time.monotonic() + timeout
        while (alive := self.num_workers()) < n:
            if time.monotonic() > deadline:
                raise DeadlineExceededError(f"only {alive} of {n} workers registered after {timeout} s")
            time.sleep(0.05)

    def record_hyperparameters(self, values: dict[str, float], variables: list[str] | None) -> None:
        """Show values the driver set in the daemon's metrics and training curves (set_hyperparameters calls this)."""
        if values:
            self._call("NoteHyperparameters", pb.HyperparametersNote(values=values, variables=variables or [],
                                                                     all_variables=variables is None))

    def close(self) -> None:
        """Detach: stop the keepalive and close connections; the job lives on for job_idle_timeout_s."""
        self._stop.set()
        if self._keepalive is not threading.current_thread():
            self._keepalive.join(timeout=10)
        self._channel.close()
        self.client.close()
        context.set_default_client(None)

    def shutdown(self) -> None:
        """End this job on the daemon (its queued closures are cancelled), then close."""
        try:
            if not self._stop.is_set():
                self._call("EndJob", pb.JobRequest(job=self.job, reason="its client shut down"))
        finally:
            self.close()


def scale(stub: pb_grpc.CoordinatorStub, request: pb.ScaleRequest) -> ScaleReport:
    """One ScalePs call, not retried (a scale that ran half-way must be looked at, not repeated blindly)."""
    reply: pb.ScaleReply = rpc.call(stub.ScalePs, request, timeout=600.0, what="coordinator ScalePs")
    return ScaleReport(list(reply.active), reply.moves, [ms / 1e3 for ms in reply.freezes_ms], tuple(reply.left))
