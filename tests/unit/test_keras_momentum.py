"""Keras's momentum form (the rate inside the buffer) for ps.SGD(momentum) and ps.RMSprop(momentum):
equal to Keras 3's update_step written out in float64, under a schedule and a set_learning_rate in
the middle, on 1, 2 and 3 shards, dense and (lazily) sparse, across a checkpoint restore into
another number of PS tasks. Old checkpoints (no lr_in_momentum) keep torch's form."""

from __future__ import annotations

import numpy as np
import pytest
from pscluster.server.hyperparams import set_hyperparameters

import pscluster as ps
from pscluster.errors import InvalidArgumentError
from pscluster.optimizer_config import config_from_dict, optimizer_from_pb, optimizer_to_pb
from tests.unit.optim_harness import ShardedVariable

STEPS = 12
SHAPE = (7, 3)
RESTORE_AT, NEW_RATE_AT, NEW_RATE = 5, 8, 0.02


def keras_sgd(w, g, s, lr, momentum, nesterov, wd=0.0):
    """keras.optimizers.SGD.update_step (Keras 3), float64; decoupled decay first, as Keras applies it."""
    w = w - w * wd * lr
    m = s["m"] = s.get("m", np.zeros_like(w)) * momentum - g * lr
    if nesterov:
        return w + (m * momentum - g * lr)
    return w + m


def keras_rmsprop(w, g, s, lr, rho, momentum, centered, eps=1e-7, wd=0.0):
    """keras.optimizers.RMSprop.update_step (Keras 3), float64."""
    w = w - w * wd * lr
    v = s["v"] = s.get("v", np.zeros_like(w)) * rho + (1 - rho) * g * g
    if centered:
        ag = s["ag"] = s.get("ag", np.zeros_like(w)) * rho + (1 - rho) * g
        denominator = v - ag * ag + eps
    else:
        denominator = v + eps
    increment = lr * g / np.sqrt(denominator)
    if momentum > 0:
        m = s["m"] = s.get("m", np.zeros_like(w)) * momentum + increment
        return w - m
    return w - increment


SCHEDULE = ps.schedules.CosineDecay(0.05, 6, alpha=0.1, warmup_target=0.2, warmup_steps=3)
CASES = {
    "sgd-momentum": (lambda: ps.SGD(SCHEDULE, momentum=0.9),
                     lambda w, g, s, lr: keras_sgd(w, g, s, lr, 0.9, False)),
    "sgd-nesterov-wd": (lambda: ps.SGD(SCHEDULE, momentum=0.8, nesterov=True, weight_decay=0.05),
                        lambda w, g, s, lr: keras_sgd(w, g, s, lr, 0.8, True, wd=0.05)),
    "rmsprop-momentum": (lambda: ps.RMSprop(SCHEDULE, momentum=0.7),
                         lambda w, g, s, lr: keras_rmsprop(w, g, s, lr, 0.9, 0.7, False)),
    "rmsprop-centered-momentum-wd": (lambda: ps.RMSprop(SCHEDULE, rho=0.8, momentum=0.5, centered=True,
                                                        weight_decay=0.01),
                                     lambda w, g, s, lr: keras_rmsprop(w, g, s, lr, 0.8, 0.5, True, wd=0.01)),
}


def _rate(t):
    """The rate of update t: the schedule's, then NEW_RATE once the driver set it before update NEW_RATE_AT + 1."""
    return SCHEDULE(t - 1) if t <= NEW_RATE_AT else NEW_RATE


def _data(seed, sparse):
    rng = np.random.default_rng(seed)
    w0, grads = rng.normal(size=SHAPE), [rng.normal(size=SHAPE) for _ in range(STEPS)]
    ids = [np.sort(rng.choice(SHAPE[0], size=3, replace=False)) for _ in range(STEPS)] if sparse else None
    return w0, grads, ids


def _keras_run(step, w0, grads, ids):
    want, state = w0.copy(), {}
    for k, g in enumerate(grads):
        rows = np.arange(SHAPE[0]) if ids is None else ids[k]
        sub = {n: a[rows] for n, a in state.items()}
        new = step(want[rows], g[rows], sub, _rate(k + 1))
        for n, a in sub.items():  # lazy: only the touched rows' slots move
            state.setdefault(n, np.zeros_like(w0))[rows] = a
        want[rows] = new
    return want


def _ps_run(cfg, w0, grads, ids, shards, tmp_path):
    var = ShardedVariable("w", w0, cfg, num_shards=shards, num_ps=2, sparse=ids is not None)
    for k, g in enumerate(grads):
        if k == RESTORE_AT:
            var.restart(tmp_path, k, num_ps=3 if shards != 3 else 1)
        if k == NEW_RATE_AT:
            for store in var.stores:  # what coord.set_learning_rate does on every PS task
                set_hyperparameters(store, ["w"], {"learning_rate": NEW_RATE})
        if ids is None:
            var.push_dense(g)
        else:
            var.push_rows(ids[k], g[ids[k]])
    return var.value()


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("shards", [1, 2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_keras_momentum_forms_equal_keras_formulas(name, shards, sparse, tmp_path):
    make, step = CASES[name]
    w0, grads, ids = _data(shards + 10 * sparse, sparse)
    cfg = make()
    assert cfg.lr_in_momentum
    want = _keras_run(step, w0, grads, ids)
    np.testing.assert_allclose(_ps_run(cfg, w0, grads, ids, shards, tmp_path), want, rtol=1e-12, atol=1e-13)


def test_torch_form_differs_from_keras_form_once_the_rate_changes(tmp_path):
    w0, grads, _ = _data(0, False)
    keras = _ps_run(ps.SGD(SCHEDULE, momentum=0.9), w0, grads, None, 1, tmp_path / "k")
    torch_form = _ps_run(ps.Momentum(SCHEDULE, momentum=0.9), w0, grads, None, 1, tmp_path / "t")
    assert not ps.Momentum(0.1).lr_in_momentum
    assert np.abs(keras - torch_form).max() > 1e-3


def test_the_form_travels_the_wire_and_old_checkpoints_keep_torchs_form():
    cfg = ps.RMSprop(0.01, momentum=0.9)
    assert optimizer_from_pb(optimizer_to_pb(cfg)) == cfg
    assert config_from_dict(cfg.to_dict()) == cfg
    old = cfg.to_dict()
    del old["lr_in_momentum"]  # a checkpoint written before the field existed
    assert config_from_dict(old).lr_in_momentum is False
    assert not ps.RMSprop(0.01).lr_in_momentum  # no momentum, no buffer


def test_keras_form_is_structural_and_refuses_dampening():
    cfg = ps.SGD(0.1, momentum=0.9)
    with pytest.raises(InvalidArgumentError, match="cannot change lr_in_momentum"):
        cfg.changed({"lr_in_momentum": False})
    with pytest.raises(InvalidArgumentError, match="dampening has no meaning with lr_in_momentum"):
        cfg.changed({"dampening": 0.1})
    with pytest.raises(InvalidArgumentError, match="nesterov needs momentum"):
        ps.SGD(0.1, nesterov=True)
