"""Run the coordinator as a daemon: workers register with it, clients submit closures to it."""

from __future__ import annotations

import logging

from pscluster.config import Settings
from pscluster.coordinator.coordinator import ClusterCoordinator
from pscluster.server.main import wait_for_signal

log = logging.getLogger(__name__)


def serve(settings: Settings) -> None:
    """Run a coordinator daemon until SIGTERM/SIGINT."""
    coord = ClusterCoordinator(settings, serve=True)
    try:
        metrics = f" metrics={coord.metrics_port}" if settings.metrics_port is not None else ""
        print(f"READY coordinator {settings.bind_host}:{coord.port} global_step={coord.global_step}{metrics}",
              flush=True)
        wait_for_signal()
    finally:
        coord.shutdown()
