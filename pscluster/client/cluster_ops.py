"""Cluster-wide operations of a PS client: update mode, checkpoints, status, hyper-parameters, export.

They are fan-outs of one unary call per PS task; PSClient (client.py) supplies the fan-out, variable
discovery and pulls, and keeps the data path (pull, push, tokens) to itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from pscluster.client.variables import Variable
from pscluster.errors import NotFoundError
from pscluster.optimizer_config import changes_to_json
from pscluster.proto import pscluster_pb2 as pb


class ClusterOperations(ABC):
    """Operations on every PS task at once, over a client's fan-out."""

    @property
    @abstractmethod
    def num_ps(self) -> int:
        """Number of PS tasks."""

    @abstractmethod
    def _gather(self, calls: list[tuple[int, str, Any]]) -> list[Any]:
        """Unary calls in parallel, replies in call order."""

    @abstractmethod
    def discover(self) -> dict[str, Variable]:
        """Every variable on the cluster."""

    @abstractmethod
    def pull(self, variables: Sequence[Variable]) -> list[np.ndarray]:
        """Current values of variables."""

    def configure_sync(self, mode: str, replicas_to_aggregate: int = 1, total_num_replicas: int = 0,
                       staleness: int = 0) -> int:
        """Set the update mode on every PS task; returns the global step."""
        req = pb.SyncConfigRequest(mode=mode, replicas_to_aggregate=replicas_to_aggregate,
                                   total_num_replicas=total_num_replicas or replicas_to_aggregate, staleness=staleness)
        return int(self._gather([(ps, "ConfigureSync", req) for ps in range(self.num_ps)])[0].global_step)

    def sync_step(self) -> pb.StepReply:
        """PS 0's global step, mode and clocks, with stale drops summed over every PS."""
        replies = self._gather([(ps, "GetStep", pb.StepRequest()) for ps in range(self.num_ps)])
        first: pb.StepReply = replies[0]
        first.dropped_stale = sum(r.dropped_stale for r in replies)
        return first

    def checkpoint(self, step: int) -> list[str]:
        """Write a checkpoint of every PS task at `step` (call with pushes quiesced for consistency)."""
        replies = self._gather([(ps, "Save", pb.SaveRequest(step=step)) for ps in range(self.num_ps)])
        return [r.path for r in replies]

    def table_stats(self, table: Variable) -> dict[str, int]:
        """A dynamic table's live keys, evicted keys and dropped (not admitted) gradient rows, summed
        over its shards (one ListShards per PS task)."""
        totals = {"live_keys": 0, "evicted_keys": 0, "dropped_rows": 0}
        for reply in self._gather([(ps, "ListShards", pb.ListShardsRequest()) for ps in {pl.ps for pl in table.shards}]):
            for info in reply.shards:
                if info.spec.variable == table.name:
                    for name in totals:
                        totals[name] += getattr(info, name)
        return totals

    def set_hyperparameters(self, changes: dict[str, Any], variables: Sequence[str] | None = None) -> int:
        """Change optimizer hyper-parameters (learning_rate, schedule, weight_decay, ...) of `variables` (every
        variable when None) on every PS task, from each shard's next update; returns the shards changed.

        Every task validates first (a dry run), so a change one task refuses changes nothing anywhere.

        Raises:
            NotFoundError: a named variable is on no PS task.
            InvalidArgumentError: an unknown or unchangeable hyper-parameter, or a bad value.
        """
        names = list(variables or [])
        text = changes_to_json(changes)
        checks = self._gather([(ps, "SetHyperparameters",
                                pb.HyperparametersRequest(variables=names, changes_json=text, dry_run=True))
                               for ps in range(self.num_ps)])
        missing = set(names) - {v for r in checks for v in r.variables}
        if missing:
            raise NotFoundError(f"set_hyperparameters: no PS task holds {', '.join(sorted(missing))}")
        replies = self._gather([(ps, "SetHyperparameters", pb.HyperparametersRequest(variables=names, changes_json=text))
                                for ps in range(self.num_ps)])
        return sum(int(r.shards) for r in replies)

    def status(self) -> list[pb.PsStatus]:
        """Status of every PS task."""
        return self._gather([(ps, "Status", pb.PsStatusRequest()) for ps in range(self.num_ps)])

    def export(self, path: str) -> dict[str, tuple[int, ...]]:
        """Write every variable, whole, to one safetensors file readable without pscluster (dynamic tables,
        which have no whole value, are left out: their rows are in the checkpoints)."""
        from safetensors.numpy import save_file

        variables = self.discover()
        names = sorted(n for n, v in variables.items() if not v.dynamic)
        values = self.pull([variables[n] for n in names])
        save_file(dict(zip(names, values)), path, metadata={"format": "pscluster-export"})
        return {n: v.shape for n, v in zip(names, values)}
