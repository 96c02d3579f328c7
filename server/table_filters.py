"""Per-key initial rows and admission filters of dynamic tables (server/dynamic_table.py).

Initial rows are a pure function of (key, column, seed): the same key gets the same row on any shard,
in any order of arrival, after any restore. Admission filters decide in two phases, `decide` (read
only) then `commit`, so a push that is refused later (capacity) changes no filter state.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from pscluster.server.hash_index import HashIndex, mix64

from pscluster.errors import InvalidArgumentError
from pscluster.tables import Admission, TableConfig

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_TWO_PI = 2.0 * np.pi


def _unit(keys: np.ndarray, dim: int, seed: int) -> np.ndarray:
    """(n, dim) float64 in (0, 1), from the hash of (key, column, seed)."""
    base = mix64(keys, seed)[:, None]
    mixed = (base + np.arange(dim, dtype=np.uint64)[None, :] * _GOLDEN).view(np.int64)
    bits = mix64(mixed.reshape(-1), seed).reshape(keys.size, dim)
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def initial_rows(keys: np.ndarray, cfg: TableConfig) -> np.ndarray:
    """The initializer's rows for keys (n, dim), deterministic per key."""
    dt = np.dtype(cfg.dtype)
    shape = (keys.size, cfg.dim)
    kind = cfg.initializer
    if kind == "zeros":
        return np.zeros(shape, dt)
    if kind == "ones":
        return np.ones(shape, dt)
    if kind == "constant":
        return np.full(shape, cfg.init_value, dt)
    u = _unit(keys, cfg.dim, cfg.seed)
    if kind == "uniform":
        return ((2.0 * u - 1.0) * cfg.init_value).astype(dt)
    # Box-Muller from a second, independent stream
    v = _unit(keys, cfg.dim, cfg.seed + 0x5EED)
    return np.asarray(np.sqrt(-2.0 * np.log(u)) * np.cos(_TWO_PI * v) * cfg.init_value, dtype=dt)


class AdmissionFilter(Protocol):
    """Which absent keys get a row now, and the counting behind it."""

    def decide(self, keys: np.ndarray, counts: np.ndarray, step: int) -> np.ndarray:
        """Boolean mask: would keys (unique, absent) with these occurrence counts be admitted now."""

    def commit(self, keys: np.ndarray, counts: np.ndarray, admitted: np.ndarray, step: int) -> None:
        """Record the occurrences of a push that `decide` judged (same arguments and its answer)."""

    def state(self) -> dict[str, np.ndarray]:
        """Arrays that restore this filter exactly (checkpoints)."""

    def load(self, state: dict[str, np.ndarray]) -> None:
        """Restore from `state` (merged across shards by the caller where needed)."""


class AlwaysAdmit:
    """Every key is admitted on first touch."""

    def decide(self, keys: np.ndarray, counts: np.ndarray, step: int) -> np.ndarray:
        """All True."""
        return np.ones(keys.size, np.bool_)

    def commit(self, keys: np.ndarray, counts: np.ndarray, admitted: np.ndarray, step: int) -> None:
        """Nothing to count."""

    def state(self) -> dict[str, np.ndarray]:
        """No state."""
        return {}

    def load(self, state: dict[str, np.ndarray]) -> None:
        """No state."""


class CounterAdmit:
    """Exact occurrence counts of candidate keys; a key is admitted once its count reaches min_count.

    Candidates live in their own hash index (bounded by pending_capacity): when it is full, the
    candidates seen least recently are forgotten (counted in `forgotten`), never the table's rows.
    """

    def __init__(self, cfg: Admission, capacity: int) -> None:
        self.min_count = cfg.min_count
        self.index = HashIndex(cfg.pending_capacity or capacity)
        self.count = np.zeros(self.index.capacity, np.int64)
        self.seen = np.zeros(self.index.capacity, np.int64)
        self.forgotten = 0

    def decide(self, keys: np.ndarray, counts: np.ndarray, step: int) -> np.ndarray:
        """count so far + this push's occurrences >= min_count."""
        rows = self.index.lookup(keys)
        have = np.where(rows >= 0, self.count[np.maximum(rows, 0)], 0)
        return np.asarray(have + counts >= self.min_count)

    def commit(self, keys: np.ndarray, counts: np.ndarray, admitted: np.ndarray, step: int) -> None:
        """Add occurrences of keys still waiting; forget the admitted ones."""
        rows = self.index.lookup(keys)
        done = admitted & (rows >= 0)
        if done.any():
            self.index.remove(rows[done])
        wait = ~admitted
        old = wait & (rows >= 0)
        self.count[rows[old]] += counts[old]
        self.seen[rows[old]] = step
        new = wait & (rows < 0)
        fresh, n = keys[new], int(np.count_nonzero(new))
        room = self.index.capacity - self.index.live
        if n > room:
            live = self.index.live_rows()
            oldest = live[np.argsort(self.seen[live], kind="stable")[:n - room]]
            self.index.remove(oldest)
            self.forgotten += oldest.size
            if n > self.index.capacity:
                fresh, n = fresh[:self.index.capacity], self.index.capacity
                self.forgotten += int(np.count_nonzero(new)) - n
        placed = self.index.insert(fresh)
        self.count[placed] = counts[new][:n]
        self.seen[placed] = step

    def state(self) -> dict[str, np.ndarray]:
        """Candidate keys with their counts and last-seen steps, sorted by key."""
        rows = self.index.live_rows()
        keys = self.index.row_keys[rows]
        order = np.argsort(keys, kind="stable")
        rows = rows[order]
        return {"pending_keys": keys[order], "pending_count": self.count[rows],
                "pending_seen": self.seen[rows], "pending_forgotten": np.array([self.forgotten], np.int64)}

    def load(self, state: dict[str, np.ndarray]) -> None:
        """Replace candidates with the saved ones."""
        self.index.clear()
        keys = state["pending_keys"]
        if keys.size > self.index.capacity:
            raise InvalidArgumentError(
                f"{keys.size} saved admission candidates exceed pending capacity {self.index.capacity}")
        rows = self.index.insert(keys)
        self.count[rows] = state["pending_count"]
        self.seen[rows] = state["pending_seen"]
        self.forgotten = int(state["pending_forgotten"].sum())


class SketchAdmit:
    """A count-min sketch (depth x width uint32 counters): bounded memory, counts never under-estimated."""

    def __init__(self, cfg: Admission) -> None:
        self.min_count = cfg.min_count
        self.width = cfg.cms_width
        self.table = np.zeros((cfg.cms_depth, cfg.cms_width), np.uint32)

    def _cells(self, keys: np.ndarray) -> np.ndarray:
        return np.stack([(mix64(keys, 1000 + d) % np.uint64(self.width)).astype(np.int64)
                         for d in range(self.table.shape[0])])

    def decide(self, keys: np.ndarray, counts: np.ndarray, step: int) -> np.ndarray:
        """min over the rows of the sketch + this push's occurrences >= min_count."""
        cells = self._cells(keys)
        est = np.take_along_axis(self.table, cells, axis=1).min(axis=0).astype(np.int64)
        return np.asarray(est + counts >= self.min_count)

    def commit(self, keys: np.ndarray, counts: np.ndarray, admitted: np.ndarray, step: int) -> None:
        """Count every occurrence (admitted or not: a sketch cannot forget one key)."""
        for d, cells in enumerate(self._cells(keys)):
            add = np.bincount(cells, weights=counts, minlength=self.width)
            row = self.table[d].astype(np.int64) + add.astype(np.int64)
            self.table[d] = np.minimum(row, np.iinfo(np.uint32).max)

    def state(self) -> dict[str, np.ndarray]:
        """The sketch."""
        return {"sketch": self.table.copy()}

    def load(self, state: dict[str, np.ndarray]) -> None:
        """The saved sketch (shards' sketches summed by the caller when the shard count changes), or the same
        flat (a catch-up sends it in pieces: table_state.filter_pieces)."""
        sketch = state["sketch"]
        if sketch.ndim == 1 and sketch.size == self.table.size:
            sketch = sketch.reshape(self.table.shape)
        if sketch.shape != self.table.shape:
            raise InvalidArgumentError(
                f"saved sketch of shape {sketch.shape} does not match this table's {self.table.shape}")
        self.table[:] = sketch


class ChanceAdmit:
    """Admits a key with probability p per push that carries it, drawn from hash(key, step, seed)."""

    def __init__(self, cfg: Admission, seed: int) -> None:
        self.threshold = np.uint64(min(int(cfg.probability * 2.0**64), 2**64 - 1))
        self.always = cfg.probability >= 1.0
        self.seed = seed

    def decide(self, keys: np.ndarray, counts: np.ndarray, step: int) -> np.ndarray:
        """hash(key, step) < p * 2**64."""
        if self.always:
            return np.ones(keys.size, np.bool_)
        return mix64(mix64(keys, self.seed).view(np.int64) ^ np.int64(step)) < self.threshold

    def commit(self, keys: np.ndarray, counts: np.ndarray, admitted: np.ndarray, step: int) -> None:
        """Stateless."""

    def state(self) -> dict[str, np.ndarray]:
        """Stateless."""
        return {}

    def load(self, state: dict[str, np.ndarray]) -> None:
        """Stateless."""


def make_filter(cfg: TableConfig) -> AdmissionFilter:
    """The admission filter a table's config asks for."""
    a = cfg.admission
    if a.kind == "counter":
        return CounterAdmit(a, cfg.capacity)
    if a.kind == "cms":
        return SketchAdmit(a)
    if a.kind == "probability":
        return ChanceAdmit(a, cfg.seed)
    return AlwaysAdmit()
