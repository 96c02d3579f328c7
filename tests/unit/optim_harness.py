"""A variable spread over P in-process VariableStores (no sockets), pushed to as the client does, with
checkpoint save and restore into another number of PS tasks: the PS side of the exactness tests."""

from __future__ import annotations

import pathlib

import numpy as np
from pscluster.server import checkpoint
from pscluster.server.store import PushItem, VariableStore

from pscluster.optimizer_config import OptimizerConfig
from pscluster.placement import ps_for_ordinal
from pscluster.specs import ShardSpec, spec_from_pb, spec_to_pb


class ShardedVariable:
    """One variable in `num_shards` row shards, shard i on PS i mod num_ps (as placement does)."""

    def __init__(self, name: str, w0: np.ndarray, cfg: OptimizerConfig, num_shards: int, num_ps: int,
                 sparse: bool = False) -> None:
        self.name, self.num_ps = name, num_ps
        self.stores = [VariableStore() for _ in range(num_ps)]
        bounds = np.linspace(0, w0.shape[0], num_shards + 1).astype(int)
        self.ranges = [(int(bounds[i]), int(bounds[i + 1])) for i in range(num_shards)]
        for i, (lo, hi) in enumerate(self.ranges):
            spec = ShardSpec(name, i, num_shards, w0.shape, (hi - lo,) + w0.shape[1:], lo, str(w0.dtype), cfg,
                             sparse=sparse, ordinal=i)
            spec = spec_from_pb(spec_to_pb(spec))  # the config travels through the wire form
            self.stores[ps_for_ordinal(i, num_ps)].create(spec, w0[lo:hi].copy())

    def _store(self, i: int) -> VariableStore:
        return self.stores[ps_for_ordinal(i, self.num_ps)]

    def push_dense(self, grad: np.ndarray) -> None:
        """One update: every shard gets its rows of the gradient."""
        for i, (lo, hi) in enumerate(self.ranges):
            self._store(i).push("", [PushItem((self.name, i), grad[lo:hi].copy())])

    def push_rows(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """One sparse update: every shard gets its ids (maybe none), so every shard counts the update."""
        for i, (lo, hi) in enumerate(self.ranges):
            mine = (ids >= lo) & (ids < hi)
            self._store(i).push("", [PushItem((self.name, i), rows[mine].copy(), ids[mine].astype(np.int64))])

    def value(self) -> np.ndarray:
        """The whole variable, shards concatenated."""
        return np.concatenate([self._store(i).pull((self.name, i))[0] for i in range(len(self.ranges))])

    def restart(self, root: pathlib.Path, step: int, num_ps: int) -> None:
        """Checkpoint every PS task, then restore the checkpoint into `num_ps` fresh tasks."""
        for p, store in enumerate(self.stores):
            checkpoint.save(store, root, step, p, self.num_ps, keep=2)
        self.num_ps = num_ps
        self.stores = [VariableStore() for _ in range(num_ps)]
        for p, store in enumerate(self.stores):
            checkpoint.restore(store, root, p, num_ps)
