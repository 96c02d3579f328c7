"""Hyper-parameter changes decided by the driver (coord.set_learning_rate / set_hyperparameters).

A change replaces the optimizer config in each named shard's spec under that shard's lock, so the
next update applies it and a checkpoint (which saves the spec) keeps it. Every shard's new config
is computed and validated before any shard changes: a bad change changes nothing. A change that
would alter the slot variables (momentum 0 -> 0.9 on RMSprop, amsgrad) is refused. Setting the same
values again changes nothing more: the call is safe to retry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pscluster.server.store import VariableStore


def set_hyperparameters(store: VariableStore, variables: Sequence[str], changes: dict[str, Any],
                        dry_run: bool = False) -> list[str]:
    """Apply `changes` to every shard of `variables` held here (all shards when empty); returns the
    variables changed (or, with dry_run, that would change). Other tasks' shards are the client's business."""
    wanted = set(variables)
    shards = [s for s in store.shards() if not wanted or s.spec.variable in wanted]
    updated = [(s, s.spec.optimizer.changed(changes)) for s in shards]  # raises before anything changes
    for shard, cfg in [] if dry_run else updated:
        with shard.lock:
            shard.spec = replace(shard.spec, optimizer=cfg)
    return sorted({s.spec.variable for s in shards})
