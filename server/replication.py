"""PS-to-PS replication (replicas: 2): a primary forwards every update it applies to the shard's backup.

The coordinator tells each PS its roles (`set_roles`): for every shard, the epoch of its
(primary, backup) configuration, whether this PS is its primary, and where the backup is. Then:

- The store calls `on_applied` under the shard's lock right after an update (a push, or a sync step's one
  aggregated update), so forwards are queued in exactly the order the primary applied them. A forward
  carries (epoch, the version the update made, push id, final_below, gradient, local rows); versions rise
  by one per update, so they are the sequence numbers.
- One `Replicator` per backup PS (server/replicator.py) owns a queue and a named thread that sends the queued forwards in
  batches (one Replicate RPC, with a deadline). A batch that fails is sent again (the backup ignores
  versions it holds); the queue is bounded in bytes: past it, a shard's forwards are skipped and its
  whole state is sent instead, as for a backup that answers GAP (it lacks an earlier update: it restarted)
  or a new backup (catch-up, shard creation). Catch-up is queued under the shard's lock too, so what
  follows it applies on top.
- `wait` holds a push's reply until the backup confirmed the versions it made (or, for a retried
  push the primary held already, the version it was applied at): an acknowledgement means two copies.
- The backup (server/replica_backup.py: `receive`; `receive_dense` for a batch of plain dense updates in
  server/replica_wire.py's compact form, through the same update path) applies forwards in version order with
  the same optimizer code at the same version number, adds each push id to its push record (exactly-once
  survives a promotion), and refuses a forward of an older epoch than it knows: a deposed primary gets STALE
  and its pushes' waiters get a retryable UnavailableError, so its workers go to the new primary.
- The sync state (PS 0's token queue, bounded clocks and G; key SYNC_STATE_KEY) has a row of the table
  too: its primary forwards the whole state after each change (`forward_sync`, on the same stream), a
  token call's reply waits for the backup as a push's does, and a catch-up is one more such forward.

This module holds the roles and the primary's side (updates, catch-ups, waits); the other forwards (the sync
state, skipped steps, config changes, pulls and sweeps) are server/replica_notes.py's, and the backup's side
is server/replica_backup.py's: both are mixins of `Replication`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server import catch_up, replica_wire, table_state
from pscluster.server.forward_buffers import ForwardBuffers, ForwardTemplates
from pscluster.server.push_record import PushKey
from pscluster.server.replica_backup import ReplicaBackup
from pscluster.server.replica_notes import ReplicaNotes, SyncStateHolder
from pscluster.server.replicator import BATCH_BYTES, MAX_QUEUED_BYTES, ReplicaLink, Replicator, name_of
from pscluster.server.store import Key, Shard, VariableStore

from pscluster import codec
from pscluster.errors import UnavailableError
from pscluster.placement import SYNC_STATE_KEY
from pscluster.specs import spec_to_pb

log = logging.getLogger(__name__)

PENDING = 1 << 62  # a catch-up's version before its state was queued: above any the backup can confirm


@dataclass(frozen=True)
class Role:
    """One row of the coordinator's replica table: shard key's primary and backup (PS indices, -1: none)."""

    key: Key
    epoch: int
    primary: int
    backup: int = -1


class Replication(ReplicaNotes, ReplicaBackup):
    """A PS's replication roles, forwarders and backup side; owned by its ParameterServerCore."""

    def __init__(self, store: VariableStore, ps_index: int, connect: Callable[[int], ReplicaLink],
                 timeout: float = 5.0, max_queued_bytes: int = MAX_QUEUED_BYTES, step_timeout: float = 60.0,
                 chunk_bytes: int = catch_up.CHUNK_BYTES, batch_bytes: int = BATCH_BYTES) -> None:
        self.store = store
        self.ps_index = ps_index
        self._connect = connect
        self.timeout = timeout
        self.step_timeout = step_timeout  # a sync push waits for its step (the other replicas' gradients) too
        self._max_queued = max_queued_bytes
        self.buffers = ForwardBuffers()  # the forwards' gradient copies, reused (cache-warm) push after push
        self._templates = ForwardTemplates()  # a dense forward's ref and header, built once per shard
        self._lock = threading.Lock()  # roles, epochs and replicators (never held across I/O or a shard lock)
        self._roles: dict[Key, Role] = {}  # the whole table (clients read it through GetRoles)
        self.version = 0  # of that table
        self._epochs: dict[Key, int] = {}  # the newest epoch known per shard (a backup refuses older ones)
        self._replicators: dict[int, Replicator] = {}
        # replicators of backups no longer wanted: signalled, joined later (a SetRoles never waits for one
        # that is inside an RPC to a stopped backup)
        self._retired: list[Replicator] = []
        self._install_at: dict[Key, int] = {}  # a resync's version, until the backup confirmed it
        # per shard, the replicator and queue place of its latest config change or sweep; kept (not popped by a
        # waiter: two changes at once each wait for the later one), and a place counts only on its own replicator
        self._configs: dict[Key, tuple[weakref.ref[Replicator], int]] = {}
        # per shard, (version, how many table pulls this copy took at that version): a pull forward's place
        self._pulls: dict[Key, tuple[int, int]] = {}
        # backup side: per shard, the epoch of the whole state this copy was installed from (a resent older
        # install of the same primary's stream is held, not installed over the updates after it)
        self._copy_epoch: dict[Key, int] = {}
        self._key_locks: dict[Key, threading.Lock] = {}  # backup side: one forward of a shard at a time
        self.chunk_bytes = chunk_bytes  # a catch-up's chunk (server/catch_up.py)
        self.batch_bytes = batch_bytes  # forwards one replication batch groups (within a backup's frame)
        self._staged = catch_up.Stager(store.dedup_window)  # backup side: catch-ups in chunks, until their last
        self.sync_state: SyncStateHolder | None = None  # the sync state's primary and backup side (PS 0's, at first)
        store.on_applied = self.on_applied
        store.on_pulled = self.on_pulled

    # -- roles --------------------------------------------------------------------------------------
    def set_roles(self, version: int, roles: Iterable[Role]) -> None:
        """Take the coordinator's table (older versions are ignored); a shard this PS is primary of that got
        a new backup or epoch sends the backup its whole state, queued by the backup's replicator thread
        after this returns (its pushes wait for that state's confirmation)."""
        me = self.ps_index
        resync: list[Key] = []
        with self._lock:
            if version < self.version:
                return
            self.version = version
            for role in roles:
                old = self._roles.get(role.key)
                if old is not None and role.epoch < old.epoch:
                    continue
                self._roles[role.key] = role
                if me in (role.primary, role.backup):
                    self._epochs[role.key] = max(self._epochs.get(role.key, 0), role.epoch)
                if role.primary == me and role.backup >= 0 and (old is None or old.epoch != role.epoch):
                    resync.append(role.key)
                    self._install_at[role.key] = PENDING  # catching up from now on (until resync says from where)
            wanted = {r.backup for r in self._roles.values() if r.primary == me and r.backup >= 0}
            for ps in wanted - self._replicators.keys():
                self._replicators[ps] = Replicator(ps, self._connect(ps), me, self.timeout, self.resync,
                                                   self._max_queued, self.batch_bytes)
            gone = [self._replicators.pop(ps) for ps in list(self._replicators) if ps not in wanted]
            for ps, rep in self._replicators.items():
                rep.keys = {k for k, r in self._roles.items() if r.primary == me and r.backup == ps}
        for rep in gone:
            rep.signal_stop()
        with self._lock:
            retired = self._retired + gone
            self._retired = [r for r in retired if not r.finished]
        for rep in retired:
            if rep.finished:
                rep.stop()  # joined already: closes its channel
        for key in resync:
            now, target = self._replicator_of(key)
            if now is not None and target is not None:
                # queued by the replicator's thread after this answer: encoding a large shard here would hold a
                # move's freeze (it ends when the successor has answered) for as long as the encode; the
                # successor is then a primary whose backup catches up, as after a failover
                target.forget(key, now.epoch, resync=key != SYNC_STATE_KEY)
                if key != SYNC_STATE_KEY:
                    continue
            self.resync(key)
        for rep in self._current():
            rep.poke()
        self._drop_staged()
        if self.sync_state is not None:
            self.sync_state.roles_changed()

    def _drop_staged(self) -> None:
        """Backup side, after a roles change: drop the catch-ups in chunks of an older epoch, or of shards this PS
        no longer backs up (each under its shard's key lock: a chunk may be arriving)."""
        for key in self._staged.keys():
            with self._lock:
                role = self._roles.get(key)
            epoch = role.epoch if role is not None and role.backup == self.ps_index else None
            with self._key_lock(key):
                self._staged.drop_before(key, epoch)

    def roles(self) -> tuple[int, list[Role]]:
        """The table this PS holds, and its version."""
        with self._lock:
            return self.version, list(self._roles.values())

    def epoch_of(self, key: Key) -> int:
        """The replica epoch of this PS's copy of shard key, which ranks saved copies (checkpoint.restore): the
        epoch it leads as primary, else that of the whole state its copy was installed from (0: none yet, as a
        restored copy the table names this PS backup of before the primary's install arrives)."""
        with self._lock:
            role = self._roles.get(key)
            if role is not None and role.primary == self.ps_index:
                return role.epoch
            return self._copy_epoch.get(key, 0)

    def catching_up(self) -> list[Key]:
        """Shards this PS is primary of whose backup has not confirmed the whole state it was sent."""
        with self._lock:
            pending = list(self._install_at.items())
        out = []
        for key, version in pending:
            _, rep = self._replicator_of(key)
            if rep is not None and rep.acked.get(key, -1) < version:
                out.append(key)
            elif rep is not None:
                with self._lock:
                    if self._install_at.get(key) == version:
                        del self._install_at[key]
        return sorted(out)

    def _current(self) -> list[Replicator]:
        with self._lock:
            return list(self._replicators.values())

    def _replicator_of(self, key: Key) -> tuple[Role | None, Replicator | None]:
        with self._lock:
            role = self._roles.get(key)
            if role is None or role.primary != self.ps_index or role.backup < 0:
                return role, None
            return role, self._replicators.get(role.backup)

    def is_primary(self, key: Key) -> bool:
        """Whether this PS is the primary of shard key now."""
        role = self._roles.get(key)
        return role is not None and role.primary == self.ps_index

    def forwards(self) -> bool:
        """Whether any shard this PS is primary of has a backup now (elastic one copy: only while one moves)."""
        return bool(self._replicators)

    def is_backup(self, key: Key) -> bool:
        """Whether this PS is the backup of shard key now."""
        role = self._roles.get(key)
        return role is not None and role.backup == self.ps_index

    def check_primary(self, keys: Iterable[Key]) -> None:
        """UnavailableError (retryable: the client re-reads placement) unless this PS is the primary of keys."""
        roles = self._roles
        for key in keys:
            role = roles.get(key)
            if role is None:
                # a restarted PS may hold an old copy that moved while it was away: it waits for the table
                raise UnavailableError(f"ps {self.ps_index} has no replica table entry for {name_of(key)} yet "
                                       "(the coordinator sends it within a heartbeat); retry")
            if role.primary != self.ps_index:
                raise UnavailableError(f"ps {self.ps_index} is not the primary of {name_of(key)} (epoch {role.epoch}: "
                                       f"ps {role.primary}); re-read placement")

    # -- primary side -------------------------------------------------------------------------------
    def on_applied(self, shard: Shard, grad: np.ndarray, local: np.ndarray | None, key: PushKey | None,
                   final_below: int, version: int) -> None:
        """The store's hook (under the shard's lock): queue the update for the shard's backup."""
        role, rep = self._replicator_of(shard.spec.key)
        if role is None or rep is None:
            return
        # copies: the gradient is a view of the connection's buffer, which the next push reuses; a dense one's
        # shape is the same push after push (a kept buffer fits it), rows' are not
        arrays = [self.buffers.copy(grad) if local is None else np.array(grad, copy=True)]
        spec = shard.spec
        push_id = key[0] if key is not None else ""
        wire: bytes | None = None
        if local is None:
            msg, const = self._templates.forward(spec.variable, spec.shard_index, grad)
            if shard.table is None and rep.compact:  # a plain dense update, to a link that takes the compact form
                wire = replica_wire.forward(const, role.epoch, version, final_below, push_id)
        else:
            msg = pb.ReplicaForward(ref=pb.ShardRef(variable=spec.variable, shard_index=spec.shard_index),
                                    grad=codec.header(grad.dtype, grad.shape))  # rows: a shape per push, no template
        msg.epoch = role.epoch
        msg.version = version
        msg.push_id = push_id
        msg.final_below = final_below
        if local is not None:
            rows = np.array(local, np.int64, copy=True)
            msg.rows.CopyFrom(codec.header(rows.dtype, rows.shape))
            msg.has_rows = True
            arrays.append(rows)
        if shard.table is not None:
            msg.clock_s = shard.table.now_s  # the backup repeats it at the primary's seconds
        rep.put(shard.spec.key, version, msg, arrays, wire)

    def _pulls_at(self, key: Key, version: int) -> int:
        """How many table pulls this copy of key took at `version`."""
        with self._lock:
            at, count = self._pulls.get(key, (-1, 0))
            return count if at == version else 0

    def _took_pull(self, key: Key, version: int) -> int:
        """Count a table pull this copy took at `version`; returns its place among them (0, 1, ...)."""
        with self._lock:
            at, count = self._pulls.get(key, (-1, 0))
            index = count if at == version else 0
            self._pulls[key] = (version, index + 1)
            return index

    def changes_here(self, shard: Shard) -> bool:
        """Whether a set_hyperparameters call changes this copy of shard: not on its backup, which takes
        the change from its primary's stream, in order with the updates."""
        role = self._roles.get(shard.spec.key)
        return role is None or role.backup != self.ps_index

    def resync(self, key: Key, start: int = 0) -> None:
        """Queue shard key's whole state for its backup (catch-up), in order with its updates; a state larger
        than a chunk goes in chunks (server/catch_up.py): this queues the one from row `start`."""
        if key == SYNC_STATE_KEY:
            if self.sync_state is not None:
                self.sync_state.send_state()
            return
        shard = self.store.find(key)
        role, rep = self._replicator_of(key)
        if shard is None or role is None or rep is None:
            return
        with shard.lock:  # a snapshot: the arrays are copied before any later update changes them
            rows = catch_up.rows_per_chunk(shard, self.chunk_bytes)
            if rows is not None:
                msg = pb.ReplicaForward(ref=pb.ShardRef(variable=key[0], shard_index=key[1]), epoch=role.epoch,
                                        version=shard.version, spec=spec_to_pb(shard.spec),
                                        pull_index=self._pulls_at(key, shard.version))
                arrays = catch_up.chunk(shard, start, rows, msg)
                with self._lock:  # catching up until the last chunk is confirmed
                    self._install_at[key] = PENDING if msg.chunk_more else shard.version
                rep.put(key, shard.version, msg, arrays)
                return
            state = dict(shard.slots)
            if shard.table is not None:  # a dynamic table's live rows, slots and admission state
                table = table_state.snapshot(shard.table)
                if catch_up.state_bytes(table) > self.chunk_bytes:  # (no keys yet: a sketch alone may be)
                    base = pb.ReplicaForward(ref=pb.ShardRef(variable=key[0], shard_index=key[1]), epoch=role.epoch,
                                             version=shard.version, spec=spec_to_pb(shard.spec),
                                             pull_index=self._pulls_at(key, shard.version))
                    with self._lock:
                        self._install_at[key] = shard.version
                    rep.put_series(key, shard.version, catch_up.table_chunks(shard, table, self.chunk_bytes, base))
                    return
                state.update({catch_up.TABLE + name: arr for name, arr in table.items()})
            msg = pb.ReplicaForward(ref=pb.ShardRef(variable=key[0], shard_index=key[1]), epoch=role.epoch,
                                    version=shard.version, spec=spec_to_pb(shard.spec),
                                    value=codec.header(shard.value.dtype, shard.value.shape),
                                    record=json.dumps(shard.record.state()),
                                    pull_index=self._pulls_at(key, shard.version))
            arrays = [np.array(shard.value, copy=True)]
            for name in sorted(state):
                msg.slots[name].CopyFrom(codec.header(state[name].dtype, state[name].shape))
                arrays.append(np.array(state[name], copy=True))
            with self._lock:
                self._install_at[key] = shard.version
            rep.put(key, shard.version, msg, arrays)

    def wait(self, versions: Sequence[tuple[Key, int]], timeout: float | None = None, block: bool = True) -> None:
        """Return once every (shard, version) is held by the shard's backup (at once for a shard without one);
        block=False (a push served on the bulk port's loop, which must not stall its other peers): raise
        instead of waiting for a backup that has not confirmed yet.

        Raises:
            UnavailableError: not confirmed within timeout (at once with block=False: the client retries the push
                with the same id, on a thread, and the PS's push record answers it), or this PS is no longer
                the shard's primary.
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for key, version in versions:
            while True:
                role, rep = self._replicator_of(key)
                if rep is None:
                    if role is not None and role.primary == self.ps_index and role.backup < 0:
                        break  # one copy of this shard now: nothing to wait for
                    # deposed, or replication stopped (shutdown): the backup may not hold the update, so the
                    # push is not acknowledged here; the client retries it, same id, on the shard's primary
                    raise UnavailableError(f"{name_of(key)}: ps {self.ps_index} is no longer its primary or is "
                                           "stopping; the push was not acknowledged (retry it with the same id)")
                if not block and not rep.held(key, version):
                    raise UnavailableError(f"{name_of(key)} got a backup on ps {self.ps_index} (a move) after the "
                                           "bulk port's loop took this push, which must not wait for it; the push was "
                                           "applied but not acknowledged: retry it with the same id")
                if rep.wait(key, version, deadline):
                    break  # confirmed; False: the roles changed, look again

    def stop(self) -> None:
        """Stop every replicator thread (joined)."""
        with self._lock:
            reps, self._replicators = list(self._replicators.values()) + self._retired, {}
            self._retired = []
        for rep in reps:
            rep.stop()
