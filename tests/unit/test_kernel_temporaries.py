"""The in-place kernels (RMSprop, FTRL, gradient preparation) give bit for bit what the plain numpy
formulas give, over many blocks reusing one scratch buffer, and allocate nothing per block once warm."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from pscluster.server import optimizers as opt

import pscluster as ps
import pscluster.torch as ps_torch
from pscluster.optimizer_config import OptimizerConfig


def plain_rmsprop(cfg, w, g, s, lr):
    """RMSprop as plain numpy expressions, each allocating its result (the kernel before the rewrite)."""
    dt = w.dtype.type
    s["square_avg"] = s["square_avg"] * dt(cfg.rho) + dt(1 - cfg.rho) * (g * g)
    avg = s["square_avg"]
    if cfg.centered:
        s["grad_avg"] = s["grad_avg"] + dt(1 - cfg.rho) * (g - s["grad_avg"])
        avg = avg - s["grad_avg"] * s["grad_avg"]
    denom = np.sqrt(avg + dt(cfg.epsilon)) if cfg.eps_in_sqrt else np.sqrt(avg) + dt(cfg.epsilon)
    step = g / denom
    if cfg.momentum > 0:
        if cfg.lr_in_momentum:
            s["momentum"] = s["momentum"] * dt(cfg.momentum) + step * dt(lr)
            return w - s["momentum"]
        s["momentum"] = s["momentum"] * dt(cfg.momentum) + step
        step = s["momentum"]
    return w - dt(lr) * step


def plain_ftrl(cfg, w, g, s, lr):
    """FTRL as plain numpy expressions (the kernel before the rewrite)."""
    dt = w.dtype.type
    acc = s["accumulator"]
    shrunk = g + dt(2 * cfg.l2_shrinkage) * w if cfg.l2_shrinkage else g
    new_acc = acc + g * g
    p = -cfg.learning_rate_power
    new_pow, old_pow = (np.sqrt(new_acc), np.sqrt(acc)) if p == 0.5 else (new_acc ** dt(p), acc ** dt(p))
    sigma = (new_pow - old_pow) / dt(lr) * w
    s["linear"] = s["linear"] + shrunk - sigma
    lin = s["linear"]
    quadratic = new_pow / dt(lr) + dt(2 * (cfg.l2 + cfg.beta / (2 * lr)))
    s["accumulator"] = new_acc
    return np.where(np.abs(lin) > dt(cfg.l1), (np.sign(lin) * dt(cfg.l1) - lin) / quadratic, dt(0))


CASES = {
    "rmsprop-centered-momentum": (ps_torch.RMSprop(0.01, centered=True, momentum=0.9), plain_rmsprop),
    "rmsprop-keras-momentum-wd": (ps.RMSprop(0.01, momentum=0.8, weight_decay=0.1), plain_rmsprop),
    "rmsprop-coupled-wd": (ps_torch.RMSprop(0.01, weight_decay=0.1), plain_rmsprop),
    "ftrl": (ps.Ftrl(0.05, l1_regularization_strength=0.01, l2_regularization_strength=0.02, beta=0.1), plain_ftrl),
    "ftrl-shrinkage-power": (ps.Ftrl(0.05, learning_rate_power=-0.7, l1_regularization_strength=0.001,
                                     l2_shrinkage_regularization_strength=0.03), plain_ftrl),
}


def _prepare(cfg, w, g):
    """clipvalue and coupled weight decay in plain numpy (what _update does before the kernel)."""
    if cfg.clip_value:
        g = np.clip(g, w.dtype.type(-cfg.clip_value), w.dtype.type(cfg.clip_value))
    if cfg.weight_decay and not cfg.decoupled_weight_decay:
        g = g + w.dtype.type(cfg.weight_decay) * w
    if cfg.weight_decay and cfg.decoupled_weight_decay:
        w = w * w.dtype.type(1 - cfg.learning_rate * cfg.weight_decay)
    return w, g


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("clip", [0.0, 0.5])
@pytest.mark.parametrize("name", list(CASES))
def test_in_place_kernels_are_bit_identical_to_the_plain_formulas(name, clip, dtype, monkeypatch):
    monkeypatch.setattr(opt, "BLOCK_BYTES", 4096)  # many blocks: the scratch buffers are reused across them
    cfg, plain = CASES[name]
    cfg = cfg.changed({"clip_value": clip})
    rng = np.random.default_rng(0)
    value = rng.normal(size=(300, 17)).astype(dtype)
    slots = opt.init_slots(cfg, value.shape, value.dtype)
    want, state = value.copy(), {k: v.copy() for k, v in slots.items()}
    for t in range(1, 5):
        g = rng.normal(size=value.shape).astype(dtype)
        before = g.copy()
        opt.apply_dense(cfg, value, g, slots, t)
        w, g2 = _prepare(cfg, want, before)
        want = plain(cfg, w, g2, state, cfg.learning_rate)
        np.testing.assert_array_equal(g, before)  # the pushed gradient is never written
        np.testing.assert_array_equal(value, want)
        for k in slots:
            np.testing.assert_array_equal(slots[k], state[k], err_msg=k)


@pytest.mark.parametrize("make", [lambda: ps_torch.RMSprop(0.01, centered=True, momentum=0.9),
                                  lambda: ps.Ftrl(0.01, l1_regularization_strength=0.001),
                                  lambda: ps_torch.SGD(0.01, momentum=0.9, weight_decay=1e-4)])
def test_a_dense_update_allocates_nothing_per_block_once_warm(make):
    cfg: OptimizerConfig = make()
    value = np.full((8192, 1024), 0.5, np.float32)  # 32 MiB: 4 blocks of 8 MiB
    grad = np.full_like(value, 0.01)
    slots = opt.init_slots(cfg, value.shape, value.dtype)
    opt.apply_dense(cfg, value, grad, slots, 1)  # warm-up: the thread's scratch blocks appear
    tracemalloc.start()
    try:
        opt.apply_dense(cfg, value, grad, slots, 2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated during one update of a 32 MiB variable"
