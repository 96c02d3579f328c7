"""The PS core: the store plus checkpoints, global step and request-level validation; no gRPC."""

from __future__ import annotations

import logging
import math
import os
import pathlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server import checkpoint, hyperparams, table_ops
from pscluster.server.handoff import ShardGate
from pscluster.server.store import PushItem, PushResult, Shard, ShardSpec, VariableStore, ensure_created
from pscluster.server.sync_hook import SyncHook

from pscluster.checkpoint_files import newer_incomplete
from pscluster.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from pscluster.optimizer_config import changes_from_json
from pscluster.placement import SYNC_STATE_KEY

if TYPE_CHECKING:
    from pscluster.server.replication import Role

log = logging.getLogger(__name__)


class ParameterServerCore:
    """One PS task's state and operations, called by the servicer with decoded arguments."""

    def __init__(self, ps_index: int, num_ps: int, *, nan_policy: str = "reject",
                 checkpoint_dir: pathlib.Path | None = None, keep_checkpoints: int = 3,
                 dedup_window: int = 1_000_000, max_tensor_bytes: int = 1 << 62) -> None:
        self.ps_index = ps_index
        self.num_ps = num_ps
        self.store = VariableStore(nan_policy=nan_policy, dedup_window=dedup_window, max_tensor_bytes=max_tensor_bytes)
        self.checkpoint_dir = checkpoint_dir
        self.keep_checkpoints = keep_checkpoints
        self.global_step = 0
        self.restored_step = -1
        self.incarnation = int.from_bytes(os.urandom(6), "little")
        self._save_lock = threading.Lock()
        if checkpoint_dir is not None:
            removed = checkpoint.remove_stale_temporaries(checkpoint_dir, ps_index, num_ps)  # no save yet
            if removed:
                log.info("ps %d: removed %d temporaries left by interrupted saves in %s", ps_index, removed,
                         checkpoint_dir)
        self.sync: SyncHook | None = None  # a SyncReplicas, installed by sync_replicas.attach()
        self.bulk_port = 0
        self.metrics: Any = None  # a PsMetrics, installed by main.start()
        self.replication: Any = None  # a server.replication.Replication with replicas: 2 (None: one copy)
        self.links: Any = None  # its server.link_pool.LinkPool: replica links opened when the PS list arrives
        self.gate = ShardGate(ps_index)  # shards frozen while they move to another PS (server/handoff.py)
        self.addresses: list[str] = []  # the PS list (the cluster file's, then the coordinator's: ps_book.py)
        self.ps_epoch = 0
        self._drained: tuple[int, list[int]] = (0, [])  # (table version, PS tasks a scale drained), for GetRoles
        self._ps_list_lock = threading.Lock()  # addresses, ps_epoch, num_ps: check-and-set (never held over I/O)
        # replicas: 2: shards a restore loaded that no replica table has named this PS for yet (restore)
        self._unclaimed: dict[tuple[str, int], Shard] = {}  # key -> the restored copy (a later install is not one)

    def take_ps_list(self, addresses: Sequence[str], epoch: int) -> None:
        """The coordinator's PS list (it rides SetRoles): replication links to a PS that joined, and the P
        of checkpoint file names, follow it. An empty or older list changes nothing."""
        now = list(addresses)
        if not now:
            return
        with self._ps_list_lock:  # a keeper round's SetRoles and an elastic reassign's may race: newest wins
            if epoch < self.ps_epoch:
                return
            changed = now != self.addresses
            self.addresses, self.ps_epoch, self.num_ps = now, epoch, len(now)
        if changed and self.links is not None:  # before a move makes this PS anyone's primary (link_pool.py)
            self.links.prepare(now, now[self.ps_index] if 0 <= self.ps_index < len(now) else "")

    def own_address(self) -> str:
        """This PS's address in the PS list ('' before it is in one)."""
        return self.addresses[self.ps_index] if 0 <= self.ps_index < len(self.addresses) else ""

    def drained(self) -> list[int]:
        """The PS tasks a scale drained, as the newest table said (clients place new shards elsewhere)."""
        with self._ps_list_lock:
            return list(self._drained[1])

    def take_roles(self, version: int, roles: Sequence[Role], addresses: Sequence[str], epoch: int,
                   drained: Sequence[int] = ()) -> None:
        """The coordinator's replica table, PS list and drained PS tasks (SetRoles); a restored copy the table
        gives another PS's role is dropped (see restore)."""
        replication = self.replication
        if replication is None:
            raise FailedPreconditionError(f"ps {self.ps_index} runs with replicas: 1; start the cluster with "
                                          "replicas: 2")
        self.take_ps_list(addresses, epoch)  # before the roles: links need the address
        replication.set_roles(version, roles)
        with self._ps_list_lock:
            if version >= self._drained[0]:
                self._drained = (version, sorted(drained))
        _, table = replication.roles()
        self._drop_deposed(table)
        if not self._unclaimed:
            return
        named = {r.key: self.ps_index in (r.primary, r.backup) for r in table if r.key in self._unclaimed}
        for key, mine in named.items():
            restored = self._unclaimed.pop(key, None)  # one SetRoles of two racing ones decides each copy
            # only the restored copy itself: a newer table's catch-up may have installed a live one meanwhile
            if restored is not None and not mine and self.store.remove(key, only=restored):
                log.info("ps %d: dropped the restored copy of %s[%d]: the replica table has it on other PS tasks",
                         self.ps_index, key[0], key[1])

    def _drop_deposed(self, table: Sequence[Role]) -> None:
        """Drop the copies the replica table gives other PS tasks now (a PS stopped while its shards failed
        over, then resumed: nothing routes to them any more, and they would hold memory forever). A restored
        copy not yet claimed is left to take_roles' own rule; a shard the table does not list yet (just created)
        is kept."""
        for role in table:
            if self.ps_index in (role.primary, role.backup) or role.key in self._unclaimed:
                continue
            shard = self.store.find(role.key)
            if shard is not None and self.store.remove(role.key, only=shard):
                log.warning("ps %d: deposed: dropped its copy of %s[%d] (version %d): the replica table (epoch %d) "
                            "has it on ps %d (backup %s)", self.ps_index, role.key[0], role.key[1], shard.version,
                            role.epoch, role.primary, role.backup if role.backup >= 0 else "none")

    def replicas(self) -> SyncHook:
        """The sync-replica state, for the servicers."""
        if self.sync is None:
            raise FailedPreconditionError(f"ps {self.ps_index} has no sync-replica state (sync_replicas.attach)")
        return self.sync

    def restore(self) -> int:
        """Load the newest complete checkpoint into the store; returns its step or -1."""
        if self.checkpoint_dir is None:
            raise FailedPreconditionError("restore requested without a checkpoint_dir")
        # replicas: 2: the shards this task held at the save too (it may be named to bring back a shard whose
        # two copies died, wherever moves put it: docs/elastic.md); the first table that places a restored
        # copy elsewhere drops it (take_roles)
        held = self.replication is not None
        found = checkpoint.restore(self.store, self.checkpoint_dir, self.ps_index, self.num_ps, held=held)
        if held:
            self._unclaimed = {s.spec.key: s for s in self.store.shards()}
        for step, why in newer_incomplete(self.checkpoint_dir, -1 if found is None else found.step):
            log.warning("ps %d: checkpoint step %d is not complete: %s", self.ps_index, step, why)
        if found is None:
            log.info("ps %d: no complete checkpoint in %s; starting empty", self.ps_index, self.checkpoint_dir)
            return -1
        self.global_step = self.restored_step = found.step
        if self.sync is not None:
            self.sync.restore(found.extra.get("sync"), found.step)
        log.info("ps %d: restored step %d (%d shards) from %s", self.ps_index, found.step, found.shards,
                 self.checkpoint_dir)
        return found.step

    def create(self, spec: ShardSpec, initial: np.ndarray | None, init_kind: str, init_value: float,
               seed: int) -> Shard:
        """Create (or find the identical) shard."""
        shard, created = ensure_created(self.store, spec, initial, init_kind, init_value, seed)
        if created and self.replication is not None:
            self.replication.resync(spec.key)  # a primary told its roles before the shard existed
        if created:
            log.info("ps %d: created %s[%d] %s%s (%s)", self.ps_index, spec.variable, spec.shard_index,
                     spec.dtype, list(spec.shape), spec.optimizer.kind)
        return shard

    def pull(self, items: Sequence[tuple[tuple[str, int], np.ndarray | None]]) -> list[tuple[np.ndarray, int]]:
        """Pull several shards (or rows of them); with replicas: 2 only from their primary."""
        if self.replication is not None:
            self.replication.check_primary(key for key, _ in items)
        return [self.store.pull(key, ids) for key, ids in items]

    def push(self, push_id: str, step: int, items: Sequence[PushItem], final_below: int = 0,
             values_into: np.ndarray | None = None, skip_step: bool = False,
             on_loop: bool = False) -> list[PushResult]:
        """Apply (async) or accumulate (sync) a push; final_below, values_into: see VariableStore.push
        (an accumulating PS copies no values). With replicas: 2 the reply waits until the shards' backups hold
        the versions this push made (for a push held already: the version it was applied at). skip_step: the
        replica's gradient of this sync step was not finite; the named shards skip the step (see
        SyncReplicas.skip), an async PS changes nothing. on_loop: served on the bulk port's loop thread,
        which never waits: a shard that got a backup since the loop took the push (a move's temporary one,
        elastic with one copy) makes it answer a retryable UnavailableError once applied (`Replication.wait`)."""
        if self.replication is None:
            return self._push(push_id, step, items, final_below, values_into, skip_step, on_loop)
        # a shard moving to another PS refuses new pushes, and its move waits for those admitted (handoff.py)
        with self.gate.admit((item.key for item in items), step):
            return self._push(push_id, step, items, final_below, values_into, skip_step, on_loop)

    def _push(self, push_id: str, step: int, items: Sequence[PushItem], final_below: int,
              values_into: np.ndarray | None, skip_step: bool, on_loop: bool = False) -> list[PushResult]:
        replication = self.replication
        if replication is not None:
            replication.check_primary(item.key for item in items)
        if skip_step:
            shards = [self.store.get(item.key) for item in items]  # the items carry no gradient
            if self.sync is None or not self.sync.accumulates:
                return [PushResult(shard.version, False, shard.version) for shard in shards]
            skipped: list[PushResult] = self.sync.skip(push_id, step, shards)
            if replication is not None:
                replication.wait([(s.spec.key, self.sync.settled(s.spec.key, step, replication.step_timeout))
                                  for s, r in zip(shards, skipped) if r.applied], replication.step_timeout)
            return skipped
        if self.sync is not None and self.sync.accumulates:
            results: list[PushResult] = self.sync.push(push_id, step, items)
            if replication is not None:
                # a sync step's replies wait for its one aggregated update to reach the backup: a gradient
                # accumulated but not yet applied (current < 0) waits for the version its step settles at
                # (version + 1, or the same version when a replica's skip made the step apply nowhere)
                replication.wait([(item.key, self.sync.settled(item.key, step, replication.step_timeout)
                                   if r.applied and r.current < 0 else r.version)
                                  for item, r in zip(items, results)], replication.step_timeout)
            return results
        results = self.store.push(push_id, items, final_below, values_into)
        if replication is not None:
            replication.wait([(item.key, r.version) for item, r in zip(items, results)], block=not on_loop)
        return results

    def freeze_shard(self, key: tuple[str, int], successor: int, lease_s: float) -> int:
        """Stop admitting pushes for a shard this PS is primary of, wait for those admitted, and return its
        version once its backup `successor` (the PS it moves to) holds it (server/handoff.py).

        Raises:
            FailedPreconditionError: replicas: 1, or successor is not the shard's backup.
            InvalidArgumentError: lease_s outside (0, 60].
            UnavailableError: this PS is not the shard's primary, or the backup did not confirm in time.
        """
        replication = self.replication
        if replication is None:
            raise FailedPreconditionError(f"ps {self.ps_index} runs with replicas: 1; moving a shard needs the "
                                          "replica table (replicas: 2)")
        if not 0 < lease_s <= 60:
            raise InvalidArgumentError(f"a freeze lease must be in (0, 60] seconds, got {lease_s}")
        replication.check_primary([key])
        _, roles = replication.roles()
        role = next(r for r in roles if r.key == key)  # check_primary found it
        if role.backup != successor:
            raise FailedPreconditionError(f"{key[0]}[{key[1]}]: ps {successor} is not its backup (ps {role.backup} "
                                          "is): the successor catches up as backup before the freeze")
        if key == SYNC_STATE_KEY and self.sync is not None:
            return self._freeze_sync_state(self.sync, lease_s)
        shard = self.store.get(key)

        def drain(deadline: float) -> None:
            replication.wait([(key, shard.version)], max(0.0, deadline - time.monotonic()))

        # a sync job: the steps with a push in flight settle first (their pushes wait for each other)
        self.gate.freeze(key, lease_s, drain, between_steps=self.sync is not None and self.sync.accumulates)
        return int(shard.version)

    def _freeze_sync_state(self, sync: SyncHook, lease_s: float) -> int:
        """The sync state's row moves (elastic.py): refuse new token calls, wake the waiting ones (they retry on
        the new primary with the same closure id), wait for those admitted, then for the backup to hold the
        newest state; its version."""
        replication = self.replication

        def drain(deadline: float) -> None:
            replication.wait([(SYNC_STATE_KEY, sync.current_version())], max(0.0, deadline - time.monotonic()))

        self.gate.freeze(SYNC_STATE_KEY, lease_s, drain, on_frozen=sync.roles_changed)
        return sync.current_version()

    def thaw_shard(self, key: tuple[str, int], drop: bool = False) -> bool:
        """End a shard's freeze (its move switched the table, or was abandoned); drop: also remove this PS's
        copy when the replica table gives this PS no role for it any more. True if a copy was dropped."""
        self.gate.thaw([key])
        if not drop or self.replication is None:
            return False
        _, roles = self.replication.roles()
        role = next((r for r in roles if r.key == key), None)
        if role is None or self.ps_index in (role.primary, role.backup):
            return False  # no table yet, or this PS still holds it: keep the copy
        dropped = bool(self.store.remove(key))
        if dropped:
            log.info("ps %d: dropped %s[%d]: it moved to ps %d (epoch %d)", self.ps_index, key[0], key[1],
                     role.primary, role.epoch)
        return dropped

    def returns_values(self, items: Sequence[pb.PushItem]) -> bool:
        """Whether a fused push-pull of these pushed items gets values: only an async PS (an accumulating
        one has not applied the gradient yet) and only for whole dense shards."""
        return not (self.sync is not None and self.sync.accumulates) and not any(i.HasField("ids") for i in items)

    def push_stream(self, push_id: str, step: int, key: tuple[str, int], dtype: np.dtype,
                    shape: tuple[int, ...], ids: np.ndarray | None, chunks: Iterable[bytes],
                    final_below: int = 0) -> PushResult:
        """Assemble a streamed gradient into one buffer, then push it like a unary one."""
        shard = self.store.get(key)
        expected = math.prod(shape) * dtype.itemsize
        if ids is None and expected != shard.spec.nbytes:
            raise InvalidArgumentError(
                f"{key[0]}[{key[1]}]: streamed gradient of shape {shape} does not match shard shape {shard.spec.shape}")
        if ids is not None and (shape[:1] != (ids.size,) or shape[1:] != shard.spec.shape[1:]):
            raise InvalidArgumentError(f"{key[0]}[{key[1]}]: streamed row gradients of shape {shape} for {ids.size} ids; "
                                       f"expected {(ids.size,) + shard.spec.shape[1:]}")
        if expected > self.store.max_tensor_bytes:
            raise ResourceExhaustedError(f"{key[0]}[{key[1]}]: a streamed gradient of {expected} bytes is above "
                                         f"max_tensor_bytes={self.store.max_tensor_bytes}")
        buf = np.empty(expected, dtype=np.uint8)
        filled = 0
        for chunk in chunks:
            if filled + len(chunk) > expected:
                raise InvalidArgumentError(f"{key[0]}[{key[1]}]: streamed more than the {expected} bytes announced")
            buf[filled:filled + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            filled += len(chunk)
        if filled != expected:
            raise InvalidArgumentError(f"{key[0]}[{key[1]}]: stream ended after {filled} of {expected} bytes")
        grad = buf.view(dtype).reshape(shape)
        return self.push(push_id, step, [PushItem(key, grad, ids)], final_below)[0]

    def pull_stream(self, key: tuple[str, int], chunk_bytes: int) -> tuple[ShardSpec, int, Iterator[bytes]]:
        """Spec, version and byte chunks of one shard."""
        if self.replication is not None:
            self.replication.check_primary([key])
        return self.store.pull_chunks(key, chunk_bytes)

    def set_hyperparameters(self, variables: Sequence[str], changes_json: str,
                            dry_run: bool = False) -> tuple[int, list[str]]:
        """A driver's change of hyper-parameters on this task's shards of `variables` (all when empty);
        returns (shards changed, their variables); dry_run only validates."""
        changes = changes_from_json(changes_json)
        replication = self.replication
        if replication is None:
            shards = hyperparams.set_hyperparameters(self.store, variables, changes, dry_run)
        else:
            # replicas: 2: a primary changes its shards and forwards the change in order with their updates
            # (the backups' copies change from that stream, not from this call), then waits for the backups
            shards = hyperparams.set_hyperparameters(self.store, variables, changes, dry_run,
                                                     keep=replication.changes_here, on_changed=replication.configured)
            if not dry_run:
                replication.wait_configured([s.spec.key for s in shards])
        names = sorted({s.spec.variable for s in shards})
        count = len(shards)
        if not dry_run:
            log.info("ps %d: %s set on %d shards of %s", self.ps_index, sorted(changes), count,
                     ", ".join(names) or "-")
        return count, names

    def evicted_keys(self, variable: str) -> tuple[np.ndarray, int]:
        """Drain the eviction reports of `variable`'s dynamic table shards this PS is the primary of (a
        backup's copy evicts the same keys: reading both would list them twice)."""
        shards = [s for s in self.store.shards() if s.spec.variable == variable and s.table is not None]
        if self.replication is not None:
            shards = [s for s in shards if self.replication.is_primary(s.spec.key)]
        return table_ops.drain_evicted(shards)

    def evict(self, variable: str) -> int:
        """Run the eviction policy of `variable`'s dynamic table shards this PS is the primary of now; returns
        the keys evicted (listed in the eviction report). With replicas: 2 it returns once the backups evicted
        the same keys.

        Raises:
            UnavailableError: a backup did not confirm in time (the keys are evicted here; a retry sweeps again).
        """
        shards = [s for s in self.store.shards() if s.spec.variable == variable and s.table is not None]
        if self.replication is None:
            return table_ops.sweep(shards)
        shards = [s for s in shards if self.replication.is_primary(s.spec.key)]
        evicted = table_ops.sweep(shards, self.replication.swept)
        self.replication.wait_configured([s.spec.key for s in shards])
        return evicted

    def read_table(self, key: tuple[str, int], start: int, max_rows: int,
                   float16: bool) -> tuple[np.ndarray, np.ndarray, int, int]:
        """A page of a dynamic table shard's live keys and rows (server/table_ops.read_page)."""
        if self.replication is not None:
            self.replication.check_primary([key])
        return table_ops.read_page(table_ops.table_shard(self.store, key), start, max_rows, float16)

    def check_room(self, push_id: str, items: list[tuple[tuple[str, int], np.ndarray]]) -> None:
        """Whether a push's new keys fit every table shard named (server/table_ops.check_room)."""
        if self.replication is not None:
            self.replication.check_primary(key for key, _ in items)
        table_ops.check_room(self.store, push_id, items)

    def learning_rates(self) -> dict[str, float]:
        """Variable -> the rate of its next update on this task (schedule at the shard's count, or the set rate)."""
        return {s.spec.variable: s.spec.optimizer.lr_at(s.version + 1) for s in self.store.shards()}

    def save(self, step: int, absent: Sequence[int] = ()) -> tuple[pathlib.Path, list[tuple[str, int]]]:
        """Checkpoint every shard at `step` (consistent on this task: pushes wait); returns the file and the
        shards it holds. `absent`: write only empty files for these down tasks (checkpoint.save_absent)."""
        if self.checkpoint_dir is None:
            raise FailedPreconditionError(
                f"ps {self.ps_index} has no checkpoint_dir; start it with --checkpoint-dir")
        if step < 0:
            raise InvalidArgumentError(f"checkpoint step must be >= 0, got {step}")
        if bad := [t for t in absent if not 0 <= t < self.num_ps or t == self.ps_index]:
            raise InvalidArgumentError(f"Save: absent tasks {bad} are not other PS tasks of 0..{self.num_ps - 1}")
        with self._save_lock:
            extra: dict[str, object] = {"sync": self.sync.snapshot() if self.sync is not None else None}
            if absent:
                paths = checkpoint.save_absent(self.checkpoint_dir, step, sorted(set(absent)), self.num_ps,
                                               self.keep_checkpoints, self.ps_index, extra)
                return (paths[0] if paths else self.checkpoint_dir), []
            holds = self._holds()
            saved: list[tuple[str, int]] = []

            def writes(key: tuple[str, int]) -> bool:  # records what the save actually wrote
                if holds is not None and not holds(key):
                    return False
                saved.append(key)
                return True

            path = checkpoint.save(self.store, self.checkpoint_dir, step, self.ps_index, self.num_ps,
                                   self.keep_checkpoints, extra, writes,
                                   self.replication.epoch_of if self.replication is not None else None)
            self.global_step = max(self.global_step, step)
            return path, saved

    def _holds(self) -> Callable[[tuple[str, int]], bool] | None:
        """replicas: 2: the shards a save writes: those the replica table names this PS for, and those it does
        not know yet (just created). A copy it names other PS tasks for is stale (a restored copy not yet
        dropped, a deposed holder's) and must not compete with the live copies in the step's files."""
        if self.replication is None:
            return None
        _, table = self.replication.roles()
        others = {r.key for r in table if self.ps_index not in (r.primary, r.backup)}
        return lambda key: key not in others

    def total_bytes(self) -> int:
        """Bytes held in shard values."""
        return sum(s.spec.nbytes for s in self.store.shards())
