"""What replication (server/replication.py) forwards besides a shard's updates and catch-ups: the sync state
and the note of a sync step skipped on a shard. A mixin of Replication, which owns the attributes below.

- `forward_sync`: the sync token queue, clocks and G (server/sync_state.py), whole, after change `version`;
  the backup takes the newest (`SyncStateHolder.install`).
- `skipped`: a sync step skipped on a shard changes no version, so no update is forwarded; the note
  (`sync:<step>` for the backup's push record) is, and the step's replies wait for it (`wait_skipped`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple, Protocol

from pscluster.proto import pscluster_pb2 as pb
from pscluster.server.push_record import PushKey, push_key
from pscluster.server.replicator import Replicator, name_of
from pscluster.server.store import Key, Shard

from pscluster.errors import UnavailableError
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
    """Forwards of the sync state and of skipped steps (mixed into Replication, which sets these)."""

    ps_index: int
    _lock: threading.Lock
    _install_at: dict[Key, int]

    def _replicator_of(self, key: Key) -> tuple[Any, Replicator | None]:
        raise NotImplementedError  # Replication's

    def wait(self, versions: list[tuple[Key, int]], timeout: float | None = None) -> None:
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

    def forward_sync(self, version: int, state: str, catch_up: bool = False) -> None:
        """Queue the sync state (whole, JSON) after its change `version` for its backup; called under the
        state's lock, so forwards queue in change order. catch_up: a new backup's first, reported by
        `catching_up` until confirmed."""
        role, rep = self._replicator_of(SYNC_STATE_KEY)
        if role is None or rep is None:
            return
        msg = pb.ReplicaForward(ref=pb.ShardRef(variable=SYNC_STATE_KEY[0], shard_index=SYNC_STATE_KEY[1]),
                                epoch=role.epoch, version=version, sync_state=state)
        if catch_up:
            with self._lock:
                self._install_at[SYNC_STATE_KEY] = version
        rep.put(SYNC_STATE_KEY, version, msg, [])



def note_skipped(shard: Shard, version: int, push_id: str) -> bool:
    """A backup's note of a sync step its primary skipped after update `version`; False: that update is missing."""
    with shard.lock:
        if shard.version < version:
            return False
        shard.record.add_key(push_key(push_id), version)
        return True


