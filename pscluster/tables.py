"""Settings of hash-keyed dynamic tables: admission, eviction, capacity (validated, frozen).

A dynamic table is a sparse variable of shape `(None, dim)` keyed by any int64; these say when a new
key gets a row, when a row leaves, and what happens at the hard capacity of a shard:

    TableConfig(dim=16, capacity=1 << 20,
                admission=Admission("counter", min_count=3),
                eviction=Eviction("steps", max_idle=10_000, every_steps=1_000))

Occurrences are counted in pushes (where training happens), not pulls: an evaluation that only pulls
never admits a key. Until admitted, a key reads its initializer's row and its gradients are dropped
(counted in the table's stats). Eviction reports every key it removes; at capacity, inserts either evict
by the policy's score (`on_full="evict"`) or are refused with ResourceExhaustedError (`"refuse"`).
Every evicted key is kept in a bounded report per shard (`report_evicted` keys) until the client's
`evicted_keys(table)` reads it; keys beyond the bound are counted as overflowed, never dropped silently.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from pscluster.errors import InvalidArgumentError

ADMISSIONS = ("always", "counter", "cms", "probability")
EVICTIONS = ("none", "steps", "seconds", "lfu", "l2")
INITIALIZERS = ("zeros", "ones", "constant", "uniform", "normal")

_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)


def mix64(keys: np.ndarray, seed: int = 0) -> np.ndarray:
    """splitmix64's finalizer of int64 keys (as uint64): stable across processes and platforms."""
    z = keys.astype(np.int64, copy=False).view(np.uint64) + np.uint64((0x9E3779B97F4A7C15 * (seed + 1)) % (1 << 64))
    z ^= z >> np.uint64(30)
    z *= _C1
    z ^= z >> np.uint64(27)
    z *= _C2
    z ^= z >> np.uint64(31)
    return z


def shard_of(keys: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard of each key: the high 32 bits of its hash, scaled to [0, num_shards).

    High bits, because the index probes from the low ones: a shard's keys would otherwise share their
    low bits and fill every other slot.
    """
    high = mix64(keys) >> np.uint64(32)
    return ((high * np.uint64(num_shards)) >> np.uint64(32)).astype(np.int64)


@dataclass(frozen=True)
class Admission:
    """When a new key gets a row: always, after min_count occurrences (exact, or by a count-min
    sketch of depth x width counters), or with `probability` per push that carries it."""

    kind: str = "always"
    min_count: int = 1
    probability: float = 1.0
    cms_width: int = 1 << 20
    cms_depth: int = 4
    pending_capacity: int = 0  # exact counter: candidates it remembers (0: the table's capacity)

    def validate(self) -> Admission:
        """Self, or InvalidArgumentError naming the bad field."""
        if self.kind not in ADMISSIONS:
            raise InvalidArgumentError(f"admission kind {self.kind!r} unknown; use one of {', '.join(ADMISSIONS)}")
        if self.min_count < 1:
            raise InvalidArgumentError(f"admission min_count must be >= 1, got {self.min_count}")
        if not 0.0 < self.probability <= 1.0:
            raise InvalidArgumentError(f"admission probability must be in (0, 1], got {self.probability}")
        if not (1 <= self.cms_depth <= 16 and 16 <= self.cms_width <= 1 << 30):
            raise InvalidArgumentError(
                f"count-min sketch depth {self.cms_depth} (1..16) x width {self.cms_width} (16..2**30) out of range")
        if self.pending_capacity < 0:
            raise InvalidArgumentError(f"admission pending_capacity must be >= 0, got {self.pending_capacity}")
        return self


@dataclass(frozen=True)
class Eviction:
    """Which rows leave and when.

    policy: "steps" / "seconds": rows untouched for more than `max_idle` pushes (seconds) leave; "lfu":
    rows whose frequency (occurrences, decayed by `decay` per push) is below `min_frequency`; "l2": rows
    whose L2 norm is below `min_norm`. Triggers: a sweep every `every_steps` pushes, when live rows pass
    `max_rows` (evicting the lowest scores down to `low_water` x max_rows), and `client.evict(table)` on demand.
    The same score orders the victims of a full shard (the least recently touched first under "none").
    """

    policy: str = "none"
    max_idle: float = 0.0
    decay: float = 1.0
    min_frequency: float = 0.0
    min_norm: float = 0.0
    every_steps: int = 0
    max_rows: int = 0
    low_water: float = 0.9

    def validate(self) -> Eviction:
        """Self, or InvalidArgumentError naming the bad field."""
        if self.policy not in EVICTIONS:
            raise InvalidArgumentError(f"eviction policy {self.policy!r} unknown; use one of {', '.join(EVICTIONS)}")
        if not (math.isfinite(self.max_idle) and self.max_idle >= 0):
            raise InvalidArgumentError(f"eviction max_idle must be finite and >= 0, got {self.max_idle}")
        if not 0.0 < self.decay <= 1.0:
            raise InvalidArgumentError(f"eviction decay must be in (0, 1], got {self.decay}")
        if self.min_frequency < 0 or self.min_norm < 0:
            raise InvalidArgumentError("eviction min_frequency and min_norm must be >= 0")
        if self.every_steps < 0 or self.max_rows < 0:
            raise InvalidArgumentError(
                f"eviction every_steps ({self.every_steps}) and max_rows ({self.max_rows}) must be >= 0")
        if not 0.0 < self.low_water <= 1.0:
            raise InvalidArgumentError(f"eviction low_water must be in (0, 1], got {self.low_water}")
        return self


@dataclass(frozen=True)
class TableConfig:
    """A dynamic table's row width, dtype, per-shard capacity, initializer and policies."""

    dim: int
    dtype: str = "float32"
    capacity: int = 1 << 22
    on_full: str = "evict"
    initializer: str = "zeros"
    init_value: float = 0.0
    seed: int = 0
    admission: Admission = field(default_factory=Admission)
    eviction: Eviction = field(default_factory=Eviction)
    report_evicted: int = 1 << 16  # evicted keys a shard keeps until `evicted_keys()` reads them
    increments: int = 0  # checkpoints written as increments (rows changed since the last save) between full ones

    def validate(self) -> TableConfig:
        """Self, or InvalidArgumentError naming the bad field."""
        if not 1 <= self.dim <= 1 << 20:
            raise InvalidArgumentError(f"dynamic table dim must be in [1, 2**20], got {self.dim}")
        if self.dtype not in ("float32", "float64"):
            raise InvalidArgumentError(f"dynamic table dtype must be float32 or float64, got {self.dtype!r}")
        if not 1 <= self.capacity < 2**31 - 1:
            raise InvalidArgumentError(f"dynamic table capacity must be in [1, 2**31 - 1), got {self.capacity}")
        if self.on_full not in ("evict", "refuse"):
            raise InvalidArgumentError(f"on_full must be 'evict' or 'refuse', got {self.on_full!r}")
        if self.initializer not in INITIALIZERS:
            raise InvalidArgumentError(
                f"initializer {self.initializer!r} unknown; use one of {', '.join(INITIALIZERS)}")
        if not 0 <= self.increments <= 1000:
            raise InvalidArgumentError(f"increments must be in [0, 1000], got {self.increments}")
        if not 0 <= self.report_evicted <= 1 << 26:
            raise InvalidArgumentError(f"report_evicted must be in [0, 2**26], got {self.report_evicted}")
        if not math.isfinite(self.init_value):
            raise InvalidArgumentError(f"init_value must be finite, got {self.init_value}")
        self.admission.validate()
        self.eviction.validate()
        return self

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): what a shard spec carries, equal for equal configs."""
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> TableConfig:
        """The validated config from to_json's text, or InvalidArgumentError naming what is wrong."""
        try:
            raw: dict[str, Any] = json.loads(text)
            raw["admission"] = Admission(**raw.get("admission", {}))
            raw["eviction"] = Eviction(**raw.get("eviction", {}))
            return TableConfig(**raw).validate()
        except (TypeError, ValueError, AttributeError) as exc:
            raise InvalidArgumentError(f"dynamic table config {text[:200]!r} does not parse: {exc}") from exc


def dynamic_config(name: str, shape: Any, dtype: np.dtype, table: TableConfig | None, initializer: str = "zeros",
                   init_scale: float = 0.0, seed: int = 0) -> TableConfig:
    """The validated TableConfig of `create_variable(name, shape=(None, dim), sparse=True, table=...)`:
    dim and dtype from the call; its initializer arguments win over the table's when not "zeros"."""
    dim = shape[1] if len(shape) == 2 else None
    if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool):
        raise InvalidArgumentError(f"{name}: a dynamic table's shape is (None, dim) with an int dim, got {tuple(shape)}")
    if table is not None and table.dim != dim:
        raise InvalidArgumentError(f"{name}: shape {tuple(shape)} has dim {dim} but its TableConfig has dim={table.dim}")
    cfg = replace(table or TableConfig(dim=int(dim)), dim=int(dim), dtype=np.dtype(dtype).name)
    if initializer != "zeros":
        cfg = replace(cfg, initializer=initializer, init_value=init_scale, seed=seed)
    return cfg.validate()


def write_export(keys: np.ndarray, values: np.ndarray, directory: pathlib.Path, name: str,
                 float16: bool = False) -> tuple[pathlib.Path, pathlib.Path]:
    """Write NAME.keys (int64, sorted by the caller) and NAME.values (rows in that order) as .npy files, each
    to a temporary name first (a reader never sees half a file)."""
    keys_path, values_path = directory / f"{name}.keys", directory / f"{name}.values"
    for path, arr in ((keys_path, keys.astype("<i8")), (values_path, values.astype("<f2" if float16 else values.dtype))):
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.save(f, arr)
        tmp.replace(path)
    return keys_path, values_path
