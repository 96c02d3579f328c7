"""Run the coordinator as a daemon: workers register with it, clients submit closures to it."""

from __future__ import annotations

import logging

from pscluster import daemon
from pscluster.config import Settings
from pscluster.coordinator.coordinator import ClusterCoordinator

log = logging.getLogger(__name__)


def serve(settings: Settings) -> None:
    """Wait for every PS, then run a coordinator daemon until SIGTERM/SIGINT.

    Raises:
        StartupError: a PS did not answer within startup_timeout_s, or refused our token.
    """
    stop = daemon.stop_on_signals()
    if not daemon.wait_for_ps(settings, "coordinator", stop):
        return
    coord = ClusterCoordinator(settings, serve=True)
    try:
        metrics = f" metrics={coord.metrics_port}" if settings.metrics_port is not None else ""
        print(f"READY coordinator {settings.bind_host}:{coord.port} global_step={coord.global_step}{metrics}",
              flush=True)
        stop.wait()
    finally:
        coord.shutdown()
