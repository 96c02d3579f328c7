"""The Coordinator gRPC servicer: translate messages, call the ClusterCoordinator.

Join and Fetch are long polls: each waits in a server thread only inside a slot of the coordinator's
`long_polls` (a cap on concurrent waits and a short slice, see clients.py), so Register, Heartbeat
and Status always find a free thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import grpc
from pscluster.coordinator.clients import LongPolls
from pscluster.coordinator.elastic import ScaleReport
from pscluster.coordinator.job_queues import MAIN
from pscluster.coordinator.joins import JobSessions
from pscluster.coordinator.values import RemoteValue
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc

from pscluster.config import Settings
from pscluster.errors import DeadlineExceededError, InvalidArgumentError


class CoordinatorCore(Protocol):
    """What the servicer calls (ClusterCoordinator is the one implementation)."""

    settings: Settings
    long_polls: LongPolls
    sessions: JobSessions

    def schedule_payload(self, payload: bytes, *, retain: bool = False, job: str = MAIN) -> RemoteValue:
        """Queue a serialized closure in job."""

    def remote_value(self, closure_id: int) -> RemoteValue:
        """The RemoteValue of a scheduled closure."""

    def release(self, closure_id: int) -> None:
        """A remote client fetched closure_id's result."""

    def configure_sync(self, mode: str = "sync", replicas_to_aggregate: int | None = None,
                       total_num_replicas: int | None = None, staleness: int = 0, *, job: str = MAIN) -> int:
        """Choose the update mode; the global step."""

    def checkpoint(self, step: int | None = None, *, job: str = MAIN) -> list[str]:
        """Write a checkpoint of every PS."""

    def status(self) -> pb.CoordinatorStatus:
        """Queue, counters, workers and jobs."""

    def scale_ps(self, count: int, cancelled: Callable[[], bool]) -> ScaleReport:
        """Make PS tasks 0..count-1 the active ones."""

    def add_ps(self, task: int, cancelled: Callable[[], bool]) -> ScaleReport:
        """A drained PS task takes its share again."""

    def remove_ps(self, task: int, cancelled: Callable[[], bool]) -> ScaleReport:
        """Drain a PS task."""

    def join_ps(self, address: str) -> tuple[int, list[str], int]:
        """A PS not in the cluster file joins the PS list: (index, list, epoch)."""

    def record_hyperparameters(self, values: dict[str, float], variables: list[str] | None) -> None:
        ...

    def register(self, worker_id: str, address: str, closure_port: int = 0, timeout: float = 5.0) -> int:
        """Register a worker; its index."""

    def heartbeat(self, worker_id: str, leaving: bool) -> bool:
        """Record a heartbeat; False if the worker must re-register."""


def error_to_pb(exc: BaseException) -> pb.UserError:
    """An exception as a UserError message (for remote clients)."""
    import cloudpickle

    from pscluster.errors import ClosureError

    cause = exc.__cause__
    tb = cause.remote_traceback if isinstance(cause, ClosureError) else ""
    if isinstance(exc, ClosureError):
        return pb.UserError(type_name=exc.type_name, message=exc.remote_message, traceback=exc.remote_traceback)
    try:
        pickled = cloudpickle.dumps(exc)
    except Exception:  # noqa: BLE001 - text only then
        pickled = b""
    return pb.UserError(type_name=type(exc).__name__, message=str(exc), traceback=tb, pickled=pickled)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Thin translation layer over a ClusterCoordinator."""

    def __init__(self, coordinator: CoordinatorCore) -> None:
        self.coordinator = coordinator

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterReply:
        index = self.coordinator.register(request.worker_id, request.address, request.closure_port)
        return pb.RegisterReply(worker_index=index,
                                heartbeat_interval_s=self.coordinator.settings.heartbeat_interval_s)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        return pb.HeartbeatReply(known=self.coordinator.heartbeat(request.worker_id, request.leaving))

    def Schedule(self, request: pb.ScheduleRequest, context: grpc.ServicerContext) -> pb.ScheduleReply:
        value = self.coordinator.schedule_payload(request.payload, retain=True, job=request.job or MAIN)
        return pb.ScheduleReply(closure_id=value.closure_id)

    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> pb.FetchReply:
        value = self.coordinator.remote_value(request.closure_id)
        with self.coordinator.long_polls.slot(request.timeout_s) as wait:
            if not value.wait(wait):
                return pb.FetchReply(done=False)
        self.coordinator.release(request.closure_id)
        reply, error = value.outcome()
        if reply is not None:
            return pb.FetchReply(done=True, reply=reply)
        assert error is not None
        return pb.FetchReply(done=True, reply=pb.RunClosureReply(error=error_to_pb(error)))

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        with self.coordinator.long_polls.slot(request.timeout_s) as wait:  # ResourceExhausted: the client re-polls
            try:
                if request.keep_error:
                    self.coordinator.sessions.drain(request.job or MAIN, wait)
                    return pb.JoinReply(done=True, closure_id_of_error=-1)
                failed = self.coordinator.sessions.join(request.job or MAIN, wait)
            except DeadlineExceededError:
                return pb.JoinReply(done=False, closure_id_of_error=-1)
        if failed is not None:
            return pb.JoinReply(done=True, closure_id_of_error=failed[0], error=error_to_pb(failed[1]))
        return pb.JoinReply(done=True, closure_id_of_error=-1)

    def OpenJob(self, request: pb.JobRequest, context: grpc.ServicerContext) -> pb.JobReply:
        sessions = self.coordinator.sessions
        job = sessions.open(request.job)
        return pb.JobReply(job=job, known=True, keepalive_interval_s=sessions.keepalive_interval_s)

    def KeepJob(self, request: pb.JobRequest, context: grpc.ServicerContext) -> pb.JobReply:
        sessions = self.coordinator.sessions
        return pb.JobReply(job=request.job, known=sessions.keep(request.job),
                           keepalive_interval_s=sessions.keepalive_interval_s)

    def EndJob(self, request: pb.JobRequest, context: grpc.ServicerContext) -> pb.JobReply:
        self.coordinator.sessions.end(request.job, request.reason or "its client ended it")
        return pb.JobReply(job=request.job, known=False)

    def ConfigureSync(self, request: pb.CoordinatorSyncRequest, context: grpc.ServicerContext) -> pb.SyncConfigReply:
        c = request.config
        step = self.coordinator.configure_sync(c.mode, c.replicas_to_aggregate or None, c.total_num_replicas or None,
                                               c.staleness, job=request.job or MAIN)
        return pb.SyncConfigReply(global_step=step)

    def Checkpoint(self, request: pb.CoordinatorCheckpointRequest,
                   context: grpc.ServicerContext) -> pb.CoordinatorCheckpointReply:
        step = request.step if request.has_step else None
        return pb.CoordinatorCheckpointReply(paths=self.coordinator.checkpoint(step, job=request.job or MAIN))

    def ScalePs(self, request: pb.ScaleRequest, context: grpc.ServicerContext) -> pb.ScaleReply:
        change = request.WhichOneof("change")
        if change is None:
            raise InvalidArgumentError("ScalePs: pass a count, a PS task to add or one to remove")
        scale = {"count": self.coordinator.scale_ps, "add": self.coordinator.add_ps,
                 "remove": self.coordinator.remove_ps}[change]
        # a caller that went away (cancelled, or its deadline passed) stops the scale between moves
        report = scale(getattr(request, change), lambda: not context.is_active())
        return pb.ScaleReply(active=report.active, moves=report.moved,
                             freezes_ms=[1e3 * f for f in report.freezes_s], left=report.left)

    def JoinPs(self, request: pb.JoinPsRequest, context: grpc.ServicerContext) -> pb.JoinPsReply:
        index, addresses, epoch = self.coordinator.join_ps(request.address)
        return pb.JoinPsReply(index=index, ps_addresses=addresses, ps_epoch=epoch)

    def NoteHyperparameters(self, request: pb.HyperparametersNote,
                            context: grpc.ServicerContext) -> pb.HyperparametersNoted:
        values = dict(request.values)
        bad = sorted(name for name, value in values.items() if not name or not math.isfinite(value))
        if bad or not values or (request.all_variables and request.variables):
            raise InvalidArgumentError(f"NoteHyperparameters: needs named finite values and either variables or "
                                       f"all_variables; got values {values}, variables {list(request.variables)}, "
                                       f"all_variables={request.all_variables}")
        self.coordinator.record_hyperparameters(values, None if request.all_variables else list(request.variables))
        return pb.HyperparametersNoted()

    def Status(self, request: pb.CoordinatorStatusRequest, context: grpc.ServicerContext) -> pb.CoordinatorStatus:
        return self.coordinator.status()
