"""What ClusterCoordinator and RemoteCoordinator share: variables, per-worker datasets, fetch, sync stats.

Both classes offer the same public methods (tests/unit/test_remote_clients.py compares them);
DAEMON_SIDE names ClusterCoordinator's entry points for the servicer, which a client has no use for,
and CLIENT_SIDE what only a remote client needs. `lost_updates_by_variable` is also embedded-only: the
Status RPC carries the total (`lost_updates`), not the per-variable breakdown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

from pscluster.coordinator.values import RemoteValue

from pscluster.client.client import PSClient
from pscluster.client.datasets import PerWorkerDataset
from pscluster.client.variables import Variable

DAEMON_SIDE = frozenset({"schedule_payload", "register", "heartbeat", "release", "snapshot", "lost_updates_by_variable"})
CLIENT_SIDE = frozenset({"close"})  # detach without ending the job (RemoteCoordinator(settings, job=...) re-attaches)


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

    def sync_stats(self) -> dict[str, float]:
        """Global step, stale gradients dropped (all PS), and bounded mode's widest admitted spread."""
        reply = self.client.sync_step()
        return {"global_step": reply.global_step, "dropped_stale": reply.dropped_stale,
                "max_spread": reply.max_spread}

    def shutdown(self) -> None:
        """Release everything this coordinator (or client) holds."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
