"""What ClusterCoordinator and RemoteCoordinator share: variables, per-worker datasets, fetch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pscluster.client import PSClient
from pscluster.coordinator.values import RemoteValue
from pscluster.datasets import PerWorkerDataset
from pscluster.variables import Variable


class CoordinatorAPI:
    """The TF-named methods that only need a PS client."""

    client: PSClient

    def create_variable(self, name: str, shape: Any = None, dtype: Any = None, **kwargs: Any) -> Variable:
        """Create (or find) a variable on the PS tasks; see PSClient.create_variable."""
        return self.client.create_variable(name, shape, dtype, **kwargs)

    def create_per_worker_dataset(self, dataset_fn: Callable[..., Any]) -> PerWorkerDataset:
        """A dataset built on each worker by dataset_fn (optionally taking a WorkerInfo)."""
        return PerWorkerDataset(dataset_fn)

    def fetch(self, values: Any) -> Any:
        """Fetch a RemoteValue, or a (nested) list/tuple/dict of them, into plain values."""
        if isinstance(values, RemoteValue):
            return values.fetch()
        if isinstance(values, dict):
            return {k: self.fetch(v) for k, v in values.items()}
        if isinstance(values, (list, tuple)):
            return type(values)(self.fetch(v) for v in values)
        return values
