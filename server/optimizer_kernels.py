"""The update formulas, one function per optimizer kind, applied in place to a block of rows.

Each kernel gets the variable rows `w` (a view, or a gathered copy for sparse rows), their gradient
`g` (read only: never written), the slot rows, the update's 1-based count `t` and its learning rate
`lr` (already taken from the schedule). Weight decay and clipping are applied before a kernel runs
(server/optimizers.py). Formulas follow torch.optim where torch has the optimizer, with the options
that give optax's and Keras's forms (`eps_in_sqrt`, `epsilon_hat`); FTRL follows TF's ApplyFtrlV2
with Keras's `beta`; Lion follows its paper (and optax). Scalars are cast to the variable's dtype so
float32 variables stay in float32 arithmetic; numpy ufuncs only, no Python loop per element.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import numpy as np

from pscluster.optimizer_config import OptimizerConfig

Slots = dict[str, np.ndarray]
Kernel = Callable[[OptimizerConfig, np.ndarray, np.ndarray, Slots, int, float], None]
SCRATCH_MAX_BYTES = 8 << 20  # a dense block's size (server/optimizers.BLOCK_BYTES): larger ones are not kept
_local = threading.local()


def scratch(like: np.ndarray, n: int = 0, dtype: type | None = None) -> np.ndarray:
    """This thread's n-th temporary shaped like `like` (of `dtype`, default like's), reused across blocks and
    updates: an update allocates (and page-faults) nothing per block. Blocks above SCRATCH_MAX_BYTES get a
    fresh array."""
    dt = np.dtype(dtype or like.dtype)
    if like.size * dt.itemsize > SCRATCH_MAX_BYTES:
        return np.empty(like.shape, dt)
    bufs: dict[tuple[str, int], np.ndarray] = _local.__dict__.setdefault("bufs", {})
    buf = bufs.get((dt.str, n))
    if buf is None or buf.size < like.size:
        buf = bufs[(dt.str, n)] = np.empty(max(like.size, SCRATCH_MAX_BYTES // dt.itemsize), dt)
    return buf[:like.size].reshape(like.shape)


def sgd(cfg: OptimizerConfig, w: np.ndarray, g: np.ndarray, s: Slots, t: int, lr: float) -> None:
    """w -= lr * g."""
    step = np.multiply(g, w.dtype.type(lr), out=scratch(w))
    w -= step


def momentum(cfg: OptimizerConfig, w: np.ndarray, g: np.ndarray, s: Slots, t: int, lr: float) -> None:
    """torch.optim.SGD with momentum: buf = g at the first update, else mu * buf + (1 - dampening) * g;
    w -= lr * buf. With lr_in_momentum (Keras's SGD: m = mu * m - lr * g; w += m), buf = -m = mu * buf + lr * g
    from a zero buffer; w -= buf (nesterov: w -= mu * buf + lr * g)."""
    dt = w.dtype.type
    buf = s["momentum"]
    mu = dt(cfg.momentum)
    step = scratch(w)
    if cfg.lr_in_momentum:
        np.multiply(g, dt(lr), out=step)
        buf *= mu
        buf += step
        if cfg.nesterov:
            step += np.multiply(buf, mu, out=scratch(w, 1))
            w -= step
        else:
            w -= buf
        return
    if t == 1:
        np.copyto(buf, g)  # torch starts the buffer at the gradient itself, dampening or not
    else:
        buf *= mu
        buf += g if cfg.dampening == 0 else np.multiply(g, dt(1 - cfg.dampening), out=step)
    if cfg.nesterov:
        np.multiply(buf, mu, out=step)
        step += g
        step *= dt(lr)
    else:
        np.multiply(buf, dt(lr), out=step)
    w -= step


def adagrad(cfg: OptimizerConfig, w: np.ndarray, g: np.ndarray, s: Slots, t: int, lr: float) -> None:
    """acc += g^2; w -= lr / (1 + (t - 1) * lr_decay) * g / (sqrt(acc) + eps)  (or sqrt(acc + eps))."""
    dt = w.dtype.type
    acc = s["accumulator"]
    step = np.multiply(g, g, out=scratch(w))
    acc += step
    if cfg.eps_in_sqrt:
        np.add(acc, dt(cfg.epsilon), out=step)
        np.sqrt(step, out=step)
    else:
        np.sqrt(acc, out=step)
        step += dt(cfg.epsilon)
    np.divide(g, step, out=step)
    step *= dt(lr / (1 + (t - 1) * cfg.lr_decay))
    w -= step


def adam(cfg: OptimizerConfig, w: np.ndarray, g: np.ndarray, s: Slots, t: int, lr: float) -> None:
    """torch.optim.Adam (and AMSGrad): w -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps); Keras's epsilon_hat
    form: w -= lr * sqrt(bc2) / bc1 * m / (sqrt(v) + eps)."""
    dt = w.dtype.type
    m, v = s["m"], s["v"]
    b1, b2 = cfg.beta1, cfg.beta2
    tmp = np.subtract(g, m, out=scratch(w))
    tmp *= dt(1 - b1)
    m += tmp  # torch's lerp, Keras's form
    np.multiply(g, g, out=tmp)
    tmp *= dt(1 - b2)
    v *= dt(b2)
    v += tmp
    if cfg.amsgrad:
        np.maximum(s["v_max"], v, out=s["v_max"])
        v = s["v_max"]
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    denom = np.sqrt(v, out=tmp)
    if cfg.epsilon_hat:
        denom += dt(cfg.epsilon)
        step_size = lr * math.sqrt(bc2) / bc1
    else:
        denom /= dt(math.sqrt(bc2))
        denom += dt(cfg.epsilon)
        step_size = lr / bc1
    step = np.divide(m, denom, out=tmp)
    step *= dt(step_size)
    w -= step


def rmsprop(cfg: OptimizerConfig, w: np.ndarray, g: np.ndarray, s: Slots, t: int, lr: float) -> None:
    """torch.optim.RMSprop: sq = rho * sq + (1 - rho) g^2 (centered: minus the mean gradient squared),
    step g / (sqrt(.) + eps), through a momentum buffer when momentum > 0: buf = mu * buf + step;
    w -= lr * buf. With lr_in_momentum (Keras, optax): buf = mu * buf + lr * step; w -= buf.
    In place, one scratch block: the same operations in the same order as the plain numpy formula."""
    dt = w.dtype.type
    sq = s["square_avg"]
    a = scratch(w)
    np.multiply(g, g, out=a)
    a *= dt(1 - cfg.rho)
    sq *= dt(cfg.rho)
    sq += a
    avg = sq
    if cfg.centered:
        ga = s["grad_avg"]
        np.subtract(g, ga, out=a)
        a *= dt(1 - cfg.rho)
        ga += a
        np.multiply(ga, ga, out=a)
        avg = np.subtract(sq, a, out=a)
    if cfg.eps_in_sqrt:
        np.add(avg, dt(cfg.epsilon), out=a)
        np.sqrt(a, out=a)
    else:
        np.sqrt(avg, out=a)
        a += dt(cfg.epsilon)
    np.divide(g, a, out=a)  # the step
    if cfg.momentum > 0:
        buf = s["momentum"]
        buf *= dt(cfg.momentum)
        if cfg.lr_in_momentum:
            a *= dt(lr)
            buf += a
            w -= buf
            return
        buf += a
        np.multiply(buf, dt(lr), out=a)
    else:
        a *= dt(lr)
    w -= a


def ftrl(cfg: OptimizerConfig, w: np.ndarray, g: np.ndarray, s: Slots, t: int, lr: float) -> None:
    """FTRL-proximal as TF's ApplyFtrlV2 (l1, l2, l2_shrinkage, learning_rate_power) with Keras's beta.
    In place over three scratch blocks and a mask: the plain numpy formula's operations, in its order."""
    if lr <= 0:
        return  # FTRL divides by the rate: a zero rate (e.g. a schedule's end) leaves everything as it is
    dt = w.dtype.type
    acc, lin = s["accumulator"], s["linear"]
    new_acc, new_pow, sigma = scratch(w), scratch(w, 1), scratch(w, 2)
    np.multiply(g, g, out=new_acc)
    new_acc += acc
    p = -cfg.learning_rate_power
    if p == 0.5:  # TF's kernel takes sqrt for the default power (not pow: the rounding differs)
        np.sqrt(new_acc, out=new_pow)
        np.sqrt(acc, out=sigma)
    else:
        np.power(new_acc, dt(p), out=new_pow)
        np.power(acc, dt(p), out=sigma)
    np.copyto(acc, new_acc)
    np.subtract(new_pow, sigma, out=sigma)  # new_pow - old_pow
    sigma /= dt(lr)
    sigma *= w
    if cfg.l2_shrinkage:
        shrunk = np.multiply(w, dt(2 * cfg.l2_shrinkage), out=new_acc)
        shrunk += g
        lin += shrunk
    else:
        lin += g
    lin -= sigma
    quadratic = np.divide(new_pow, dt(lr), out=new_pow)
    quadratic += dt(2 * (cfg.l2 + cfg.beta / (2 * lr)))
    value = np.sign(lin, out=new_acc)
    value *= dt(cfg.l1)
    value -= lin
    value /= quadratic
    keep = np.greater(np.abs(lin, out=sigma), dt(cfg.l1), out=scratch(w, 3, np.bool_))
    w.fill(0)
    np.copyto(w, value, where=keep)


def lion(cfg: OptimizerConfig, w: np.ndarray, g: np.ndarray, s: Slots, t: int, lr: float) -> None:
    """Lion: w -= lr * sign(b1 * m + (1 - b1) g); m = b2 * m + (1 - b2) g."""
    dt = w.dtype.type
    m = s["m"]
    c, d = scratch(w), scratch(w, 1)
    np.multiply(m, dt(cfg.beta1), out=c)
    c += np.multiply(g, dt(1 - cfg.beta1), out=d)
    np.sign(c, out=c)
    c *= dt(lr)
    w -= c
    m *= dt(cfg.beta2)
    m += np.multiply(g, dt(1 - cfg.beta2), out=d)


KERNELS: dict[str, Kernel] = {"sgd": sgd, "momentum": momentum, "adagrad": adagrad, "adam": adam,
                              "rmsprop": rmsprop, "ftrl": ftrl, "lion": lion}
