"""Run the coordinator as a daemon: workers register with it, clients submit closures to it."""

from __future__ import annotations

import logging
import threading
import time

from pscluster.coordinator.coordinator import ClusterCoordinator
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc

from pscluster.config import Settings
from pscluster.net import ports, rpc
from pscluster.ops import daemon

log = logging.getLogger(__name__)


def wait_for_ps(settings: Settings, role: str, stop: threading.Event) -> bool:
    """Wait until every PS task answers Status; False if `stop` was set first."""
    started = time.monotonic()
    for i, address in enumerate(settings.cluster.ps):
        channel = rpc.open_channel(address, settings)
        stub = pb_grpc.ParameterServerStub(channel)
        try:
            probe = lambda: rpc.call(stub.Status, pb.PsStatusRequest(), timeout=1.0, what=f"ps {i}")  # noqa: E731
            if not daemon.wait_for(role, f"ps {i} at {address}", probe, settings.startup_timeout_s, stop, started):
                return False
        finally:
            channel.close()
    return True


def serve(settings: Settings) -> None:
    """Wait for every PS, then run a coordinator daemon until SIGTERM/SIGINT.

    Raises:
        StartupError: a PS did not answer within startup_timeout_s, or refused our token.
    """
    stop = daemon.stop_on_signals(settings.parent_pid)
    ports.check_free(settings.listen_address(), "the coordinator's gRPC port")  # now, not after the PS wait
    if not wait_for_ps(settings, "coordinator", stop):
        return
    coord = ClusterCoordinator(settings, serve=True)
    try:
        metrics = f" metrics={coord.metrics_port}" if settings.metrics_port is not None else ""
        print(f"READY coordinator {settings.bind_host}:{coord.port} global_step={coord.global_step}{metrics}",
              flush=True)
        stop.wait()
        log.info("coordinator: stopping; queued closures are cancelled, workers keep running")
    finally:
        coord.shutdown()
