"""Hyper-parameter changes decided by the driver (coord.set_learning_rate / set_hyperparameters).

A change replaces the optimizer config in each named shard's spec under that shard's lock, so the
next update applies it and a checkpoint (which saves the spec) keeps it. Every shard's new config
is computed and validated before any shard changes: a bad change changes nothing. A change that
would alter the slot variables (momentum 0 -> 0.9 on RMSprop, amsgrad) is refused. Setting the same
values again changes nothing more: the call is safe to retry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from pscluster.server.store import Shard, VariableStore


def set_hyperparameters(store: VariableStore, variables: Sequence[str], changes: dict[str, Any],
                        dry_run: bool = False, keep: Callable[[Shard], bool] | None = None,
                        on_changed: Callable[[Shard], None] | None = None) -> list[Shard]:
    """Apply `changes` to every shard of `variables` held here (all shards when empty) that `keep` accepts;
    returns those shards (with dry_run: that would change). Other tasks' shards are the client's business.
    on_changed(shard) runs under the shard's lock right after its change (replicas: 2 queues it for the
    shard's backup in order with the shard's updates)."""
    wanted = set(variables)
    shards = [s for s in store.shards() if (not wanted or s.spec.variable in wanted) and (keep is None or keep(s))]
    updated = [(s, s.spec.optimizer.changed(changes)) for s in shards]  # raises before anything changes
    for shard, cfg in [] if dry_run else updated:
        with shard.lock:
            shard.spec = replace(shard.spec, optimizer=cfg)
            if on_changed is not None:
                on_changed(shard)
    return shards
