"""pscluster: a parameter-server training cluster.

    import pscluster as ps
    coord = ps.ClusterCoordinator(ps.load_settings("cluster.yaml"))
    w = coord.create_variable("w", initial_value=np.zeros((784, 10), np.float32), optimizer=ps.SGD(0.5))
    result = coord.schedule(step_fn, args=(iter(coord.create_per_worker_dataset(make_data)),))
    coord.join(); print(result.fetch())
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it; imported on first use, so that `import pscluster` (and a
# PS daemon importing pscluster.server) loads only what it touches
_EXPORTS = {
    "PSClient": "pscluster.client.client",
    "Token": "pscluster.client.context", "report": "pscluster.client.context",
    "sync_token": "pscluster.client.context", "worker_info": "pscluster.client.context",
    "Variable": "pscluster.client.variables", "pull": "pscluster.client.variables", "push": "pscluster.client.variables",
    "ship_module": "pscluster.closures",
    "ClusterSpec": "pscluster.config", "Settings": "pscluster.config", "load_settings": "pscluster.config",
    "ClosureError": "pscluster.errors", "ConfigError": "pscluster.errors", "PsclusterError": "pscluster.errors",
    "SGD": "pscluster.optimizers", "Adagrad": "pscluster.optimizers", "Adam": "pscluster.optimizers",
    "Momentum": "pscluster.optimizers", "AdamW": "pscluster.optimizers", "RMSprop": "pscluster.optimizers",
    "Ftrl": "pscluster.optimizers", "Lion": "pscluster.optimizers",
    "ReduceLROnPlateau": "pscluster.plateau", "schedules": "pscluster.schedules",
    "FixedShardsPartitioner": "pscluster.placement", "MaxSizePartitioner": "pscluster.placement",
    "MinSizePartitioner": "pscluster.placement",
    "ClusterCoordinator": "pscluster.coordinator.coordinator", "RemoteValue": "pscluster.coordinator.values",
    "RemoteCoordinator": "pscluster.coordinator.remote",
    "LocalCluster": "pscluster.ops.launcher",
}

__all__ = [
    "Adagrad", "Adam", "AdamW", "Ftrl", "Lion", "RMSprop", "ReduceLROnPlateau", "schedules", "ClosureError", "ClusterCoordinator", "ClusterSpec", "ConfigError", "FixedShardsPartitioner",
    "LocalCluster", "MaxSizePartitioner", "MinSizePartitioner", "Momentum", "PSClient", "PsclusterError",
    "RemoteCoordinator", "RemoteValue", "SGD", "Settings", "Token", "Variable", "load_settings", "pull", "push",
    "report", "ship_module", "sync_token", "worker_info",
]

if TYPE_CHECKING:
    from pscluster import schedules
    from pscluster.client.client import PSClient
    from pscluster.client.context import Token, report, sync_token, worker_info
    from pscluster.client.variables import Variable, pull, push
    from pscluster.closures import ship_module
    from pscluster.config import ClusterSpec, Settings, load_settings
    from pscluster.coordinator.coordinator import ClusterCoordinator
    from pscluster.coordinator.remote import RemoteCoordinator
    from pscluster.coordinator.values import RemoteValue
    from pscluster.errors import ClosureError, ConfigError, PsclusterError
    from pscluster.ops.launcher import LocalCluster
    from pscluster.optimizers import SGD, Adagrad, Adam, AdamW, Ftrl, Lion, Momentum, RMSprop
    from pscluster.placement import FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner
    from pscluster.plateau import ReduceLROnPlateau


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pscluster' has no attribute {name!r}")
    imported = importlib.import_module(module)
    value = imported if module == f"pscluster.{name}" else getattr(imported, name)  # a module (schedules) or a name
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
