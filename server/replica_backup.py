"""The backup's side of PS-to-PS replication (server/replication.py): applying what a shard's primary forwards.

A mixin of Replication, which owns the attributes below (the roles side writes the epochs too, and a promoted
backup's primary side reads the pull counts and copy epochs this side keeps).

- `receive` (a batch of ReplicaForward messages) and `receive_dense` (a batch of plain dense updates in
  server/replica_wire.py's compact form, through the same update path) apply forwards in version order with the
  same optimizer code at the same version number, each under its shard's key lock (a resend on a new
  connection may overlap the batch it repeats).
- A forward of an older epoch than this PS knows is refused (STALE: its sender is no longer primary); one this
  copy lacks an earlier update for answers GAP (the primary sends its whole state).
- A catch-up (the whole state) installs a new copy (`_place`, `_installed`); one in chunks is staged
  (server/catch_up.py) until its last chunk, and updates that arrive meanwhile go to the rows staged so far.
- Also applied here: the sync state, a skipped sync step's note (server/replica_notes.py), a config change,
  and a table's row-creating pull or sweep, each ordered among the version's pulls.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server import catch_up, replica_wire, table_ops
from pscluster.server.push_record import push_key
from pscluster.server.replica_links import tensors_of
from pscluster.server.replica_notes import SyncStateHolder, note_skipped
from pscluster.server.replicator import name_of
from pscluster.server.store import Key, Shard, VariableStore

from pscluster import codec
from pscluster.errors import InvalidArgumentError
from pscluster.optimizer_config import OptimizerConfig, optimizer_from_pb


class ReplicaBackup:
    """Applies a primary's forwards to this PS's copies (mixed into Replication, which sets these)."""

    store: VariableStore
    ps_index: int
    sync_state: SyncStateHolder | None
    _lock: threading.Lock
    _epochs: dict[Key, int]
    _copy_epoch: dict[Key, int]
    _pulls: dict[Key, tuple[int, int]]
    _key_locks: dict[Key, threading.Lock]
    _staged: catch_up.Stager

    def _pulls_at(self, key: Key, version: int) -> int:
        raise NotImplementedError  # Replication's

    def _took_pull(self, key: Key, version: int) -> int:
        raise NotImplementedError  # Replication's

    def staging(self) -> list[Key]:
        """Backup side: the shards whose catch-up in chunks is under way here (staged, not installed yet)."""
        return sorted(self._staged.keys())

    def receive(self, request: pb.ReplicateRequest, arrays: Sequence[np.ndarray] | None = None,
                owned: bool = False) -> pb.ReplicateReply:
        """Apply a primary's forwards in order (see the module docstring); arrays: the tensors' contents in
        `tensors_of` order (a framed batch), else they are decoded from the tensors' data; owned: the arrays
        are writable and nothing else uses their memory, so an install keeps them instead of a copy."""
        reply = pb.ReplicateReply()
        given = iter(arrays) if arrays is not None else None
        for f in request.forwards:
            tensors = [next(given) for _ in tensors_of(f)] if given is not None else \
                [codec.decode(t, name_of((f.ref.variable, f.ref.shard_index))) for t in tensors_of(f)]
            key = (f.ref.variable, f.ref.shard_index)
            with self._key_lock(key):  # a resend on a new connection may overlap the batch it repeats
                outcome, shard = self._receive_one(f, key, tensors, owned)
            reply.outcomes.append(outcome)
            reply.versions.append(shard.version if shard is not None else -1)
        return reply

    def receive_dense(self, forwards: Sequence[replica_wire.Dense],
                      grads: Sequence[np.ndarray]) -> tuple[list[int], list[int]]:
        """Apply a batch of dense updates in the compact form (server/replica_wire.py), decoded and checked:
        (outcomes, versions), exactly as `receive` answers the same forwards as messages."""
        outcomes: list[int] = []
        versions: list[int] = []
        for f, grad in zip(forwards, grads):
            with self._key_lock(f.key):
                outcome, shard = self._receive_update(f.key, f.epoch, f.version, grad, None, f.push_id,
                                                      f.final_below, None)
            outcomes.append(outcome)
            versions.append(shard.version if shard is not None else -1)
        return outcomes, versions

    def _fenced(self, key: Key, epoch: int) -> bool:
        """Note a forward's epoch for key; True when a newer one is known (its sender is no longer primary)."""
        with self._lock:
            known = self._epochs.get(key, 0)
            if epoch >= known:
                self._epochs[key] = epoch
        return epoch < known

    def _receive_update(self, key: Key, epoch: int, version: int, grad: np.ndarray, rows: np.ndarray | None,
                        push_id: str, final_below: int,
                        clock_s: int | None) -> tuple[pb.ReplicaOutcome.ValueType, Shard | None]:
        """An update forward (no install, config change, sync state, pull or sweep), under key's lock."""
        stale = self._fenced(key, epoch)
        shard = self.store.find(key)
        if stale:
            return pb.REPLICA_STALE, shard
        staged = self._staged.get(key)
        if staged is not None and staged.shard.table is not None:
            return pb.REPLICA_GAP, shard  # a table is built by its last chunk, which what follows comes after
        shard = staged.shard if staged is not None else shard  # a catch-up in chunks: the rows staged so far
        if shard is None:
            return pb.REPLICA_GAP, shard
        local = _ids(rows, key) if rows is not None else None
        pid = push_key(push_id) if push_id else None
        done = self.store.apply_at(shard, version, grad, local, pid, final_below, clock_s) if staged is None else \
            catch_up.apply_at(staged, shard, version, grad, local, pid, final_below)
        return (pb.REPLICA_GAP if done == "gap" else pb.REPLICA_APPLIED), shard

    def _key_lock(self, key: Key) -> threading.Lock:
        lock = self._key_locks.get(key)  # a plain read on the common path: locks are only ever added
        if lock is None:
            with self._lock:
                lock = self._key_locks.setdefault(key, threading.Lock())
        return lock

    def _receive_one(self, f: pb.ReplicaForward, key: Key, tensors: list[np.ndarray],
                     owned: bool) -> tuple[pb.ReplicaOutcome.ValueType, Shard | None]:
        """One forward, under its shard's key lock: (its outcome, the shard after it)."""
        if not (f.HasField("sync_state") or f.skipped or f.HasField("spec") or f.pulled or f.swept or
                f.HasField("optimizer")):
            return self._receive_update(key, f.epoch, f.version, tensors[0], tensors[1] if f.has_rows else None,
                                        f.push_id, f.final_below, f.clock_s if f.HasField("clock_s") else None)
        stale = self._fenced(key, f.epoch)
        shard = self.store.find(key)
        if stale:
            return pb.REPLICA_STALE, shard
        if f.HasField("sync_state"):
            if self.sync_state is None:
                raise InvalidArgumentError(f"ps {self.ps_index} keeps no sync state; a forward of it is refused")
            self.sync_state.install(f.epoch, f.version, f.sync_state)
            return pb.REPLICA_APPLIED, shard
        staged = self._staged.get(key)
        if staged is not None and staged.shard.table is not None and not f.HasField("spec"):
            return pb.REPLICA_GAP, shard  # a table is built by its last chunk, which what follows comes after
        if f.skipped:  # a skipped sync step's note: into the copy, or the one staged by a catch-up in chunks
            target = staged.shard if staged is not None else shard
            noted = target is not None and note_skipped(target, f.version, f.push_id)
            return (pb.REPLICA_APPLIED if noted else pb.REPLICA_GAP), shard
        if f.HasField("spec"):
            with self._lock:
                same_stream = self._copy_epoch.get(key) == f.epoch
            # a resent install: this copy holds it and the updates after it. At the same version it must also
            # hold the pulls and sweeps the state holds (they change a table, not its version)
            held = shard is not None and (shard.version > f.version or (
                shard.version == f.version and self._pulls_at(key, f.version) >= f.pull_index))
            if held and same_stream and not self._staged.get(key):
                return pb.REPLICA_APPLIED, shard
            if f.chunk_start or f.chunk_more:  # staged; the last chunk installs the staged copy
                done, shard, complete = self._staged.take(f, key, tensors)
                if complete and shard is not None:
                    self._place(shard)
                    self._installed(f, shard)
                return (pb.REPLICA_GAP if done == "gap" else pb.REPLICA_APPLIED), shard or self.store.find(key)
            self._staged.drop(key)
            shard = catch_up.whole(f, tensors, owned, self.store.dedup_window)
            self._place(shard)
            return pb.REPLICA_APPLIED, self._installed(f, shard)
        staged = self._staged.get(key)  # a catch-up in chunks under way: updates go to the rows staged so far
        shard = staged.shard if staged is not None else shard
        if shard is None or ((f.pulled or f.swept) and staged is not None):  # a table's state is never staged
            return pb.REPLICA_GAP, shard
        if f.pulled or f.swept:  # a pull that made rows, or an on-demand sweep: ordered among the version's pulls
            if shard.version == f.version:
                taken = self._pulls_at(key, f.version)
                if f.pull_index < taken:
                    return pb.REPLICA_APPLIED, shard  # a resent pull: repeating it could re-create evicted rows
                if f.pull_index > taken:
                    return pb.REPLICA_GAP, shard  # an earlier pull at this version is missing
            keys = _ids(tensors[0], key)
            done = table_ops.evict_at(shard, f.version, keys) if f.swept else \
                table_ops.pull_at(shard, f.version, keys, f.clock_s if f.HasField("clock_s") else None)
            if done == "applied":
                self._took_pull(key, f.version)
            return (pb.REPLICA_GAP if done == "gap" else pb.REPLICA_APPLIED), shard
        configured = _configure_at(shard, f.version, optimizer_from_pb(f.optimizer))  # what is left: a config change
        return (pb.REPLICA_APPLIED if configured else pb.REPLICA_GAP), shard

    def _installed(self, f: pb.ReplicaForward, shard: Shard) -> Shard:
        """Note an install (its epoch and pulls) of shard key; returns shard."""
        with self._lock:
            self._copy_epoch[shard.spec.key] = f.epoch
            self._pulls[shard.spec.key] = (f.version, f.pull_index)
        return shard

    def _place(self, shard: Shard) -> None:
        """Put an installed copy in the store, after a pull or a checkpoint of the old object."""
        existing = self.store.find(shard.spec.key)
        if existing is not None:
            with existing.lock:
                self.store.install(shard)
        else:
            self.store.install(shard)


def _configure_at(shard: Shard, version: int, cfg: OptimizerConfig) -> bool:
    """A backup's take of a config change made after update `version`; False: that update is missing (gap).

    Past `version` the change is held already: a resend, or a catch-up that carried it in its spec.
    """
    with shard.lock:
        if shard.version < version:
            return False
        if shard.version == version:
            shard.spec = replace(shard.spec, optimizer=cfg)
        return True


def _ids(rows: np.ndarray, key: Key) -> np.ndarray:
    """A forward's row numbers or keys, checked: a 1-D int64 array."""
    if rows.dtype != np.dtype("<i8") or rows.ndim != 1:
        raise InvalidArgumentError(f"replicate {name_of(key)}: rows must be a 1-D int64 tensor, got {rows.dtype} "
                                   f"{rows.shape}")
    return rows
