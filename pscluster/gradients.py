"""Gradients checked and clipped in the worker, before a push fans out to the PS tasks.

A push reaches several PS tasks at once, so a gradient that holds NaN or Inf must be caught before
the fan-out: a PS that refuses its part while the others apply theirs leaves the model half a step
ahead. `screen` checks every array once (one BLAS dot product per float array: NaN or Inf anywhere
makes it non-finite) and either refuses the whole push, or tells the caller to skip the step, or lets
it through; with `max_norm` it then clips every gradient by their global norm, as torch's
`clip_grad_norm_` does (the same norm, coefficient and epsilon).

    grads, rows = screen(grads, rows, nonfinite="reject", max_norm=1.0)   # or None: skip this step
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from pscluster.errors import InvalidArgumentError, NonFiniteGradientError

NonFinite = Literal["reject", "skip", "allow"]
POLICIES = ("reject", "skip", "allow")
Dense = list[tuple[Any, np.ndarray]]  # (Variable, gradient)
Rows = list[tuple[Any, np.ndarray, np.ndarray]]  # (table, ids, row gradients)


def _sum_of_squares(arr: np.ndarray) -> float:
    """sum(arr**2) in one pass without a temporary (BLAS dot); NaN/Inf in arr make it non-finite."""
    flat = arr.reshape(-1)
    if arr.dtype.kind != "f":
        return 0.0
    if arr.dtype.itemsize < 4:  # float16/bfloat16: numpy has no BLAS for them
        flat = flat.astype(np.float32)
    return float(np.dot(flat, flat))


def _finite(arr: np.ndarray, squares: float) -> bool:
    """Whether every element of arr is finite, given its sum of squares (exact check only if that overflowed)."""
    if math.isfinite(squares) or arr.dtype.kind != "f":
        return True
    return bool(np.logical_and.reduce(np.isfinite(arr), axis=None))


def check_policy(nonfinite: str, max_norm: float | None = None, norm_type: float = 2.0) -> None:
    """Raise InvalidArgumentError for an unknown policy or a bad clipping norm."""
    if nonfinite not in POLICIES:
        raise InvalidArgumentError(f"nonfinite={nonfinite!r}: use one of {POLICIES}")
    if max_norm is not None and not (math.isfinite(max_norm) and max_norm > 0):
        raise InvalidArgumentError(f"max_norm={max_norm!r}: must be a finite number > 0")
    if not (norm_type == math.inf or (math.isfinite(norm_type) and norm_type > 0)):
        raise InvalidArgumentError(f"norm_type={norm_type!r}: must be > 0 or math.inf")


def screen(grads: Sequence[tuple[Any, np.ndarray]], rows: Sequence[tuple[Any, np.ndarray, np.ndarray]] = (), *,
           nonfinite: str = "reject", max_norm: float | None = None, norm_type: float = 2.0,
           unclipped: int = 0, what: str = "push") -> tuple[Dense, Rows] | None:
    """The gradients of one push, checked (and clipped with max_norm); None when the step is to be skipped.

    nonfinite: "reject" raises naming every variable whose gradient holds NaN or Inf, "skip" returns
    None (push nothing), "allow" lets them through (the PS's own nan_policy still applies).
    max_norm: clip all gradients (dense and row gradients together) to this global norm of order
    norm_type, as torch.nn.utils.clip_grad_norm_; the arrays passed in are never modified.
    unclipped: the last `unclipped` dense entries are checked but neither clipped nor counted in the
    norm (a model's buffer changes travel as gradients of SGD(1.0) variables).

    Raises:
        NonFiniteGradientError: a gradient holding NaN or Inf under "reject".
        InvalidArgumentError: an unknown policy, a bad max_norm or norm_type.
    """
    check_policy(nonfinite, max_norm, norm_type)
    dense = [(var, np.asarray(grad)) for var, grad in grads]
    table_rows = [(var, ids, np.asarray(g)) for var, ids, g in rows]
    if nonfinite == "allow" and max_norm is None:
        return dense, table_rows
    arrays = [(var.name, g) for var, g in dense] + [(var.name, g) for var, _, g in table_rows]
    with np.errstate(over="ignore", invalid="ignore"):  # an overflowing sum is checked exactly below
        squares = [_sum_of_squares(g) for _, g in arrays]
    if nonfinite != "allow":
        bad = [(name, g) for (name, g), s in zip(arrays, squares) if not _finite(g, s)]
        if bad:
            if nonfinite == "skip":
                return None
            names = ", ".join(f"{name!r} ({int(np.count_nonzero(~np.isfinite(g)))} of {g.size} values)"
                              for name, g in bad)
            raise NonFiniteGradientError(
                f"{what}: the gradient of {names} holds NaN or Inf; nothing was pushed to any PS "
                f"(nonfinite='reject'; nonfinite='skip' skips and counts such steps)", tuple(n for n, _ in bad))
    if max_norm is None:
        return dense, table_rows
    clipped = len(dense) - unclipped
    norm_of = [g for _, g in dense[:clipped]] + [g for _, _, g in table_rows]
    total = global_norm(norm_of, norm_type, squares[:clipped] + squares[len(dense):])
    coef = min(max_norm / (total + 1e-6), 1.0)  # torch's clip_coef, clamped at 1
    if coef >= 1.0:
        return dense, table_rows
    return ([(var, _scaled(g, coef)) for var, g in dense[:clipped]] + dense[clipped:],
            [(var, ids, _scaled(g, coef)) for var, ids, g in table_rows])


def _scaled(grad: np.ndarray, coef: float) -> np.ndarray:
    return grad * grad.dtype.type(coef) if grad.dtype.kind == "f" else grad


def global_norm(arrays: Sequence[np.ndarray], norm_type: float = 2.0, squares: Sequence[float] | None = None) -> float:
    """The norm of order norm_type of all arrays taken together (torch's total_norm in clip_grad_norm_)."""
    floats = [a for a in arrays if a.dtype.kind == "f"]
    if norm_type == math.inf:
        return max((float(np.max(np.abs(a))) for a in floats if a.size), default=0.0)
    if norm_type == 2.0:
        with np.errstate(over="ignore"):
            total = sum(squares) if squares is not None else sum(_sum_of_squares(a) for a in floats)
        return math.sqrt(total)
    return float(sum(float(np.sum(np.abs(a.astype(np.float64)) ** norm_type)) for a in floats) ** (1.0 / norm_type))


def clip_by_global_norm(grads: Sequence[np.ndarray], max_norm: float, norm_type: float = 2.0
                        ) -> tuple[list[np.ndarray], float]:
    """Gradients scaled so that their global norm is at most max_norm (new arrays), and that norm before
    clipping: torch.nn.utils.clip_grad_norm_ on numpy arrays.

    Raises:
        InvalidArgumentError: a bad max_norm or norm_type.
    """
    check_policy("allow", max_norm, norm_type)
    arrays = [np.asarray(g) for g in grads]
    total = global_norm(arrays, norm_type)
    coef = min(max_norm / (total + 1e-6), 1.0)
    return ([_scaled(a, coef) for a in arrays] if coef < 1.0 else arrays), total
