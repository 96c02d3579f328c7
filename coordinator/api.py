"""What ClusterCoordinator and RemoteCoordinator share: variables, per-worker datasets, fetch, sync stats.

Both classes offer the same public methods (tests/unit/test_remote_clients.py compares them);
DAEMON_SIDE names ClusterCoordinator's entry points for the servicer, which a client has no use for,
and CLIENT_SIDE what only a remote client needs. `replica_table` is embedded-only (a driver reads the
table's roles in `pscluster status`); `lost_updates_by_variable` is not: the Status RPC carries it.
`join_ps` is a PS daemon's (`pscluster ps --join`, the JoinPs RPC), not a driver's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Self

from pscluster.coordinator.values import RemoteValue

from pscluster.client.client import PSClient
from pscluster.client.datasets import PerWorkerDataset
from pscluster.client.variables import Variable
from pscluster.schedules import Schedule

DAEMON_SIDE = frozenset({"schedule_payload", "register", "heartbeat", "release", "snapshot", "replica_table",
                         "join_ps"})
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

    def set_learning_rate(self, lr: float | Schedule, variables: Sequence[str | Variable] | None = None) -> int:
        """Set the learning rate of `variables` (every variable when None) on every shard from its next update.

        `lr` is a number, or a schedule (pscluster.schedules) evaluated at each variable's own update count
        (absolute: wrap it in a Sequence to start it later). The PS keeps it in its checkpoints; the PS
        metrics (`pscluster_ps_learning_rate`) and the training curves (`hparams/learning_rate`) show it.
        Returns the number of shards changed.

        Raises:
            NotFoundError: a named variable is on no PS task (nothing changed).
            InvalidArgumentError: a negative or non-finite rate (nothing changed).
        """
        if isinstance(lr, Schedule):
            return self.set_hyperparameters(variables, learning_rate=float(lr(0)), schedule=lr)
        return self.set_hyperparameters(variables, learning_rate=float(lr))

    def set_hyperparameters(self, variables: Sequence[str | Variable] | None = None,
                            **changes: float | Schedule | None) -> int:
        """Change optimizer hyper-parameters (learning_rate, schedule, momentum_schedule, momentum, beta1, beta2, epsilon,
        weight_decay, dampening, rho, lr_decay, l1, l2, l2_shrinkage, beta, clip_value, clip_norm) of
        `variables` (every variable when None) on every shard from its next update; checkpointed on the PS.
        A new learning_rate without a schedule ends the schedule (a new momentum or beta1 the momentum_schedule).
        Returns the number of shards changed.

        Raises:
            NotFoundError: a named variable is on no PS task (nothing changed).
            InvalidArgumentError: an unknown name, a bad value, or a change of the slot variables (nothing
                changed on any PS task).
        """
        names = None if variables is None else [v if isinstance(v, str) else v.name for v in variables]
        shards = self.client.set_hyperparameters(dict(changes), names)
        self.record_hyperparameters({k: float(v) for k, v in changes.items() if isinstance(v, (int, float))}, names)
        return shards

    def record_hyperparameters(self, values: dict[str, float], variables: list[str] | None) -> None:
        """Show values the driver set (set_hyperparameters calls this) in the coordinator's metrics
        (`pscluster_coordinator_hyperparameter`) and training curves (`hparams/<name>`)."""

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
