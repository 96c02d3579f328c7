"""A dynamic table's compiled optimizer updates of its touched rows (numba, cached on disk): SGD, Adagrad and
Adam, each row and its slots read, updated and written back in one pass. Use them through
server/table_kernels.py (typed entry points; numba imported on first use only).

Every operation runs in the values' dtype, in the order of server/optimizers._update and the numpy
kernels of server/optimizer_kernels.py (gradient * scale, clip to +-clip, + wd * w (coupled), w * decay
(decoupled: 1 - lr * wd), then the optimizer's own steps), so rows and slots equal the numpy update's bit
for bit (numba contracts no a * b + c into one rounding unless asked for fastmath):
tests/unit/test_table_updates.py compares them on random rows. The scalars come in the values' dtype.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from pscluster.server.table_jit import AHEAD, prefetch


@njit(cache=True, nogil=True)
def _ahead(flat, at, dim, line):
    """Prefetch the cache lines of one row (its first element at `at` of the flat array)."""
    for d in range(0, dim, line):
        prefetch(flat, at + d)
    prefetch(flat, at + dim - 1)


@njit(cache=True, nogil=True)
def _grad(grads, i, values, c, g, scale, clip, wd, decay):
    """g = gradient row i prepared as _update prepares it (scale, clip, coupled weight decay from values[c]);
    then values[c] *= decay (decoupled weight decay). One branch-free loop per stage (each vectorizes)."""
    dim = g.size
    for d in range(dim):
        g[d] = grads[i, d]
    if scale != 1:
        for d in range(dim):
            g[d] = g[d] * scale
    if clip:
        for d in range(dim):
            g[d] = min(max(g[d], -clip), clip)
    if wd:
        for d in range(dim):
            g[d] = g[d] + values[c, d] * wd
    if decay != 1:
        for d in range(dim):
            values[c, d] = values[c, d] * decay


@njit(cache=True, nogil=True)
def sgd_rows(values, rows, grads, lr, scale, clip, wd, decay):
    """SGD on values[rows[i]] with gradient grads[i]: w -= g * lr (optimizer_kernels.sgd)."""
    dim = values.shape[1]
    n = rows.size
    line = max(1, 64 // values.itemsize)
    flat_v = values.reshape(values.size)
    g = np.empty(dim, grads.dtype)
    for i in range(n):
        if i + AHEAD < n:  # the row AHEAD of this one: its misses overlap this row's work
            _ahead(flat_v, rows[i + AHEAD] * dim, dim, line)
        c = rows[i]
        _grad(grads, i, values, c, g, scale, clip, wd, decay)
        for d in range(dim):
            values[c, d] = values[c, d] - g[d] * lr


@njit(cache=True, nogil=True)
def adagrad_rows(values, acc, rows, grads, lr, eps, eps_in_sqrt, scale, clip, wd, decay):
    """Adagrad on values[rows[i]] with gradient grads[i] and its accumulator acc[rows[i]]: acc += g * g,
    w -= g / (sqrt(acc) + eps) * lr, or g / sqrt(acc + eps) (optimizer_kernels.adagrad; lr already decayed)."""
    dim = values.shape[1]
    n = rows.size
    line = max(1, 64 // values.itemsize)
    flat_v, flat_a = values.reshape(values.size), acc.reshape(acc.size)
    g = np.empty(dim, grads.dtype)
    for i in range(n):
        if i + AHEAD < n:
            at = rows[i + AHEAD] * dim
            _ahead(flat_v, at, dim, line)
            _ahead(flat_a, at, dim, line)
        c = rows[i]
        _grad(grads, i, values, c, g, scale, clip, wd, decay)
        if eps_in_sqrt:
            for d in range(dim):
                a = acc[c, d] + g[d] * g[d]
                acc[c, d] = a
                values[c, d] = values[c, d] - g[d] / np.sqrt(a + eps) * lr
        else:
            for d in range(dim):
                a = acc[c, d] + g[d] * g[d]
                acc[c, d] = a
                values[c, d] = values[c, d] - g[d] / (np.sqrt(a) + eps) * lr


@njit(cache=True, nogil=True)
def adam_rows(values, m, v, v_max, rows, grads, one_b1, b2, one_b2, amsgrad, eps, epsilon_hat, sqrt_bc2, step_size,
              scale, clip, wd, decay):
    """Adam on values[rows[i]] with gradient grads[i] and its moments (optimizer_kernels.adam): m += (g - m) *
    (1 - b1); v = v * b2 + g * g * (1 - b2); with amsgrad v_max = max(v_max, v) is used for v; denominator
    sqrt(v) + eps (epsilon_hat) or sqrt(v) / sqrt(bc2) + eps; w -= m / denominator * step_size. v_max is
    only read with amsgrad (any 2-D array otherwise)."""
    dim = values.shape[1]
    n = rows.size
    line = max(1, 64 // values.itemsize)
    flat_v, flat_m, flat_s = values.reshape(values.size), m.reshape(m.size), v.reshape(v.size)
    g = np.empty(dim, grads.dtype)
    den = np.empty(dim, values.dtype)
    for i in range(n):
        if i + AHEAD < n:
            at = rows[i + AHEAD] * dim
            _ahead(flat_v, at, dim, line)
            _ahead(flat_m, at, dim, line)
            _ahead(flat_s, at, dim, line)
        c = rows[i]
        _grad(grads, i, values, c, g, scale, clip, wd, decay)
        for d in range(dim):
            m[c, d] = m[c, d] + (g[d] - m[c, d]) * one_b1
            v[c, d] = v[c, d] * b2 + g[d] * g[d] * one_b2
        if amsgrad:
            for d in range(dim):
                a, b = v_max[c, d], v[c, d]
                v_max[c, d] = b if b > a or b != b else a  # np.maximum: the NaN wins
                den[d] = np.sqrt(v_max[c, d])
        else:
            for d in range(dim):
                den[d] = np.sqrt(v[c, d])
        if epsilon_hat:
            for d in range(dim):
                den[d] = den[d] + eps
        else:
            for d in range(dim):
                den[d] = den[d] / sqrt_bc2 + eps
        for d in range(dim):
            values[c, d] = values[c, d] - m[c, d] / den[d] * step_size
