"""pscluster: a parameter-server training cluster.

    import pscluster as ps
    coord = ps.ClusterCoordinator(ps.load_settings("cluster.yaml"))
    w = coord.create_variable("w", initial_value=np.zeros((784, 10), np.float32), optimizer=ps.SGD(0.5))
    result = coord.schedule(step_fn, args=(iter(coord.create_per_worker_dataset(make_data)),))
    coord.join(); print(result.fetch())
"""

from __future__ import annotations

from typing import Any

from pscluster.client.client import PSClient
from pscluster.client.context import Token, report, sync_token, worker_info
from pscluster.client.variables import Variable, pull, push
from pscluster.closures import ship_module
from pscluster.config import ClusterSpec, Settings, load_settings
from pscluster.errors import ClosureError, ConfigError, PsclusterError
from pscluster.optimizers import SGD, Adagrad, Adam, Momentum
from pscluster.placement import FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner

__all__ = [
    "Adagrad", "Adam", "ClosureError", "ClusterCoordinator", "ClusterSpec", "ConfigError",
    "FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Momentum", "PSClient",
    "PsclusterError", "RemoteCoordinator", "RemoteValue", "SGD", "Settings", "Token", "Variable", "load_settings", "pull", "push",
    "report",
    "ship_module", "sync_token", "worker_info",
]


def __getattr__(name: str) -> Any:
    # The coordinator pulls in more machinery than a PS daemon needs: import it on first use.
    if name in ("ClusterCoordinator", "RemoteValue"):
        from pscluster.coordinator import coordinator

        return getattr(coordinator, name)
    if name == "RemoteCoordinator":
        from pscluster.coordinator.remote import RemoteCoordinator

        return RemoteCoordinator
    raise AttributeError(f"module 'pscluster' has no attribute {name!r}")
