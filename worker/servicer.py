"""The Worker gRPC servicer: decode, call the ClosureRunner, encode."""

from __future__ import annotations

import threading

import grpc
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc
from pscluster.worker.runner import ClosureRunner, Outcome

from pscluster.errors import UnavailableError


def outcome_to_pb(out: Outcome) -> pb.RunClosureReply:
    """Outcome -> RunClosureReply."""
    reply = pb.RunClosureReply(result=out.result, retryable=out.retryable, seconds=out.seconds)
    add = reply.versions.add  # in place: a list of ShardVersion messages to copy cost 2.5x as much
    for v, i, n, inc in out.versions:
        add(variable=v, shard_index=i, version=n, incarnation=inc)
    for name, value in out.scalars:
        reply.scalars[name] = value
    if out.report is not None:
        step, worker, epoch, version = out.report
        reply.report.CopyFrom(pb.SyncReport(step=step, worker=worker, epoch=epoch, version=version))
    if out.error_type:
        reply.error.CopyFrom(pb.UserError(type_name=out.error_type, message=out.error_message,
                                          traceback=out.error_traceback, pickled=out.error_pickled))
    return reply


class InflightGate:
    """Counts running closures; closes for new ones when the worker is leaving."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self.accepting = True

    def enter(self) -> None:
        """Admit one closure or raise UnavailableError while leaving."""
        with self._cond:
            if not self.accepting:
                raise UnavailableError("worker is leaving (preempted); closure handed back")
            self._running += 1

    def exit(self) -> None:
        """One closure finished."""
        with self._cond:
            self._running -= 1
            self._cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Stop accepting and wait up to timeout for running closures; True if none is left."""
        with self._cond:
            self.accepting = False
            return self._cond.wait_for(lambda: self._running == 0, timeout)


class WorkerServicer(pb_grpc.WorkerServicer):
    """Thin translation layer over a ClosureRunner."""

    def __init__(self, runner: ClosureRunner, worker_id: str, gate: InflightGate) -> None:
        self.runner = runner
        self.worker_id = worker_id
        self.gate = gate
        self.closure_port = 0  # set when the framed closure port is up

    def RunClosure(self, request: pb.RunClosureRequest, context: grpc.ServicerContext) -> pb.RunClosureReply:
        self.gate.enter()
        try:
            return outcome_to_pb(self.runner.run(request.closure_id, request.payload, request.sync_mode,
                                                   request.worker_index, request.final_below, request.push_pull))
        finally:
            self.gate.exit()

    def Ping(self, request: pb.PingRequest, context: grpc.ServicerContext) -> pb.PingReply:
        return pb.PingReply(worker_id=self.worker_id, closures_run=self.runner.closures_run)
