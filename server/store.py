"""The PS's variable store: shards, versions, exactly-once pushes, validation before any change.

Plain Python, no gRPC: the servicer translates messages and calls this. Each shard has its own lock
(pushes to different shards proceed in parallel); `frozen()` takes all of them for a consistent
checkpoint. A push is validated completely (shapes, dtypes, row ids, NaN policy) before any shard is
touched, so bad input changes nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
from pscluster.server import optimizers as opt
from pscluster.server.dynamic_table import DynamicTable
from pscluster.server.dynamic_table import PushPlan as TablePlan
from pscluster.server.push_record import PushKey, PushRecord, push_key
from pscluster.server.rows import take_rows

from pscluster.codec import half_of
from pscluster.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError, ResourceExhaustedError
from pscluster.specs import Key as Key
from pscluster.specs import ShardSpec as ShardSpec
from pscluster.specs import same_definition
from pscluster.tables import TableConfig


@dataclass
class Shard:
    """A shard's state: value, optimizer slots, version, and the push ids it has applied (bounded)."""

    spec: ShardSpec
    value: np.ndarray
    slots: dict[str, np.ndarray]
    version: int = 0
    restored_version: int = -1
    record: PushRecord = field(default_factory=PushRecord)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    table: DynamicTable | None = None  # a hash-keyed dynamic table's rows (spec.table); value is then empty
    dtype: np.dtype = field(init=False, repr=False)  # np.dtype(spec.dtype), looked up once, not per push

    def __post_init__(self) -> None:
        self.dtype = np.dtype(self.spec.dtype)

    @property
    def name(self) -> str:
        """`variable[shard]`, as error messages name it."""
        return f"{self.spec.variable}[{self.spec.shard_index}]"


def shard_name(spec: ShardSpec) -> str:
    """`variable[shard]`, as error messages name a shard."""
    return f"{spec.variable}[{spec.shard_index}]"


class PushItem(NamedTuple):
    """One shard's part of a push: a dense gradient, or row ids (global) with row gradients."""

    key: Key
    grad: np.ndarray
    ids: np.ndarray | None = None


class PushResult(NamedTuple):
    """What a push did to one shard."""

    version: int
    applied: bool
    current: int = -1  # the shard's version right after (of the bytes copied out by a fused push-pull)


def initial_value(spec: ShardSpec, kind: str, value: float, seed: int) -> np.ndarray:
    """A shard's initial value from an initializer spec; seeded per shard so restarts agree."""
    dt = np.dtype(spec.dtype)
    if kind in ("", "zeros"):
        if spec.sparse:
            # a table's rows are touched at random, so lazily mapped zero pages would make its first
            # batches pay for the whole shard (130 ms for 5 M x 64 rows); it is resident from creation
            # instead, where the time is expected and a lack of memory shows at once
            out = np.empty(spec.shape, dt)
            out.fill(0)
            return out
        return np.zeros(spec.shape, dt)
    if kind == "ones":
        return np.ones(spec.shape, dt)
    if kind == "constant":
        return np.full(spec.shape, value, dt)
    rng = np.random.default_rng([seed, spec.ordinal])
    # float32/64 values are drawn in their own dtype and scaled in place: a 1 GB table peaks at 1 GB,
    # not at 3 GB (a float64 draw and its cast)
    if kind == "uniform":
        if dt in (np.float32, np.float64):
            out = rng.random(spec.shape, dtype=dt)
            out *= 2 * value
            out -= value
            return out
        return rng.uniform(-value, value, spec.shape).astype(dt)
    if kind == "normal":
        if dt in (np.float32, np.float64):
            out = rng.standard_normal(spec.shape, dtype=dt)
            out *= value
            return out
        return rng.normal(0.0, value, spec.shape).astype(dt)
    raise InvalidArgumentError(f"{spec.variable}: unknown initializer {kind!r}; use zeros, ones, constant, "
                               "uniform or normal")


# called under the shard's lock right after an update was applied (replicas: 2 forwards it in that order):
# (shard, gradient, local rows or None, push key or None, final_below, the version it made)
OnApplied = Callable[[Shard, np.ndarray, "np.ndarray | None", "PushKey | None", int, int], None]


class VariableStore:
    """All shards held by one PS task."""

    def __init__(self, nan_policy: str = "reject", dedup_window: int = 1_000_000,
                 max_tensor_bytes: int = 1 << 62) -> None:
        self._shards: dict[Key, Shard] = {}
        self._create_lock = threading.Lock()
        self._nan_policy = nan_policy
        self.rejected_nonfinite = 0  # pushes refused for a NaN or Inf (the worker's own check missed them)
        self._count_lock = threading.Lock()
        self.dedup_window = dedup_window
        self.max_tensor_bytes = max_tensor_bytes
        self.on_applied: OnApplied | None = None  # server/replication.py's forwarder, with replicas: 2
        # the same forwarder for a dynamic table's pull that created rows: (shard, the pull's keys), under its lock
        self.on_pulled: Callable[[Shard, np.ndarray], None] | None = None

    # -- structure -------------------------------------------------------------------------------
    def create(self, spec: ShardSpec, value: np.ndarray) -> tuple[Shard, bool]:
        """Create a shard, or return the existing identical one. Returns (shard, created).

        Raises:
            AlreadyExistsError: a shard with this key exists with another definition.
            InvalidArgumentError: value does not match the spec.
        """
        spec.validate()
        if value.shape != spec.shape or value.dtype != np.dtype(spec.dtype):
            raise InvalidArgumentError(
                f"{spec.variable}: initial value {value.dtype}{list(value.shape)} does not match "
                f"{np.dtype(spec.dtype)}{list(spec.shape)}")
        with self._create_lock:
            existing = self._shards.get(spec.key)
            if existing is not None:
                if not same_definition(existing.spec, spec):
                    raise AlreadyExistsError(
                        f"variable {spec.variable!r} shard {spec.shard_index} exists as "
                        f"{existing.spec.dtype}{list(existing.spec.full_shape)} "
                        f"({existing.spec.num_shards} shards, {existing.spec.optimizer.kind}); "
                        f"cannot redefine it as {spec.dtype}{list(spec.full_shape)} "
                        f"({spec.num_shards} shards, {spec.optimizer.kind})")
                return existing, False
            owned = value.flags.writeable and value.flags.c_contiguous and value.flags.owndata
            arr = value if owned else np.array(value, dtype=np.dtype(spec.dtype), copy=True, order="C")
            table = None
            if spec.table:
                table = DynamicTable(TableConfig.from_json(spec.table), spec.optimizer, shard_name(spec))
            slots = {} if table else opt.init_slots(spec.optimizer, spec.shape, arr.dtype, resident=spec.sparse)
            shard = Shard(spec, arr, slots, record=PushRecord(self.dedup_window), table=table)
            self._shards[spec.key] = shard
            return shard, True

    def check_size(self, spec: ShardSpec) -> None:
        """ResourceExhaustedError if a shard of spec would exceed max_tensor_bytes (nothing allocated)."""
        if spec.nbytes > self.max_tensor_bytes:
            raise ResourceExhaustedError(
                f"{spec.variable}: shard {spec.shard_index} of {spec.dtype}{list(spec.shape)} takes {spec.nbytes} bytes, "
                f"above max_tensor_bytes={self.max_tensor_bytes}; split the variable (a partitioner) or raise the limit")

    def install(self, shard: Shard) -> None:
        """Put a restored shard in place (checkpoint restore)."""
        with self._create_lock:
            self._shards[shard.spec.key] = shard

    def remove(self, key: Key, only: Shard | None = None) -> bool:
        """Drop a shard this PS no longer holds (it moved away: server/handoff.py); False if it had none, or
        (with `only`) if the shard it holds is another object than `only` (a copy installed since)."""
        with self._create_lock:
            if only is not None and self._shards.get(key) is not only:
                return False
            return self._shards.pop(key, None) is not None

    def find(self, key: Key) -> Shard | None:
        """The shard for key, or None."""
        return self._shards.get(key)

    def get(self, key: Key) -> Shard:
        """The shard for key, or NotFoundError."""
        shard = self._shards.get(key)
        if shard is None:
            raise NotFoundError(f"unknown variable {key[0]!r} shard {key[1]} on this PS")
        return shard

    def shards(self) -> list[Shard]:
        """All shards, in creation ordinal order."""
        return sorted(self._shards.values(), key=lambda s: s.spec.ordinal)

    @contextlib.contextmanager
    def frozen(self) -> Iterator[list[Shard]]:
        """Hold every shard's lock: no push applies while the caller reads a consistent state."""
        with self._create_lock:
            shards = self.shards()
            with contextlib.ExitStack() as stack:
                for shard in shards:
                    stack.enter_context(shard.lock)
                yield shards

    # -- reads -----------------------------------------------------------------------------------
    def pull(self, key: Key, ids: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """A copy of the shard (or of its rows `ids`, global row numbers) and its version."""
        shard = self.get(key)
        if shard.table is not None:
            if ids is None:
                raise InvalidArgumentError(f"{shard.name}: a dynamic table has no whole value; pull rows by key")
            shard.table.check_keys(ids)
            with shard.lock:
                rows, made = shard.table.pull(ids)
                if made.inserted and self.on_pulled is not None:  # rows created (maybe others evicted)
                    self.on_pulled(shard, ids)
                return rows, shard.version
        local = None if ids is None else self._local_rows(shard, ids)
        with shard.lock:
            out = shard.value.copy() if local is None else take_rows(shard.value, local)
            return out, shard.version

    def rows_of(self, key: Key, ids: np.ndarray) -> tuple[Shard, np.ndarray]:
        """The shard for key and the local row numbers of its global row ids (validated, nothing copied)."""
        shard = self.get(key)
        return shard, self._local_rows(shard, ids)

    @staticmethod
    def take_rows_into(shard: Shard, local: np.ndarray, out: np.ndarray) -> int:
        """Copy the shard's rows `local` (from rows_of) into out under its lock; returns their version."""
        with shard.lock:
            take_rows(shard.value, local, out)
            return shard.version

    def pull_chunks(self, key: Key, chunk_bytes: int) -> tuple[ShardSpec, int, Iterator[bytes]]:
        """Stream a shard as byte chunks; each chunk is copied under the lock (bounded memory).

        A pull that overlaps a push may see rows of two versions, as any Hogwild-style async PS.
        """
        shard = self.get(key)
        flat = shard.value.reshape(-1).view(np.uint8)

        def chunks() -> Iterator[bytes]:
            for start in range(0, flat.size, chunk_bytes):
                with shard.lock:
                    piece = flat[start:start + chunk_bytes].tobytes()
                yield piece

        return shard.spec, shard.version, chunks()

    @staticmethod
    def copy_into(shard: Shard, out: np.ndarray) -> None:
        """All of the shard's bytes into `out` (uint8, exactly the shard's size), under its lock."""
        flat = shard.value.reshape(-1).view(np.uint8)
        with shard.lock:
            out[:] = flat

    @staticmethod
    def copy_chunks(shard: Shard, out: np.ndarray) -> Iterator[memoryview]:
        """The shard's bytes, len(out) at a time: each piece is copied into `out` under the lock and
        yielded after it is released (the caller sends it; `out` is overwritten by the next piece).

        A pull that overlaps a push may see rows of two versions, as any Hogwild-style async PS.
        """
        flat = shard.value.reshape(-1).view(np.uint8)
        for start in range(0, flat.size, out.size):
            n = min(out.size, flat.size - start)
            with shard.lock:
                out[:n] = flat[start:start + n]
            yield out[:n].data

    # -- writes ----------------------------------------------------------------------------------
    def validate_push(self, items: Sequence[PushItem]) -> list[tuple[Shard, PushItem, np.ndarray | None]]:
        """Check every item against its shard; returns (shard, item, local rows) or raises."""
        checked = []
        seen: set[Key] = set()
        reject_nan = self._nan_policy == "reject"
        shards = self._shards
        for item in items:
            key, grad, ids = item
            shard = shards.get(key)
            if shard is None:
                shard = self.get(key)  # raises NotFoundError
            if key in seen:
                raise InvalidArgumentError(f"{shard.name}: pushed twice in one request")
            seen.add(key)
            dtype = grad.dtype
            if dtype != shard.dtype:
                if not half_of(shard.dtype, dtype):
                    raise InvalidArgumentError(
                        f"{shard.name}: gradient dtype {grad.dtype} does not match variable dtype {shard.dtype}")
                grad = grad.astype(np.float32)  # mixed precision: a half gradient upcast before the optimizer
                item, dtype = PushItem(key, grad, ids), grad.dtype
            local = None
            shape = shard.spec.shape
            if ids is None:
                if shard.table is not None:
                    raise InvalidArgumentError(f"{shard.name}: a dynamic table takes row gradients by key")
                if grad.shape != shape:
                    raise InvalidArgumentError(
                        f"{shard.name}: gradient shape {grad.shape} does not match shard shape {shape}")
            else:
                if shard.table is not None:
                    shard.table.check_keys(ids)
                    local = ids  # keys: the table finds (or makes) their rows under the lock
                else:
                    local = self._local_rows(shard, ids)
                want = (ids.shape[0],) + shape[1:]
                if grad.shape != want:
                    raise InvalidArgumentError(
                        f"{shard.name}: row gradients of shape {grad.shape} for {ids.shape[0]} ids; "
                        f"expected {want}")
            # logical_and.reduce, not .all(): the same test without a Python frame per shard
            if reject_nan and dtype.kind == "f" and not np.logical_and.reduce(np.isfinite(grad), axis=None):
                with self._count_lock:
                    self.rejected_nonfinite += 1
                raise InvalidArgumentError(
                    f"{shard.name}: gradient holds NaN or Inf; rejected (nan_policy=reject)")
            checked.append((shard, item, local))
        return checked

    def push(self, push_id: str, items: Sequence[PushItem], final_below: int = 0,
             values_into: np.ndarray | None = None) -> list[PushResult]:
        """Apply a push to its shards, at most once per push_id per shard (empty id: always).

        final_below: the pushing coordinator's mark (server/push_record.py): its closures below it are
        final, so their ids are forgotten and a late copy of their pushes is refused.
        values_into: for a fused push-pull of dense shards, uint8 room for every shard's bytes in item
        order; each shard's value right after this push is copied there under the same lock hold.
        """
        checked = self.validate_push(items)
        key = push_key(push_id) if push_id else None
        if len(checked) > 1 and any(shard.table is not None for shard, _, _ in checked):
            return self._push_all_or_nothing(checked, key, final_below)
        results = []
        fill = 0
        for shard, item, local in checked:
            out = None
            if values_into is not None:
                out = values_into[fill:fill + shard.value.nbytes]
                fill += shard.value.nbytes
            results.append(self.apply(shard, item.grad, local, key, final_below, out))
        return results

    def _push_all_or_nothing(self, checked: list[tuple[Shard, PushItem, np.ndarray | None]], key: PushKey | None,
                             final_below: int) -> list[PushResult]:
        """A push of several items, one a dynamic table: every shard's lock is taken (in ordinal order, as
        frozen() does) and every table item is prepared before any item applies, so a shard refusing its
        new keys at capacity leaves the request's other shards unchanged too."""
        with contextlib.ExitStack() as stack:
            for shard in sorted({id(s): s for s, _, _ in checked}.values(), key=lambda s: s.spec.ordinal):
                stack.enter_context(shard.lock)
            plans: list[TablePlan | None] = []
            for shard, item, local in checked:  # nothing changes until every item is prepared
                held = key is not None and _seen_after(shard.record, key, final_below)
                plans.append(shard.table.prepare(local, item.grad)
                             if shard.table is not None and local is not None and not held else None)
            return [self._apply_held(shard, item.grad, local, key, final_below, None, plan)
                    for (shard, item, local), plan in zip(checked, plans)]

    def apply(self, shard: Shard, grad: np.ndarray, local: np.ndarray | None, key: PushKey | None,
              final_below: int = 0, out: np.ndarray | None = None) -> PushResult:
        """Apply one validated gradient under the shard's lock, unless the push of `key` (see `push_key`;
        None: always apply) was applied already; with `out`, copy the shard's bytes there before letting
        go of the lock."""
        with shard.lock:
            return self._apply_held(shard, grad, local, key, final_below, out)

    def _apply_held(self, shard: Shard, grad: np.ndarray, local: np.ndarray | None, key: PushKey | None,
                    final_below: int, out: np.ndarray | None, plan: TablePlan | None = None) -> PushResult:
        """apply's body, with the shard's lock held by the caller (`plan`: its table item, prepared)."""
        record = shard.record
        record.advance(final_below)
        if key is not None and record.seen_key(key):
            applied = record.applied_at_key(key)  # the version it made (lost-update accounting)
            result = PushResult(shard.version if applied is None else applied, False, shard.version)
        else:
            t = shard.version + 1
            if shard.table is not None:
                assert local is not None  # validate_push refused a dense gradient
                if plan is not None:  # evicted keys and drops: in shard.table.stats
                    shard.table.commit(plan)
                else:
                    shard.table.push(local, grad)
            elif local is None:
                opt.apply_dense(shard.spec.optimizer, shard.value, grad, shard.slots, t)
            else:
                opt.apply_sparse(shard.spec.optimizer, shard.value, local, grad, shard.slots, t)
            shard.version = t
            if key is not None:
                record.add_key(key, t)
            result = PushResult(t, True, t)
            hook = self.on_applied
            if hook is not None:
                hook(shard, grad, local, key, final_below, t)
        if out is not None:
            out[:] = shard.value.reshape(-1).view(np.uint8)
        return result

    @staticmethod
    def apply_at(shard: Shard, version: int, grad: np.ndarray, local: np.ndarray | None, key: PushKey | None,
                 final_below: int, clock_s: int | None = None) -> Literal["applied", "held", "gap"]:
        """A backup's apply of its primary's update number `version` (server/replica_backup.py), only if it is
        the next one: "held" for one applied already (a resend), "gap" for one beyond the next (the backup
        needs the shard's whole state first). clock_s: a dynamic table's update decides by the primary's
        seconds (DynamicTable.pinned_s)."""
        with shard.lock:
            if version <= shard.version:
                return "held"
            if version > shard.version + 1:
                return "gap"
            shard.record.advance(final_below)
            if shard.table is not None:
                assert local is not None  # the primary applied row gradients by key
                shard.table.pinned_s = clock_s
                try:
                    shard.table.push(local, grad)
                finally:
                    shard.table.pinned_s = None
            elif local is None:
                opt.apply_dense(shard.spec.optimizer, shard.value, grad, shard.slots, version)
            else:
                opt.apply_sparse(shard.spec.optimizer, shard.value, local, grad, shard.slots, version)
            shard.version = version
            if key is not None:
                shard.record.add_key(key, version)
            return "applied"

    @staticmethod
    def _local_rows(shard: Shard, ids: np.ndarray) -> np.ndarray:
        spec = shard.spec
        if not spec.shape:
            raise InvalidArgumentError(f"{spec.variable}: a scalar has no rows")
        if ids.ndim != 1:
            raise InvalidArgumentError(f"{spec.variable}: row ids must be 1-D, got shape {ids.shape}")
        local = ids - spec.row_offset
        if ids.size and (local.min() < 0 or local.max() >= spec.shape[0]):
            bad = ids[(local < 0) | (local >= spec.shape[0])][0]
            raise InvalidArgumentError(
                f"{spec.variable}[{spec.shard_index}]: row id {bad} outside rows "
                f"[{spec.row_offset}, {spec.row_offset + spec.shape[0]}) of this shard "
                f"(table has {spec.full_shape[0]} rows)")
        return local


def ensure_created(store: VariableStore, spec: ShardSpec, initial: np.ndarray | None,
                   init_kind: str, init_value: float, seed: int) -> tuple[Shard, bool]:
    """Create a shard from an explicit value or an initializer spec (idempotently).

    Raises:
        ResourceExhaustedError: the shard (with its optimizer slots) exceeds the store's
            max_tensor_bytes; checked before anything is allocated.
    """
    spec.validate()
    store.check_size(spec)
    if initial is None:
        existing = store.find(spec.key)  # an idempotent re-create must not build a large initial value again
        value = initial_value(spec, init_kind, init_value, seed) if existing is None else existing.value
        return store.create(spec.validate(), value)
    return store.create(spec, initial)


def _seen_after(record: PushRecord, key: PushKey, final_below: int) -> bool:
    """record.seen_key(key) as it answers after record.advance(final_below), without advancing: a push
    refused later (a table shard at capacity) must leave every shard's record as it was."""
    cid = key[1]
    late = cid is not None and final_below > 0 and cid >> 32 == final_below >> 32 and cid < final_below
    return late or record.seen_key(key)
