"""The PS's optimizers and schedules equal torch.optim + lr_scheduler to float64 rounding: the same
gradients through torch (scheduler stepped after each optimizer step) and through P in-process
stores holding 1, 2 or 3 shards, dense and sparse, with a checkpoint restore into another number of
PS tasks in the middle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.optim import lr_scheduler as L  # noqa: N812 - torch.optim.lr_scheduler, short in tables

import pscluster.torch as ps_torch
from pscluster.errors import InvalidArgumentError
from tests.unit.optim_harness import ShardedVariable

STEPS = 12
SHAPE = (7, 3)

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum-dampening-wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
    "sgd-nesterov-wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.02),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adam-amsgrad-wd": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True, weight_decay=0.1, eps=1e-6),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "adamw-amsgrad": lambda p: torch.optim.AdamW(p, lr=0.02, betas=(0.8, 0.99), amsgrad=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.05, initial_accumulator_value=0.2,
                                             weight_decay=0.01),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    "rmsprop-centered-momentum-wd": lambda p: torch.optim.RMSprop(p, lr=0.01, alpha=0.9, centered=True, momentum=0.5,
                                                                  weight_decay=0.01),
}

SCHEDULERS = {
    "none": None,
    "StepLR": lambda o: L.StepLR(o, step_size=3, gamma=0.5),
    "MultiStepLR": lambda o: L.MultiStepLR(o, milestones=[2, 5, 5, 9], gamma=0.3),
    "ExponentialLR": lambda o: L.ExponentialLR(o, gamma=0.9),
    "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, T_max=5, eta_min=0.001),
    "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2, eta_min=0.002),
    "LinearLR": lambda o: L.LinearLR(o, start_factor=0.1, end_factor=0.9, total_iters=6),
    "ConstantLR": lambda o: L.ConstantLR(o, factor=0.25, total_iters=4),
    "PolynomialLR": lambda o: L.PolynomialLR(o, total_iters=8, power=2.0),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=0.05, total_steps=STEPS + 1, cycle_momentum=False),
    "OneCycleLR-linear-3phase": lambda o: L.OneCycleLR(o, max_lr=0.05, total_steps=STEPS + 1, cycle_momentum=False,
                                                       anneal_strategy="linear", three_phase=True),
    "SequentialLR": lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.2, 1.0, total_iters=3),
                                                 L.CosineAnnealingLR(o, T_max=6)], milestones=[3]),
}


def _torch_run(make_opt, make_sched, w0, grads, sparse_ids=None):
    """Weights after each step of torch.optim (float64), scheduler stepped once per update."""
    p = torch.nn.Parameter(torch.tensor(w0))
    optimizer = make_opt([p])
    sched = make_sched(optimizer) if make_sched else None
    # torch warns unless sparse invariant checks are chosen explicitly (warnings are errors here)
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        for k, g in enumerate(grads):
            if sparse_ids is None:
                p.grad = torch.tensor(g)
            else:
                ids = sparse_ids[k]
                p.grad = torch.sparse_coo_tensor(torch.tensor(ids)[None], torch.tensor(g[ids]), w0.shape).coalesce()
            optimizer.step()
            if sched is not None:
                sched.step()
    return p.detach().numpy()


def _ps_config(make_opt, make_sched, w0):
    p = torch.nn.Parameter(torch.tensor(w0))
    optimizer = make_opt([p])
    return ps_torch.from_torch(optimizer, make_sched(optimizer) if make_sched else None)


def _ps_run(cfg, w0, grads, shards, tmp_path, sparse_ids=None):
    """The same through a ShardedVariable on 2 PS tasks, restored into 3 (or 1) halfway."""
    var = ShardedVariable("w", w0, cfg, num_shards=shards, num_ps=2, sparse=sparse_ids is not None)
    for k, g in enumerate(grads):
        if k == len(grads) // 2:
            var.restart(tmp_path, k, num_ps=3 if shards != 3 else 1)
        if sparse_ids is None:
            var.push_dense(g)
        else:
            var.push_rows(sparse_ids[k], g[sparse_ids[k]])
    return var.value()


def _data(seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=SHAPE), [rng.normal(size=SHAPE) for _ in range(STEPS)]


@pytest.mark.parametrize("shards", [1, 2, 3])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_dense_optimizer_equals_torch_on_any_shard_count_across_a_restore(name, shards, tmp_path):
    w0, grads = _data(shards)
    cfg = _ps_config(OPTIMIZERS[name], None, w0)
    want = _torch_run(OPTIMIZERS[name], None, w0, grads)
    np.testing.assert_allclose(_ps_run(cfg, w0, grads, shards, tmp_path), want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("name", [n for n in SCHEDULERS if n != "none"])
def test_scheduler_rates_equal_torch_at_every_step(name):
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    optimizer = torch.optim.SGD([p], lr=0.04)
    sched = SCHEDULERS[name](optimizer)
    cfg = ps_torch.from_torch(optimizer, sched)
    steps = STEPS if name.startswith("OneCycle") else 40
    for k in range(steps):
        assert cfg.lr_at(k + 1) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12, abs=1e-15), k
        optimizer.step()
        sched.step()


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("sched", [n for n in SCHEDULERS if n != "none"])
@pytest.mark.parametrize("name", ["sgd-momentum-dampening-wd", "adamw"])
def test_scheduled_optimizer_equals_torch(name, sched, shards, tmp_path):
    w0, grads = _data(11)
    cfg = _ps_config(OPTIMIZERS[name], SCHEDULERS[sched], w0)
    want = _torch_run(OPTIMIZERS[name], SCHEDULERS[sched], w0, grads)
    np.testing.assert_allclose(_ps_run(cfg, w0, grads, shards, tmp_path), want, rtol=1e-12, atol=1e-13)


SPARSE = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.05, initial_accumulator_value=0.1),
    "sparse-adam": lambda p: torch.optim.SparseAdam(p, lr=0.01, betas=(0.8, 0.99)),
}


@pytest.mark.parametrize("shards", [1, 2, 3])
@pytest.mark.parametrize("name", list(SPARSE))
def test_sparse_optimizer_equals_torch_sparse_gradients(name, shards, tmp_path):
    w0, grads = _data(20 + shards)
    rng = np.random.default_rng(shards)
    ids = [np.sort(rng.choice(SHAPE[0], size=3, replace=False)) for _ in range(STEPS)]
    cfg = _ps_config(SPARSE[name], SCHEDULERS["StepLR"], w0)
    want = _torch_run(SPARSE[name], SCHEDULERS["StepLR"], w0, grads, sparse_ids=ids)
    got = _ps_run(cfg, w0, grads, shards, tmp_path, sparse_ids=ids)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


def test_parameter_groups_keep_their_own_settings_and_schedules():
    net = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW([{"params": [net.weight]}, {"params": [net.bias], "weight_decay": 0.0, "lr": 0.1}],
                                  lr=0.01, weight_decay=0.05)
    groups = ps_torch.from_torch(optimizer, L.ExponentialLR(optimizer, gamma=0.5))
    assert isinstance(groups, ps_torch.ParamGroups)
    w, b = groups.for_parameter(net.weight), groups.for_parameter(net.bias)
    assert (w.weight_decay, b.weight_decay) == (0.05, 0.0)
    assert (w.lr_at(3), b.lr_at(3)) == (pytest.approx(0.0025), pytest.approx(0.025))
    with pytest.raises(InvalidArgumentError, match="in no group"):
        groups.for_parameter(torch.nn.Parameter(torch.zeros(1)))


@pytest.mark.parametrize("make, message", [
    (lambda o: L.LambdaLR(o, lambda k: 0.9 ** k), "LambdaLR cannot run on the PS: a Python function"),
    (lambda o: L.ReduceLROnPlateau(o), "use pscluster.ReduceLROnPlateau"),
    (lambda o: L.CyclicLR(o, 0.01, 0.1, scale_fn=lambda x: 0.5, scale_mode="cycle"),
     r"CyclicLR\(scale_fn=...\) cannot run on the PS: a Python function; use mode="),
    (lambda o: L.SequentialLR(o, [L.OneCycleLR(o, max_lr=0.1, total_steps=10), L.StepLR(o, 2)], milestones=[5]),
     r"OneCycleLR\(cycle_momentum=True\) inside SequentialLR.*pass cycle_momentum=False"),
])
def test_schedulers_without_a_ps_form_are_refused_by_name(make, message):
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=0.01, momentum=0.9)
    with pytest.raises(InvalidArgumentError, match=message):
        ps_torch.from_torch(optimizer, make(optimizer))


def test_a_stepped_scheduler_is_refused():
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=0.01)
    sched = L.StepLR(optimizer, 2)
    optimizer.step()
    sched.step()
    with pytest.raises(InvalidArgumentError, match="stepped 1 times"):
        ps_torch.from_torch(optimizer, sched)
