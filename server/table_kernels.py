"""Typed entry points to the compiled loops: the hash index's (table_jit.py) and the row updates (update_jit.py).

numba is imported on the first call, not with this module: every PS process imports the store, which
imports the dynamic tables, and importing numba costs about 0.8 s of CPU here, which only a process
that holds a dynamic table should pay. Compiled code is cached on disk (`cache=True`): a later process
loads it instead of compiling it again.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np

from pscluster.errors import FailedPreconditionError

_jit: ModuleType | None = None
_upd: ModuleType | None = None
_warm = False


def load() -> None:
    """Import the compiled kernels and run each once on a few keys, so that a table's first pull pays none
    of it: numba's import and the load of the cached code (about 1 s in a fresh process here), or, in a
    checkout with no cache yet, their compile (seconds)."""
    global _warm
    if _warm:
        return
    keys = np.arange(4, dtype=np.int64)
    slots, old = np.zeros(64, np.int32), np.zeros(64, np.int32)
    row_keys = np.zeros(8, np.int64)
    row_keys[:4] = keys
    place(slots, keys, keys, 4, 7)
    lookup(slots, old, row_keys, keys, 4, 7)
    move(slots, 0, 64, old, row_keys, 4)
    erase(old, row_keys, keys[:1], 4, 7)
    twice = np.concatenate([keys, keys])
    for dtype in (np.float32, np.float64):  # the dtypes a dynamic table has
        sum_repeated(twice, np.zeros((8, 2), dtype), np.ones(8, np.bool_))
    repeated(twice)
    for dtype in (np.float32, np.float64):
        one, zero = dtype(1), dtype(0)
        row = np.zeros((4, 2), dtype)
        grads = np.ones((2, 2), dtype)
        prep = {"scale": one, "clip": zero, "wd": zero, "decay": one}
        sgd_rows(row, keys[:2], grads, lr=one, **prep)
        for flag in (False, True):
            adagrad_rows(row, np.ones((4, 2), dtype), keys[:2], grads, lr=one, eps=one, eps_in_sqrt=flag, **prep)
            adam_rows(row, row.copy(), row.copy(), row.copy(), keys[:2], grads, one_b1=one, b2=one, one_b2=one,
                      amsgrad=flag, eps=one, epsilon_hat=flag, sqrt_bc2=one, step_size=one, **prep)
    group_by_shard(keys, 2)
    _warm = True


def _kernels() -> ModuleType:
    global _jit
    if _jit is None:
        try:
            _jit = importlib.import_module("pscluster.server.table_jit")
        except (ImportError, RuntimeError) as exc:  # numba missing, or no cache folder it may write to
            raise FailedPreconditionError(
                f"dynamic tables need numba>=0.68 (pip install 'numba>=0.68') and a cache folder it can write "
                f"(beside pscluster/server/table_jit.py, or set NUMBA_CACHE_DIR): {exc}") from exc
    return _jit


def _updates() -> ModuleType:
    global _upd
    if _upd is None:
        _kernels()  # numba present and a cache folder it may write (a precise error otherwise)
        _upd = importlib.import_module("pscluster.server.update_jit")
    return _upd


def _plain(a: np.ndarray) -> np.ndarray:
    """a as a C-contiguous, aligned, writable array (a itself when it is one). numba compiles one version
    per kind of array: a read-only one (keys and gradients read from a request's buffer are) or an
    unaligned one would be compiled anew inside that request (seconds), so they are copied instead."""
    a = np.ascontiguousarray(a)
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    return a if a.flags.writeable and a.flags.aligned else a.copy()


def _int64(a: np.ndarray) -> np.ndarray:
    """a as a plain int64 array (see _plain)."""
    return _plain(np.asarray(a, np.int64))


def lookup(slots: np.ndarray, old: np.ndarray, row_keys: np.ndarray, keys: np.ndarray, row_bits: int,
           tag_mask: int) -> np.ndarray:
    """Row id of each key (int64, -1 absent), searched in `slots`, then in `old` (size 0: none)."""
    return find(slots, old, row_keys, keys, row_bits, tag_mask)[0]


def find(slots: np.ndarray, old: np.ndarray, row_keys: np.ndarray, keys: np.ndarray, row_bits: int,
         tag_mask: int) -> tuple[np.ndarray, int]:
    """(lookup's row ids, how many keys are absent)."""
    out = np.empty(keys.size, np.int64)
    absent = _kernels().lookup(slots, old, row_keys, _int64(keys), row_bits, tag_mask, out)
    return out, int(absent)


def erase(slots: np.ndarray, row_keys: np.ndarray, keys: np.ndarray, row_bits: int, tag_mask: int) -> int:
    """Turn the slots of the keys found in `slots` into tombstones; how many were found."""
    return int(_kernels().erase(slots, row_keys, _int64(keys), row_bits, tag_mask))


def place(slots: np.ndarray, keys: np.ndarray, rows: np.ndarray, row_bits: int, tag_mask: int) -> int:
    """Put absent keys' rows (int64) into the first free slots of their chains; tombstones reused."""
    return int(_kernels().place(slots, _int64(keys), _int64(rows), row_bits, tag_mask)[0])


def move(old: np.ndarray, start: int, end: int, slots: np.ndarray, row_keys: np.ndarray, row_bits: int) -> int:
    """Move the live entries of old[start:end] into `slots` (tombstones left behind); tombstones reused."""
    return int(_kernels().move(old, start, end, slots, row_keys, row_bits)[0])


def mix(key: int) -> int:
    """The compiled hash of one int64 key (pscluster.tables.mix64's value, as a Python int)."""
    return int(_kernels().mix(np.int64(key)))


def group_by_shard(keys: np.ndarray, num_shards: int) -> list[np.ndarray]:
    """For each of num_shards shards, the positions (ascending) of the keys that pscluster.tables.shard_of
    places on it: one compiled pass instead of the hash's numpy temporaries and a scan per shard."""
    order = np.empty(keys.size, np.int64)
    starts = np.empty(num_shards + 1, np.int64)
    _kernels().group_by_shard(_int64(keys), num_shards, order, starts)
    return [order[starts[i]:starts[i + 1]] for i in range(num_shards)]


def repeated(keys: np.ndarray) -> np.ndarray | None:
    """Whether each key occurs more than once in keys (bool array); None when every key is unique."""
    out = np.empty(keys.size, np.bool_)
    return out if _kernels().repeated(_int64(keys), out) else None


def sum_repeated(keys: np.ndarray, grads: np.ndarray, in_dup: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys, counts, gradient rows): the keys not in_dup in order, then each in_dup key once, ascending,
    its rows summed in float64 in arrival order and cast back (grads: 2-D float32 or float64)."""
    k, c, g = _kernels().sum_repeated(_int64(keys), _plain(grads), in_dup)
    return k, c, g


def sgd_rows(values: np.ndarray, rows: np.ndarray, grads: np.ndarray, *, lr: np.floating, scale: np.floating,
             clip: np.floating, wd: np.floating, decay: np.floating) -> None:
    """SGD on values[rows] (unique row ids) in place, in one pass (server/update_jit.sgd_rows); the scalars in
    values' dtype, clip and wd 0 for none, decay 1 for none (scale, clip, wd, decay: every row kernel's
    gradient preparation, as server/optimizers._update does it)."""
    _updates().sgd_rows(values, _int64(rows), _plain(grads), lr, scale, clip, wd, decay)


def adagrad_rows(values: np.ndarray, acc: np.ndarray, rows: np.ndarray, grads: np.ndarray, *, lr: np.floating,
                 eps: np.floating, eps_in_sqrt: bool, scale: np.floating, clip: np.floating, wd: np.floating,
                 decay: np.floating) -> None:
    """Adagrad on values[rows] (unique row ids) and their accumulator rows, in place, in one pass (see
    server/update_jit.adagrad_rows); the scalars as for sgd_rows."""
    _updates().adagrad_rows(values, acc, _int64(rows), _plain(grads), lr, eps, eps_in_sqrt, scale, clip, wd, decay)


def adam_rows(values: np.ndarray, m: np.ndarray, v: np.ndarray, v_max: np.ndarray, rows: np.ndarray,
              grads: np.ndarray, *, one_b1: np.floating, b2: np.floating, one_b2: np.floating, amsgrad: bool,
              eps: np.floating, epsilon_hat: bool, sqrt_bc2: np.floating, step_size: np.floating,
              scale: np.floating, clip: np.floating, wd: np.floating, decay: np.floating) -> None:
    """Adam (and AMSGrad: v_max read only then) on values[rows] and their moment rows, in place, in one pass
    (server/update_jit.adam_rows); the scalars as for sgd_rows."""
    _updates().adam_rows(values, m, v, v_max, _int64(rows), _plain(grads), one_b1, b2, one_b2, amsgrad, eps,
                         epsilon_hat, sqrt_bc2, step_size, scale, clip, wd, decay)
