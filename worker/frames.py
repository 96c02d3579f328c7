"""The worker's framed closure port: the same RunClosure as the gRPC servicer, over a FrameServer."""

from __future__ import annotations

import socket
from typing import Any

from pscluster.proto import pscluster_pb2 as pb
from pscluster.worker.servicer import WorkerServicer, outcome_to_pb

from pscluster.net.frame_server import FrameServer
from pscluster.net.framing import refuse_payload, send_frame


def closure_server(servicer: WorkerServicer, host: str, token: str | None, max_header_bytes: int,
                   port: int = 0, **limits: Any) -> FrameServer:
    """A FrameServer on port (0: any free port) that runs closures with servicer's runner and gate (not started)."""

    def run_closure(conn: socket.socket, request: pb.BulkRequest, payload_len: int, state: dict[str, Any]) -> None:
        refuse_payload(conn, payload_len, "closure")
        servicer.gate.enter()  # UnavailableError when leaving: the coordinator reschedules the closure
        try:
            req = request.closure
            outcome = servicer.runner.run(req.closure_id, req.payload, req.sync_mode, req.worker_index,
                                          req.final_below, req.push_pull)
        finally:
            servicer.gate.exit()
        send_frame(conn, pb.BulkReply(closure=outcome_to_pb(outcome)).SerializeToString())

    return FrameServer(host, token, {"closure": run_closure}, max_header_bytes, name="closures", port=port,
                       **limits)
