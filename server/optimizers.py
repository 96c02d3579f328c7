"""Optimizers applied on the PS, next to the shard; slot variables live beside it.

Dense updates run over blocks of rows so that a 1 GB shard never needs a 1 GB temporary. Sparse
updates touch only the given (unique, summed) rows, as TF's sparse apply ops; Adam's sparse variant
is the "lazy" one (moments of untouched rows do not decay).

The step `t` (Adam's bias correction) counts updates of the whole *variable*, as PyTorch's
SparseAdam counts `step` per parameter and TF's optimizers count `iterations` per apply, never per
shard or per row: every push reaches every shard of its variable (a row push sends an empty part to
shards without rows, which still counts), so the shard's version is the variable's step count and a
variable's values are the same for 1 or P shards. The version is checkpointed with the shard, so
restore (into any number of PS tasks) continues the same count.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from pscluster.specs import OptimizerConfig as OptimizerConfig  # the PS applies what the spec says

BLOCK_BYTES = 8 << 20


def init_slots(cfg: OptimizerConfig, shape: tuple[int, ...], dtype: np.dtype) -> dict[str, np.ndarray]:
    """Fresh slot variables for one shard."""
    slots = {name: np.zeros(shape, dtype=dtype) for name in cfg.slot_names()}
    if cfg.kind == "adagrad":
        slots["accumulator"].fill(cfg.initial_accumulator_value)
    return slots


def _blocks(rows: int, row_bytes: int) -> Iterator[slice]:
    step = max(1, BLOCK_BYTES // max(row_bytes, 1))
    for start in range(0, max(rows, 1), step):
        yield slice(start, min(rows, start + step) if rows else None)


def _update(cfg: OptimizerConfig, w: np.ndarray, g: np.ndarray, slots: dict[str, np.ndarray], t: int) -> None:
    """One update of w (a view) in place; slots are views of the same rows. t counts from 1."""
    lr = cfg.learning_rate
    if not np.issubdtype(w.dtype, np.floating):
        # Integer variables take SGD steps rounded toward zero (counters, step variables).
        np.subtract(w, (lr * g.astype(np.float64)).astype(w.dtype), out=w, casting="unsafe")
        return
    if cfg.kind == "sgd":
        w -= w.dtype.type(lr) * g
    elif cfg.kind == "momentum":
        a = slots["momentum"]
        a *= w.dtype.type(cfg.momentum)
        a += g
        if cfg.nesterov:
            w -= w.dtype.type(lr) * (g + w.dtype.type(cfg.momentum) * a)
        else:
            w -= w.dtype.type(lr) * a
    elif cfg.kind == "adagrad":
        acc = slots["accumulator"]
        acc += g * g
        w -= w.dtype.type(lr) * g / (np.sqrt(acc) + w.dtype.type(cfg.epsilon))
    else:  # adam
        m, v = slots["m"], slots["v"]
        b1, b2 = cfg.beta1, cfg.beta2
        m *= w.dtype.type(b1)
        m += w.dtype.type(1 - b1) * g
        v *= w.dtype.type(b2)
        v += w.dtype.type(1 - b2) * (g * g)
        lr_t = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        w -= w.dtype.type(lr_t) * m / (np.sqrt(v) + w.dtype.type(cfg.epsilon))


def apply_dense(cfg: OptimizerConfig, value: np.ndarray, grad: np.ndarray,
                slots: dict[str, np.ndarray], t: int) -> None:
    """Apply a dense gradient to value in place; t is the update's 1-based count on this shard."""
    if cfg.kind == "sgd" and value.dtype.kind == "f" and value.nbytes <= BLOCK_BYTES:
        # the common small case in one ufunc call, without the block loop (a W2 push: 3 shards per request)
        np.subtract(value, value.dtype.type(cfg.learning_rate) * grad, out=value)
        return
    if value.ndim == 0:
        v = value.reshape(1)
        _update(cfg, v, grad.reshape(1), {k: s.reshape(1) for k, s in slots.items()}, t)
        return
    row_bytes = value.itemsize * (value.size // max(value.shape[0], 1))
    for rows in _blocks(value.shape[0], row_bytes):
        _update(cfg, value[rows], grad[rows], {k: s[rows] for k, s in slots.items()}, t)


def apply_sparse(cfg: OptimizerConfig, value: np.ndarray, rows: np.ndarray, grad_rows: np.ndarray,
                 slots: dict[str, np.ndarray], t: int) -> None:
    """Apply gradients of the given local rows; duplicate ids are summed first, as TF does."""
    unique, inverse = np.unique(rows, return_inverse=True)
    summed = np.zeros((unique.size,) + grad_rows.shape[1:], dtype=value.dtype)
    np.add.at(summed, inverse, grad_rows)
    apply_rows(cfg, value, unique, summed, slots, t)


def apply_rows(cfg: OptimizerConfig, value: np.ndarray, unique: np.ndarray, summed: np.ndarray,
               slots: dict[str, np.ndarray], t: int) -> None:
    """Apply one gradient per row to rows `unique` (no repeats: a caller that sums duplicates itself)."""
    w = value[unique]
    sub = {k: s[unique] for k, s in slots.items()}
    _update(cfg, w, summed, sub, t)
    value[unique] = w
    for k, s in slots.items():
        s[unique] = sub[k]
