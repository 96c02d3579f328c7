"""What replication (server/replication.py) forwards besides a shard's updates and catch-ups: the sync state,
the note of a sync step skipped on a shard, config changes, and a table's row-creating pulls and sweeps. A mixin
of Replication, which owns the attributes below; the backup applies them in server/replica_backup.py.

- `forward_sync`: the sync token queue, clocks and G (server/sync_state.py), whole, after change `version`;
  the backup takes the newest (`SyncStateHolder.install`).
- `skipped`: a sync step skipped on a shard changes no version, so no update is forwarded; the note
  (`sync:<step>` for the backup's push record) is, and the step's replies wait for it (`wait_skipped`).
- `configured` (set_hyperparameters' hook) and `swept` (an on-demand sweep's): queued after the updates made so
  far; `wait_configured` waits for the backup to hold them.
- `on_pulled`: a table pull that created rows changes no version either; it is forwarded, numbered among that
  version's pulls, so the backup creates (and evicts) the same rows between the same updates.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server.push_record import PushKey, push_key
from pscluster.server.replicator import Replicator, name_of
from pscluster.server.store import Key, Shard, VariableStore

from pscluster import codec
from pscluster.errors import UnavailableError
from pscluster.optimizer_config import optimizer_to_pb
from pscluster.placement import SYNC_STATE_KEY


class SyncStateHolder(Protocol):
    """What replication calls of the sync state (server/sync_replicas.py's SyncReplicas)."""

    def send_state(self) -> None:
        """Forward the whole state to the backup as a catch-up (forward_sync, in order with the changes)."""

    def install(self, epoch: int, version: int, state: str) -> None:
        """A backup's take of the primary's forwarded state (newer ones only)."""

    def roles_changed(self) -> None:
        """The table changed: token waiters look whether this PS still holds the state."""


class SkipNote(NamedTuple):
    """A skipped step's note in a replicator's queue: its place there, and the shard's version then."""

    replicator: Replicator
    seq: int
    version: int


class ReplicaNotes:
    """Forwards of the sync state, skipped steps, config changes, pulls and sweeps (mixed into Replication,
    which sets these)."""

    store: VariableStore
    ps_index: int
    timeout: float
    _lock: threading.Lock
    _install_at: dict[Key, int]
    _configs: dict[Key, tuple[weakref.ref[Replicator], int]]

    def _replicator_of(self, key: Key) -> tuple[Any, Replicator | None]:
        raise NotImplementedError  # Replication's

    def wait(self, versions: list[tuple[Key, int]], timeout: float | None = None) -> None:
        raise NotImplementedError  # Replication's

    def _took_pull(self, key: Key, version: int) -> int:
        raise NotImplementedError  # Replication's

    def skipped(self, shard: Shard, key: PushKey) -> SkipNote | None:
        """A sync step skipped on shard (under its lock; key: the step's `sync:<step>`): queue the note for the
        backup; returns what `wait_skipped` waits for (None: no backup)."""
        role, rep = self._replicator_of(shard.spec.key)
        if role is None or rep is None:
            return None
        msg = pb.ReplicaForward(ref=pb.ShardRef(variable=shard.spec.variable, shard_index=shard.spec.shard_index),
                                epoch=role.epoch, version=shard.version, push_id=key[0], skipped=True)
        return SkipNote(rep, rep.put(shard.spec.key, shard.version, msg, []), shard.version)

    def wait_skipped(self, key: Key, note: SkipNote, timeout: float) -> None:
        """Return once the backup of shard key holds the note (`skipped`): the replicator answered for its place
        in the queue, or, after the backup changed, the new one confirmed the catch-up (which carries the push
        record, the note included).

        Raises:
            UnavailableError: not in time, or this PS is no longer the primary (retry: the step returns at once).
        """
        _, rep = self._replicator_of(key)
        if rep is not note.replicator:
            self.wait([(key, note.version)], timeout)  # the backup changed; one copy: returns at once
            return
        try:
            rep.wait_config(key, note.seq, time.monotonic() + timeout)  # applied, or a whole state after it
        except UnavailableError as exc:
            raise UnavailableError(f"{name_of(key)}: backup ps {rep.backup} did not confirm the note of a skipped sync "
                                   "step in time; the push was not acknowledged (retry it with the same id)") from exc

    def forward_sync(self, version: int, state: str, catch_up: bool = False, waited: bool = True) -> int:
        """Queue the sync state (whole, JSON) after its change `version` for its backup; called under the
        state's lock, so forwards queue in change order. catch_up: a new backup's first, reported by
        `catching_up` until confirmed; waited=False: no reply waits for it (a report's), so the replication thread
        sends it after LINGER_S unless a newer state (the next take's) supersedes it first.

        Returns the epoch it was forwarded at: the role read with the forward, so a roles change landing during the
        caller's change cannot pair the change with another epoch; the role's epoch with no backup (one copy); 0 when
        this PS is not the state's primary now (nothing forwarded)."""
        role, rep = self._replicator_of(SYNC_STATE_KEY)
        if role is None or role.primary != self.ps_index:
            return 0
        if rep is None:
            return int(role.epoch)
        msg = pb.ReplicaForward(ref=pb.ShardRef(variable=SYNC_STATE_KEY[0], shard_index=SYNC_STATE_KEY[1]),
                                epoch=role.epoch, version=version, sync_state=state)
        if catch_up:
            with self._lock:
                self._install_at[SYNC_STATE_KEY] = version
        rep.put(SYNC_STATE_KEY, version, msg, [], orphan=not waited)
        return int(role.epoch)

    def sync_confirmed(self, current: int) -> tuple[int, int]:
        """On the sync state's primary: (epoch, the newest version of the state its backup confirmed), or
        `current` with no backup (one copy: nothing to confirm); (0, 0) elsewhere."""
        role, rep = self._replicator_of(SYNC_STATE_KEY)
        if role is None or role.primary != self.ps_index:
            return 0, 0
        return role.epoch, current if rep is None else rep.confirmed(SYNC_STATE_KEY)

    def on_pulled(self, shard: Shard, keys: np.ndarray) -> None:
        """The store's hook for a table pull that created rows (under the shard's lock): queue it, so the
        backup creates (and evicts) the same rows, with the same metadata, between the same updates."""
        # what the pull's decisions depend on: its distinct keys
        self._forward_keys(shard, np.unique(np.asarray(keys, np.int64)), swept=False)

    def swept(self, shard: Shard, keys: np.ndarray) -> None:
        """An on-demand sweep's hook (under the shard's lock): queue the evicted keys, so the backup evicts the
        same ones between the same updates; `wait_configured` then waits for it as for a config change."""
        queued = self._forward_keys(shard, np.array(keys, np.int64, copy=True), swept=True)
        if queued is not None:
            self._queued_config(shard.spec.key, *queued)

    def _forward_keys(self, shard: Shard, keys: np.ndarray, swept: bool) -> tuple[Replicator, int] | None:
        """Queue a table operation that changes rows but not the version (a row-creating pull, or a sweep),
        ordered among that version's pulls; returns its replicator and place in its queue, None with no backup."""
        role, rep = self._replicator_of(shard.spec.key)
        if role is None or rep is None:
            return None
        msg = pb.ReplicaForward(ref=pb.ShardRef(variable=shard.spec.variable, shard_index=shard.spec.shard_index),
                                epoch=role.epoch, version=shard.version, rows=codec.header(keys.dtype, keys.shape),
                                has_rows=True, pulled=not swept, swept=swept,
                                pull_index=self._took_pull(shard.spec.key, shard.version))
        if shard.table is not None and not swept:
            msg.clock_s = shard.table.now_s
        return rep, rep.put(shard.spec.key, shard.version, msg, [keys])

    def configured(self, shard: Shard) -> None:
        """set_hyperparameters' hook (under the shard's lock): queue the new optimizer config for the backup,
        placed after the updates made so far."""
        role, rep = self._replicator_of(shard.spec.key)
        if role is None or rep is None:
            return
        msg = pb.ReplicaForward(ref=pb.ShardRef(variable=shard.spec.variable, shard_index=shard.spec.shard_index),
                                epoch=role.epoch, version=shard.version,
                                optimizer=optimizer_to_pb(shard.spec.optimizer))
        self._queued_config(shard.spec.key, rep, rep.put(shard.spec.key, shard.version, msg, []))

    def _queued_config(self, key: Key, rep: Replicator, seq: int) -> None:
        with self._lock:
            old = self._configs.get(key)
            if old is None or old[0]() is not rep or old[1] < seq:
                self._configs[key] = (weakref.ref(rep), seq)

    def wait_configured(self, keys: Sequence[Key], timeout: float | None = None) -> None:
        """Return once the backups of keys hold the config changes and sweeps queued for them (`configured`, `swept`).

        Raises:
            UnavailableError: not confirmed within timeout (the call may be retried: it is idempotent).
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for key in keys:
            with self._lock:
                entry = self._configs.get(key)
            _, rep = self._replicator_of(key)
            if entry is None or rep is None:
                continue  # none queued, or no backup now
            if entry[0]() is rep:
                rep.wait_config(key, entry[1], deadline)  # the change applied, or a whole state after it
                continue
            # queued for another backup (the roles changed since): the whole state the new one gets carries it
            shard = self.store.find(key)
            if shard is not None:
                self.wait([(key, shard.version)], max(0.0, deadline - time.monotonic()))


def note_skipped(shard: Shard, version: int, push_id: str) -> bool:
    """A backup's note of a sync step its primary skipped after update `version`; False: that update is missing."""
    with shard.lock:
        if shard.version < version:
            return False
        shard.record.add_key(push_key(push_id), version)
        return True
