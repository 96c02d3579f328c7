"""Optimizers without a torch twin (FTRL, Lion), Keras's and optax's forms, lazy sparse updates and
clipping: each against its formula written out here in float64, and against optax itself, on 1 and
3 shards with a checkpoint restore in the middle."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pscluster as ps
import pscluster.jax as ps_jax
from pscluster.errors import InvalidArgumentError
from pscluster.specs import ShardSpec
from tests.unit.optim_harness import ShardedVariable

STEPS = 10
SHAPE = (6, 3)


def ftrl_step(w, g, s, lr, l1, l2, l2s, power, beta):
    """Keras's Ftrl.update_step, float64."""
    acc, lin = s.setdefault("acc", np.full_like(w, 0.1)), s.setdefault("lin", np.zeros_like(w))
    adj_l2 = l2 + beta / (2 * lr)
    new_acc = acc + g * g
    lin = lin + (g + 2 * l2s * w) - ((new_acc ** -power) - (acc ** -power)) / lr * w
    quad = new_acc ** -power / lr + 2 * adj_l2
    s["acc"], s["lin"] = new_acc, lin
    return np.where(np.abs(lin) > l1, (np.sign(lin) * l1 - lin) / quad, 0.0)


def keras_step(kind, w, g, s, t, lr, **hp):
    """Keras 3's update_step of each optimizer, float64 (weight decay: w -= lr * wd * w first)."""
    w = w - lr * hp.get("wd", 0.0) * w
    if kind == "adam":  # epsilon-hat form
        m = s["m"] = s.get("m", 0) + (g - s.get("m", 0)) * (1 - 0.9)
        v = s["v"] = s.get("v", 0) + (g * g - s.get("v", 0)) * (1 - 0.999)
        alpha = lr * math.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        return w - alpha * m / (np.sqrt(v) + 1e-7)
    if kind == "adagrad":
        acc = s["acc"] = s.get("acc", 0.1) + g * g
        return w - lr * g / np.sqrt(acc + 1e-7)
    if kind == "rmsprop":  # centered
        v = s["v"] = 0.9 * s.get("v", 0) + 0.1 * g * g
        mg = s["mg"] = 0.9 * s.get("mg", 0) + 0.1 * g
        return w - lr * g / np.sqrt(v - mg * mg + 1e-7)
    if kind == "lion":
        m = s.get("m", np.zeros_like(w))
        w = w - lr * np.sign(m * 0.9 + g * 0.1)
        s["m"] = m * 0.99 + g * 0.01
        return w
    raise AssertionError(kind)


KERAS = {
    "adamw": (lambda lr: ps.AdamW(lr, weight_decay=0.05), "adam", {"wd": 0.05}),
    "adagrad": (lambda lr: ps.Adagrad(lr), "adagrad", {}),
    "rmsprop-centered": (lambda lr: ps.RMSprop(lr, centered=True), "rmsprop", {}),
    "lion": (lambda lr: ps.Lion(lr, weight_decay=0.1), "lion", {"wd": 0.1}),
}


def _run_ps(cfg, w0, grads, shards, tmp_path, ids=None):
    var = ShardedVariable("w", w0, cfg, num_shards=shards, num_ps=2, sparse=ids is not None)
    for k, g in enumerate(grads):
        if k == STEPS // 2:
            var.restart(tmp_path, k, num_ps=3)
        if ids is None:
            var.push_dense(g)
        else:
            var.push_rows(ids[k], g[ids[k]])
    return var.value()


def _data(seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=SHAPE), [rng.normal(size=SHAPE) for _ in range(STEPS)]


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("name", list(KERAS))
def test_keras_forms_equal_keras_formulas_with_a_schedule(name, shards, tmp_path):
    make, kind, hp = KERAS[name]
    schedule = ps.schedules.CosineDecay(0.01, 6, alpha=0.1, warmup_target=0.05, warmup_steps=3)
    w0, grads = _data(shards)
    want, state = w0.copy(), {}
    for t, g in enumerate(grads, start=1):
        want = keras_step(kind, want, g, state, t, schedule(t - 1), **hp)
    got = _run_ps(make(schedule), w0, grads, shards, tmp_path)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("shards", [1, 3])
def test_ftrl_equals_keras_formula_dense_and_lazy_sparse(shards, sparse, tmp_path):
    hp = dict(l1=0.01, l2=0.02, l2s=0.03, power=-0.5, beta=0.1)
    cfg = ps.Ftrl(0.1, learning_rate_power=-0.5, l1_regularization_strength=0.01, l2_regularization_strength=0.02,
                  l2_shrinkage_regularization_strength=0.03, beta=0.1)
    w0, grads = _data(7)
    rng = np.random.default_rng(1)
    ids = [np.sort(rng.choice(SHAPE[0], 2, replace=False)) for _ in range(STEPS)] if sparse else None
    want, state = w0.copy(), {}
    for k, g in enumerate(grads):
        rows = ids[k] if sparse else np.arange(SHAPE[0])
        sub = {n: a[rows] for n, a in state.items()}
        new = ftrl_step(want[rows], g[rows], sub, 0.1, **hp)
        for n in ("acc", "lin"):  # lazy: only the touched rows' accumulators move
            full = state.setdefault(n, np.full_like(w0, 0.1) if n == "acc" else np.zeros_like(w0))
            full[rows] = sub[n]
        want[rows] = new
    got = _run_ps(cfg, w0, grads, shards, tmp_path, ids)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


def test_ftrl_with_another_power_uses_pow():
    w0, grads = _data(8)
    cfg = ps.Ftrl(0.05, learning_rate_power=-0.7, l1_regularization_strength=0.001)
    want, state = w0.copy(), {}
    for g in grads:
        want = ftrl_step(want, g, state, 0.05, 0.001, 0.0, 0.0, -0.7, 0.0)
    var = ShardedVariable("w", w0, cfg, num_shards=1, num_ps=1)
    for g in grads:
        var.push_dense(g)
    np.testing.assert_allclose(var.value(), want, rtol=1e-12, atol=1e-13)


def test_sparse_updates_are_lazy_untouched_rows_and_slots_keep_still(tmp_path):
    cfg = ps.AdamW(0.01, weight_decay=0.5)
    w0, grads = _data(9)
    ids = [np.array([0, 2])] * STEPS
    got = _run_ps(cfg, w0, grads, 3, tmp_path, ids)
    np.testing.assert_array_equal(got[[1, 3, 4, 5]], w0[[1, 3, 4, 5]])  # no decay where no gradient came
    dense_rows = _run_ps(cfg, w0[[0, 2]], [g[[0, 2]] for g in grads], 1, tmp_path / "d")
    np.testing.assert_allclose(got[[0, 2]], dense_rows, rtol=1e-12, atol=1e-13)


def test_clip_by_norm_then_value_as_keras_orders_them():
    w0, grads = _data(10)
    cfg = ps.SGD(0.1, clipnorm=1.5, clipvalue=0.4)
    want = w0.copy()
    for g in grads:
        g = g * 1.5 / max(np.linalg.norm(g), 1.5)
        want = want - 0.1 * np.clip(g, -0.4, 0.4)
    var = ShardedVariable("w", w0, cfg, num_shards=1, num_ps=1)
    for g in grads:
        var.push_dense(g)
    np.testing.assert_allclose(var.value(), want, rtol=1e-12, atol=1e-13)


def test_clip_by_norm_needs_the_variable_in_one_shard():
    with pytest.raises(InvalidArgumentError, match="clip_norm on the PS needs the variable in one shard"):
        ShardSpec("w", 0, 2, (4, 2), (2, 2), 0, "<f8", ps.SGD(0.1, clipnorm=1.0)).validate()


# -- optax, run in float64 --------------------------------------------------------------------------------
def _optax_run(tx, w0, grads):
    with jax.enable_x64(True):
        params = jnp.asarray(w0)
        state = tx.init(params)
        for g in grads:
            updates, state = tx.update(jnp.asarray(g), state, params)
            params = optax.apply_updates(params, updates)
        return np.asarray(params)


OPTAX = {
    "sgd-nesterov": (lambda lr: optax.sgd(lr, momentum=0.9, nesterov=True), lambda lr: ps_jax.sgd(lr, 0.9, True)),
    "adam": (lambda lr: optax.adam(lr), lambda lr: ps_jax.adam(lr)),
    "adamw": (lambda lr: optax.adamw(lr, weight_decay=0.1), lambda lr: ps_jax.adamw(lr, weight_decay=0.1)),
    "adagrad": (lambda lr: optax.adagrad(lr), lambda lr: ps_jax.adagrad(lr)),
    "rmsprop-centered": (lambda lr: optax.rmsprop(lr, centered=True), lambda lr: ps_jax.rmsprop(lr, centered=True)),
    "rmsprop-momentum": (lambda lr: optax.rmsprop(lr, momentum=0.9), lambda lr: ps_jax.rmsprop(lr, momentum=0.9)),
    "lion": (lambda lr: optax.lion(lr, weight_decay=0.01), lambda lr: ps_jax.lion(lr, weight_decay=0.01)),
}


@pytest.mark.parametrize("name", list(OPTAX))
def test_optax_optimizers_equal_optax(name, tmp_path):
    ref, ours = OPTAX[name]
    w0, grads = _data(12)
    want = _optax_run(ref(0.03), w0, grads)
    np.testing.assert_allclose(_run_ps(ours(0.03), w0, grads, 2, tmp_path), want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("name", list(OPTAX))
def test_optax_optimizers_with_warmup_cosine_follow_optax(name, tmp_path):
    # optax evaluates a schedule at its int32 count in float32 even under x64: agreement to float32 rounding
    # here; the schedules alone agree to float64 rounding (test_optax_schedules_equal_optax_at_every_count)
    ref, ours = OPTAX[name]
    w0, grads = _data(12)
    want = _optax_run(ref(optax.warmup_cosine_decay_schedule(0.0, 0.05, 3, 8, 0.005)), w0, grads)
    got = _run_ps(ours(ps_jax.warmup_cosine_decay_schedule(0.0, 0.05, 3, 8, 0.005)), w0, grads, 2, tmp_path)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


OPTAX_SCHEDULES = [
    ("constant_schedule", (0.3,), {}),
    ("linear_schedule", (0.1, 0.01, 20), {"transition_begin": 5}),
    ("polynomial_schedule", (0.1, 0.01, 2.0, 20), {"transition_begin": 3}),
    ("exponential_decay", (0.1, 7, 0.5), {"transition_begin": 4, "staircase": True, "end_value": 0.01}),
    ("exponential_decay", (0.1, 7, 1.5), {"end_value": 0.4}),
    ("cosine_decay_schedule", (0.1, 25), {"alpha": 0.1, "exponent": 2.0}),
    ("piecewise_constant_schedule", (0.1,), {"boundaries_and_scales": {10: 0.5, 20: 0.1}}),
    ("warmup_cosine_decay_schedule", (0.0, 0.1, 5, 40), {"end_value": 0.001}),
    ("warmup_exponential_decay_schedule", (0.0, 0.1, 5, 6, 0.7), {}),
    ("sgdr_schedule", ([{"init_value": 0.0, "peak_value": 0.1, "warmup_steps": 2, "decay_steps": 10},
                        {"init_value": 0.0, "peak_value": 0.05, "warmup_steps": 3, "decay_steps": 15}],), {}),
]


@pytest.mark.parametrize("name, args, kwargs", OPTAX_SCHEDULES, ids=[f"{c[0]}-{i}" for i, c in enumerate(OPTAX_SCHEDULES)])
def test_optax_schedules_equal_optax_at_every_count(name, args, kwargs):
    ours = getattr(ps_jax, name)(*args, **kwargs)
    with jax.enable_x64(True):
        ref = getattr(optax, name)(*args, **kwargs)
        want = [float(ref(jnp.asarray(k))) for k in range(50)]
    assert [ours(k) for k in range(50)] == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_optax_options_the_ps_lacks_are_refused_by_name():
    with pytest.raises(InvalidArgumentError, match="eps_root=0.1 is not supported"):
        ps_jax.adam(0.1, eps_root=0.1)
    with pytest.raises(InvalidArgumentError, match="nesterov=True is not supported"):
        ps_jax.rmsprop(0.1, momentum=0.9, nesterov=True)
