"""Optimizers applied on the PS, next to the shard; slot variables live beside it.

Dense updates run over blocks of rows so that a 1 GB shard never needs a 1 GB temporary. Sparse
updates touch only the given (unique, summed) rows, as TF's sparse apply ops: every optimizer's
sparse variant is the "lazy" one (TF's LazyAdam, torch's SparseAdam): slots of untouched rows do not
decay, weight decay reaches only touched rows, and a momentum buffer starts at (1 - dampening) * g on
a row's first touch after the variable's first update.

Per update, in order: the rate of update t comes from the schedule (`cfg.lr_at(t)`), its momentum or
beta1 from the momentum schedule when there is one (`cfg.at(t)`); the gradient is
clipped by norm then by value (Keras's order); coupled weight decay adds wd * w to it (torch's
`weight_decay`) or decoupled decay scales w by 1 - lr * wd (AdamW, Lion, Keras); then the kernel
(server/optimizer_kernels.py).

The step `t` (Adam's bias correction, the schedule) counts updates of the whole *variable*, as
PyTorch's SparseAdam counts `step` per parameter and TF's optimizers count `iterations` per apply,
never per shard or per row: every push reaches every shard of its variable (a row push sends an
empty part to shards without rows, which still counts), so the shard's version is the variable's step
count and a variable's values are the same for 1 or P shards. The version is checkpointed with the
shard, so restore (into any number of PS tasks) continues the same count and the same schedule.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
from pscluster.server.optimizer_kernels import KERNELS, scratch
from pscluster.server.rows import put_rows, take_rows, unique_sum

from pscluster.optimizer_config import OptimizerConfig as OptimizerConfig  # the PS applies what the spec says

BLOCK_BYTES = 8 << 20


def init_slots(cfg: OptimizerConfig, shape: tuple[int, ...], dtype: np.dtype,
               resident: bool = False) -> dict[str, np.ndarray]:
    """Fresh slot variables for one shard; resident: every page written now (sparse tables)."""
    # A sparse table's rows are hit at random, so lazily mapped zero pages make its first pushes fault
    # in the whole slot arrays: Adam's first push of 4,096 rows on a 5 M x 64 shard took 3.9-5.8 s here
    # (its later pushes 20-50 ms), long enough to miss an RPC deadline. Written at creation instead,
    # the time lands where it is expected and a lack of memory shows at once.
    slots = {name: (np.empty if resident else np.zeros)(shape, dtype=dtype) for name in cfg.slot_names()}
    for name, slot in slots.items():
        if cfg.kind in ("adagrad", "ftrl") and name == "accumulator":
            slot.fill(cfg.initial_accumulator_value)
        elif resident:
            slot.fill(0)
    return slots


def _blocks(rows: int, row_bytes: int) -> Iterator[slice]:
    step = max(1, BLOCK_BYTES // max(row_bytes, 1))
    for start in range(0, max(rows, 1), step):
        yield slice(start, min(rows, start + step) if rows else None)


def clip_scale(cfg: OptimizerConfig, g: np.ndarray) -> float:
    """Keras's clipnorm factor clip_norm / max(||g||, clip_norm) over the whole gradient (1.0: no change)."""
    if not cfg.clip_norm or g.dtype.kind != "f":
        return 1.0
    flat = g.reshape(-1)
    norm = math.sqrt(float(np.dot(flat, flat)))
    return 1.0 if norm <= cfg.clip_norm else cfg.clip_norm / norm


def _update(cfg: OptimizerConfig, w: np.ndarray, g: np.ndarray, slots: dict[str, np.ndarray], t: int,
            lr: float, scale: float = 1.0) -> None:
    """One update of w (a view) in place; slots are views of the same rows. t counts from 1."""
    if not np.issubdtype(w.dtype, np.floating):
        # Integer variables take SGD steps rounded toward zero (counters, step variables).
        np.subtract(w, (lr * g.astype(np.float64)).astype(w.dtype), out=w, casting="unsafe")
        return
    if scale != 1.0 or cfg.clip_value or (cfg.weight_decay and not cfg.decoupled_weight_decay):
        g = _prepared(cfg, w, g, scale)
    if cfg.weight_decay and cfg.decoupled_weight_decay:
        w *= w.dtype.type(1 - lr * cfg.weight_decay)
    KERNELS[cfg.kind](cfg, w, g, slots, t, lr)


def _prepared(cfg: OptimizerConfig, w: np.ndarray, g: np.ndarray, scale: float) -> np.ndarray:
    """g scaled (clipnorm), clipped by value and with coupled weight decay, in one reused scratch block
    (the caller's g is never written): g * scale, clip, + wd * w, in that order."""
    dt = w.dtype.type
    out = scratch(w, 6)
    if scale != 1.0:
        g = np.multiply(g, dt(scale), out=out)
    if cfg.clip_value:
        g = np.clip(g, dt(-cfg.clip_value), dt(cfg.clip_value), out=out)
    if cfg.weight_decay and not cfg.decoupled_weight_decay:
        g = np.add(g, np.multiply(w, dt(cfg.weight_decay), out=scratch(w, 7)), out=out)
    return g


def _plain(cfg: OptimizerConfig) -> bool:
    """Plain SGD: no slots, no decay, no clipping (the one-ufunc fast path)."""
    return cfg.kind == "sgd" and not (cfg.weight_decay or cfg.clip_value or cfg.clip_norm)


def apply_dense(cfg: OptimizerConfig, value: np.ndarray, grad: np.ndarray,
                slots: dict[str, np.ndarray], t: int) -> None:
    """Apply a dense gradient to value in place; t is the update's 1-based count of the variable."""
    lr, cfg = cfg.lr_at(t), cfg.at(t)
    if _plain(cfg) and value.dtype.kind == "f" and value.nbytes <= BLOCK_BYTES:
        # the common small case in one ufunc call, without the block loop (a W2 push: 3 shards per request)
        np.subtract(value, value.dtype.type(lr) * grad, out=value)
        return
    scale = clip_scale(cfg, grad)
    if value.ndim == 0:
        v = value.reshape(1)
        _update(cfg, v, grad.reshape(1), {k: s.reshape(1) for k, s in slots.items()}, t, lr, scale)
        return
    row_bytes = value.itemsize * (value.size // max(value.shape[0], 1))
    for rows in _blocks(value.shape[0], row_bytes):
        _update(cfg, value[rows], grad[rows], {k: s[rows] for k, s in slots.items()}, t, lr, scale)


def apply_sparse(cfg: OptimizerConfig, value: np.ndarray, rows: np.ndarray, grad_rows: np.ndarray,
                 slots: dict[str, np.ndarray], t: int) -> None:
    """Apply gradients of the given local rows; duplicate ids are summed first, as TF does."""
    unique, summed = unique_sum(rows, grad_rows)
    apply_rows(cfg, value, unique, summed, slots, t)


def apply_rows(cfg: OptimizerConfig, value: np.ndarray, unique: np.ndarray, summed: np.ndarray,
               slots: dict[str, np.ndarray], t: int) -> None:
    """Apply one gradient per row to rows `unique` (no repeats: a caller that sums duplicates itself)."""
    w = take_rows(value, unique)
    sub = {k: take_rows(s, unique) for k, s in slots.items()}
    _update(cfg.at(t), w, summed, sub, t, cfg.lr_at(t), clip_scale(cfg, summed))
    put_rows(value, unique, w)
    for k, s in slots.items():
        put_rows(s, unique, sub[k])
