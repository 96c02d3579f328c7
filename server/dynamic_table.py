"""One shard of a hash-keyed dynamic table: rows that appear on touch, are admitted, updated, evicted.

One row id (from server/hash_index.py) per live key indexes every array of its state: value, each
optimizer slot, last-touched step (and second), decayed frequency (LFU only), the changed-since-checkpoint flag.
A freed row id is reset completely before another key gets it, so a re-admitted key starts fresh and
no slot outlives its row. Arrays are reserved at the shard's capacity with server/rows.zeros (mapped
for huge pages; the OS commits a page when it is first written), so growing never copies rows.

A push validates everything and plans its evictions before it changes anything; then it sums the
gradients of duplicate keys (in float64, in arrival order: server/table_kernels.sum_repeated), admits,
makes room, and applies the table's optimizer (server/table_updates.py: SGD, Adagrad and Adam compiled,
the others through the PS's sparse kernel, server/optimizers.py) with this table's slot arrays. `t` is the table's push count, as for fixed
tables. Callers hold `lock` (the store does); checkpoints live in server/table_state.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from pscluster.server import table_kernels as kernels
from pscluster.server import table_updates as updates
from pscluster.server.hash_index import HashIndex
from pscluster.server.rows import as_run, take_rows, zeros
from pscluster.server.table_filters import initial_rows, make_filter

from pscluster.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from pscluster.specs import OptimizerConfig
from pscluster.tables import TableConfig

_EMPTY_KEYS = np.zeros(0, np.int64)
# removed keys remembered between checkpoints at most: past it the log is dropped (memory stays bounded
# however long a job goes without a save) and the next checkpoint is a full one
REMOVED_LOG_LIMIT = 1 << 24


@dataclass(frozen=True)
class TableResult:
    """What one pull, push or sweep did: the table's version after it, rows updated, occurrences
    dropped (not admitted), new rows, and every key evicted (sorted)."""

    version: int
    applied: int = 0
    dropped: int = 0
    inserted: int = 0
    evicted: np.ndarray = field(default_factory=lambda: _EMPTY_KEYS)


@dataclass(frozen=True)
class PushPlan:
    """A validated push of one table shard, decided but not applied (DynamicTable.prepare)."""

    step: int
    uniq: np.ndarray
    counts: np.ndarray
    summed: np.ndarray
    rows: np.ndarray
    missing: np.ndarray
    admitted: np.ndarray
    victims: np.ndarray


@dataclass
class TableStats:
    """Counters since the table was created (checkpointed)."""

    inserted: int = 0
    evicted: int = 0
    dropped: int = 0
    refused: int = 0


class EvictionReport:
    """Evicted keys kept until read (`drain`), at most `limit` of them: the oldest beyond it are counted
    as overflowed, so a reader always knows whether it saw every eviction."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._parts: list[np.ndarray] = []
        self._held = 0
        self.overflowed = 0

    def add(self, keys: np.ndarray) -> None:
        """Note keys as evicted (a copy is kept)."""
        if not keys.size:
            return
        self._parts.append(keys.copy())
        self._held += keys.size
        excess = self._held - self.limit
        while excess > 0:  # the oldest go first: one part at a time, cut the last one short
            first = self._parts[0]
            if first.size <= excess:
                self._parts.pop(0)
                cut = first.size
            else:
                self._parts[0] = first[excess:]
                cut = excess
            self._held -= cut
            self.overflowed += cut
            excess -= cut

    def drain(self) -> tuple[np.ndarray, int]:
        """(keys noted since the last drain, oldest first; how many more were evicted but not kept); empties."""
        keys = np.concatenate(self._parts) if self._parts else _EMPTY_KEYS
        out = (keys, self.overflowed)
        self._parts, self._held, self.overflowed = [], 0, 0
        return out


def group_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(unique sorted keys, their counts, the stable order that sorts keys, start of each run)."""
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    first = np.ones(sk.size, np.bool_)
    first[1:] = sk[1:] != sk[:-1]
    starts = np.flatnonzero(first)
    counts = np.diff(np.append(starts, sk.size))
    return sk[starts], counts, order, starts


def sum_duplicates(keys: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unique keys, their occurrence counts, their summed gradients).

    Keys that arrive unique come back as they are, with no copy of the gradients (one pass when they
    are strictly increasing, as a client's np.unique sends them; else a hash set of the keys alone).
    Otherwise the keys that occur once keep their order and their gradient rows, and the repeated keys
    follow, sorted, each with its parts summed in float64 in arrival order: exact for any arrival order
    unless a key's parts span 2**29. Random batches repeat a few keys: only those are regrouped.
    """
    ones = np.ones(keys.size, np.int64)
    if keys.size < 2 or np.logical_and.reduce(keys[:-1] < keys[1:]):
        return keys, ones, grads
    in_dup = kernels.repeated(keys)  # one compiled pass: a sort and an isin cost 230 ns a key here
    if in_dup is None:
        return keys, ones, grads
    uniq, counts, summed = kernels.sum_repeated(keys, grads.reshape(keys.size, -1), in_dup)
    return uniq, counts, summed.reshape((-1,) + grads.shape[1:])


class DynamicTable:
    """One shard's rows of a dynamic table, keyed by int64."""

    def __init__(self, cfg: TableConfig, optimizer: OptimizerConfig, name: str = "table",
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg.validate()
        self.optimizer = optimizer.validate()
        self.name = name
        self.clock = clock
        cap, dt = cfg.capacity, np.dtype(cfg.dtype)
        self.dtype = dt
        self.index = HashIndex(cap)
        self.values = zeros((cap, cfg.dim), dt)
        self.slots = {s: zeros((cap, cfg.dim), dt) for s in optimizer.slot_names()}
        self.last_step = zeros(cap, np.uint32)
        self.freq = zeros(cap if cfg.eviction.policy == "lfu" else 0, np.float32)  # LFU alone reads it
        self.touched_s = zeros(cap if cfg.eviction.policy == "seconds" else 0, np.uint32)
        self.dirty = zeros(cap, np.bool_)
        self.epoch = int(clock())
        # "seconds" eviction decides by the seconds since epoch at the start of each operation (`_start`): one
        # reading per operation, which a primary forwards with it, and a backup repeating it pins (`pinned_s`) so
        # that both copies touch and evict the same rows, whatever their own clocks say
        self.now_s = 0
        self.pinned_s: int | None = None
        self.filter = make_filter(cfg)
        self.version = 0
        self.stats = TableStats()
        self.removed_log: list[np.ndarray] | None = None  # keys removed since the last mark (None: no base)
        self.removed_logged = 0  # keys in removed_log
        self.report = EvictionReport(cfg.report_evicted)  # every evicted key, until the client reads them
        # checkpoint steps the next increment builds on, oldest (the full one) first; [] : the next save is full
        self.chain: list[int] = []
        self.lock = threading.Lock()

    @property
    def live(self) -> int:
        """Live keys."""
        return self.index.live

    # -- reads -----------------------------------------------------------------------------------
    def check_keys(self, keys: np.ndarray) -> None:
        """InvalidArgumentError unless keys is a 1-D int64 array."""
        if keys.ndim != 1 or keys.dtype != np.int64:
            raise InvalidArgumentError(
                f"{self.name}: keys must be a 1-D int64 array, got {keys.dtype}{list(keys.shape)}")

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Row ids of keys, -1 for absent ones (read only)."""
        return self.index.lookup(keys)

    def pull(self, keys: np.ndarray) -> tuple[np.ndarray, TableResult]:
        """Rows of keys (n, dim). Absent keys get a row when admission is "always" (evicting at a full
        shard, or ResourceExhaustedError with on_full="refuse"); otherwise they read their initial row."""
        self.check_keys(keys)
        self._start()
        rows, absent = self.index.find(keys)  # duplicates look up twice: cheaper than sorting every batch
        result = TableResult(self.version)
        out = np.empty((keys.size, self.cfg.dim), self.dtype)
        missing = np.flatnonzero(rows < 0) if absent else rows[:0]
        if absent and self.cfg.admission.kind == "always":
            new, where = np.unique(keys[missing], return_inverse=True)
            found = rows >= 0
            victims = self._plan_room(new.size, np.unique(rows[found]) if new.size > self.free else rows[:0])
            evicted = self._remove(victims)  # victims spare every row found above: those rows stay the keys'
            rows[missing] = self._create(new, self.version)[where]
            result = TableResult(self.version, inserted=new.size, evicted=evicted)
            missing = missing[:0]
        else:
            self.index.advance(keys.size)  # rows never move: only slots do
        # one gather of every row, after any insert (a batch of new keys is not gathered twice); absent keys
        # (-1) read row 0 here (take_rows clips) and get their initial rows below
        take_rows(self.values, rows, out)
        if missing.size:
            out[missing] = initial_rows(keys[missing], self.cfg)
        return out, result

    @property
    def free(self) -> int:
        """Rows this shard can still create without evicting."""
        return self.cfg.capacity - self.index.live

    # -- writes ----------------------------------------------------------------------------------
    def push(self, keys: np.ndarray, grads: np.ndarray) -> TableResult:
        """Sum duplicate keys' gradients, admit, make room, apply the optimizer; one version step.

        Raises:
            InvalidArgumentError: bad keys, gradient shape, dtype or a non-finite gradient (no change).
            ResourceExhaustedError: the new rows do not fit the shard (on_full="refuse", or nothing left
                to evict); nothing changed.
        """
        return self.commit(self.prepare(keys, grads))

    def prepare(self, keys: np.ndarray, grads: np.ndarray) -> PushPlan:
        """Everything a push decides before it changes anything (validation, admission, room); raises as
        push does. A store that applies several items all or nothing prepares each of them first, holding
        every lock, then commits them (the plan is valid only until the table changes)."""
        self.check_keys(keys)
        self._start()
        if grads.shape != (keys.size, self.cfg.dim) or grads.dtype != self.dtype:
            raise InvalidArgumentError(
                f"{self.name}: gradients {grads.dtype}{list(grads.shape)} for {keys.size} keys; expected "
                f"{self.dtype}{[keys.size, self.cfg.dim]}")
        if not np.logical_and.reduce(np.isfinite(grads), axis=None):
            raise InvalidArgumentError(f"{self.name}: gradient holds NaN or Inf; rejected")
        step = self.version + 1
        uniq, counts, summed = sum_duplicates(keys, grads)
        rows = self.index.lookup(uniq)
        missing = np.flatnonzero(rows < 0)
        admitted = self.filter.decide(uniq[missing], counts[missing], step)
        victims = self._plan_room(int(np.count_nonzero(admitted)), rows[rows >= 0])
        return PushPlan(step, uniq, counts, summed, rows, missing, admitted, victims)

    def check_room(self, keys: np.ndarray) -> None:
        """ResourceExhaustedError (counted as refused) unless a push of keys would fit now; changes nothing."""
        self.check_keys(keys)
        self._start()
        uniq, counts, _, _ = group_keys(keys)
        rows = self.index.lookup(uniq)
        missing = np.flatnonzero(rows < 0)
        admitted = self.filter.decide(uniq[missing], counts[missing], self.version + 1)
        self._plan_room(int(np.count_nonzero(admitted)), rows[rows >= 0])

    def commit(self, plan: PushPlan) -> TableResult:
        """Apply a prepared push (see prepare); nothing in it can fail."""
        if plan.step != self.version + 1:
            raise FailedPreconditionError(f"{self.name}: a push prepared at version {plan.step - 1} committed at "
                                          f"{self.version}")
        step, uniq, counts, rows, missing, admitted = (plan.step, plan.uniq, plan.counts, plan.rows, plan.missing,
                                                      plan.admitted)
        new = missing[admitted]
        self.filter.commit(uniq[missing], counts[missing], admitted, step)
        evicted = [self._remove(plan.victims)]
        if new.size:
            rows[new] = self._create(uniq[new], step)
        else:
            self.index.advance(uniq.size)  # rows never move: only slots do
        hit = rows >= 0
        every = bool(hit.all())
        live_rows = rows if every else rows[hit]
        updates.apply_rows(self.optimizer, self.values, live_rows, plan.summed if every else plan.summed[hit],
                           self.slots, step)
        self._touch(live_rows, counts[hit], step)
        dropped = int(counts[~hit].sum())
        self.stats.dropped += dropped
        self.version = step
        ev = self.cfg.eviction
        if ev.every_steps and step % ev.every_steps == 0:
            evicted.append(self._sweep().evicted)
        if ev.max_rows and self.live > ev.max_rows:
            evicted.append(self._remove(self._lowest(self.live - int(ev.max_rows * ev.low_water), None)))
        out = np.sort(np.concatenate(evicted))
        return TableResult(step, int(live_rows.size), dropped, int(new.size), out)

    def sweep(self) -> TableResult:
        """Evict every row the policy's threshold condemns now (the on-demand trigger; the periodic one runs in
        its push's operation)."""
        self._start()
        return self._sweep()

    def _sweep(self) -> TableResult:
        rows = self.index.live_rows()
        ev = self.cfg.eviction
        if ev.policy == "none" or not rows.size:
            return TableResult(self.version)
        if ev.policy in ("steps", "seconds"):
            idle = self._idle(rows)
            gone = rows[idle > ev.max_idle]
        else:
            gone = rows[self._score(rows) < (ev.min_frequency if ev.policy == "lfu" else ev.min_norm)]
        return TableResult(self.version, evicted=np.sort(self._remove(gone)))

    def evict_keys(self, keys: np.ndarray) -> np.ndarray:
        """Evict exactly those of keys that are live (a backup repeating its primary's on-demand sweep);
        returns them, sorted."""
        rows = self.index.lookup(np.unique(np.asarray(keys, np.int64)))
        return np.sort(self._remove(rows[rows >= 0]))

    # -- internals -------------------------------------------------------------------------------
    def _start(self) -> None:
        """An operation starts: the seconds it decides by (see __init__)."""
        self.now_s = self.pinned_s if self.pinned_s is not None else int(self.clock()) - self.epoch

    def _idle(self, rows: np.ndarray) -> np.ndarray:
        if self.cfg.eviction.policy == "seconds":
            return np.asarray(self.now_s - self.touched_s[rows].astype(np.int64))
        return np.asarray(self.version - self.last_step[rows].astype(np.int64))

    def _score(self, rows: np.ndarray) -> np.ndarray:
        """Lower leaves first: recency, decayed frequency or L2 norm by policy."""
        policy = self.cfg.eviction.policy
        if policy == "lfu":
            return self._frequency(rows)
        if policy == "l2":
            v = self.values[rows].astype(np.float64)
            return np.asarray(np.sqrt(np.einsum("ij,ij->i", v, v)))
        return -self._idle(rows).astype(np.float64)

    def _frequency(self, rows: np.ndarray) -> np.ndarray:
        idle = self.version - self.last_step[rows].astype(np.int64)
        return np.asarray(self.freq[rows].astype(np.float64) * np.power(self.cfg.eviction.decay, idle))

    def _lowest(self, n: int, keep: np.ndarray | None) -> np.ndarray:
        """The n live rows of lowest score, ties by key (so every shard layout picks the same keys)."""
        if n <= 0:
            return np.zeros(0, np.int64)
        rows = self.index.live_rows()
        if keep is not None and keep.size:
            rows = rows[~np.isin(rows, keep)]
        score = self._score(rows)
        pick = np.lexsort((self.index.row_keys[rows], score))[:n]
        return rows[pick]

    def _plan_room(self, need: int, keep: np.ndarray) -> np.ndarray:
        """Rows to evict so that `need` new rows fit, sparing `keep`; raises if they cannot fit."""
        short = need - (self.cfg.capacity - self.live)
        if short <= 0:
            return np.zeros(0, np.int64)
        spare = self.live - keep.size
        if self.cfg.on_full == "refuse" or short > spare:
            self.stats.refused += need
            why = "on_full='refuse'" if self.cfg.on_full == "refuse" else f"only {spare} rows may be evicted"
            raise ResourceExhaustedError(
                f"{self.name}: {need} new keys do not fit: {self.live} of {self.cfg.capacity} rows live "
                f"({why}); raise capacity, add PS tasks or let eviction make room")
        return self._lowest(short, keep)

    def _remove(self, rows: np.ndarray) -> np.ndarray:
        if not rows.size:
            return _EMPTY_KEYS
        keys = self.index.remove(rows)
        self.stats.evicted += rows.size
        self.report.add(keys)
        if self.removed_log is not None:
            self.removed_logged += keys.size
            if self.removed_logged > REMOVED_LOG_LIMIT:
                self.removed_log = None  # no increment can list them: the next save is full (for_checkpoint)
            else:
                self.removed_log.append(keys)
        return keys

    def _create(self, keys: np.ndarray, step: int) -> np.ndarray:
        rows = self.index.insert(keys)
        at = as_run(rows)  # fresh rows usually are one run of row ids: slices write at memset speed
        if self.cfg.initializer in ("zeros", "ones", "constant"):
            self.values[at] = {"zeros": 0.0, "ones": 1.0}.get(self.cfg.initializer, self.cfg.init_value)
        else:
            self.values[at] = initial_rows(keys, self.cfg)
        for name, slot in self.slots.items():
            slot[at] = self.optimizer.initial_accumulator_value if name == "accumulator" else 0.0
        self.last_step[rows] = step
        if self.freq.size:
            self.freq[rows] = 0.0
        if self.touched_s.size:
            self.touched_s[rows] = self.now_s
        self.dirty[rows] = True
        self.stats.inserted += rows.size
        return rows

    def _touch(self, rows: np.ndarray, counts: np.ndarray, step: int) -> None:
        if self.cfg.eviction.policy == "lfu":
            self.freq[rows] = (self._frequency(rows) + counts).astype(np.float32)
        self.last_step[rows] = step
        if self.touched_s.size:
            self.touched_s[rows] = self.now_s
        self.dirty[rows] = True
