"""torch's OneCycleLR and CyclicLR with cycle_momentum=True: the PS schedules momentum (SGD, RMSprop) or
beta1 (Adam, AdamW, SparseAdam) from the update count as it does the rate, and equals torch's own
scheduler + optimizer to float64 rounding on 1, 2 and 3 shards across a restore into another PS count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.optim import lr_scheduler as L  # noqa: N812 - torch.optim.lr_scheduler, short in tables

import pscluster.torch as ps_torch
from pscluster.errors import InvalidArgumentError
from tests.unit.test_torch_exactness import STEPS, _data, _ps_config, _ps_run, _torch_run

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),  # momentum 0: the scheduler turns it on, as in torch
    "sgd-nesterov-wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.02),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw-amsgrad": lambda p: torch.optim.AdamW(p, lr=0.02, betas=(0.8, 0.99), amsgrad=True),
    "rmsprop-centered": lambda p: torch.optim.RMSprop(p, lr=0.01, centered=True),
}

SCHEDULERS = {
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=0.05, total_steps=STEPS + 1),
    "OneCycleLR-linear-3phase": lambda o: L.OneCycleLR(o, max_lr=0.05, total_steps=STEPS + 1, anneal_strategy="linear",
                                                       three_phase=True, base_momentum=0.7, max_momentum=0.9),
    "CyclicLR-triangular": lambda o: L.CyclicLR(o, 0.001, 0.05, step_size_up=3, step_size_down=2),
    "CyclicLR-triangular2": lambda o: L.CyclicLR(o, 0.001, 0.05, step_size_up=2, mode="triangular2"),
    "CyclicLR-exp_range": lambda o: L.CyclicLR(o, 0.001, 0.05, step_size_up=4, mode="exp_range", gamma=0.9,
                                               base_momentum=0.6, max_momentum=0.95),
}


def _momentum(group):
    return group["betas"][0] if "betas" in group else group["momentum"]


@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_rate_and_momentum_equal_torchs_at_every_step(name, sched):
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    optimizer = OPTIMIZERS[name]([p])
    scheduler = SCHEDULERS[sched](optimizer)
    cfg = ps_torch.from_torch(optimizer, scheduler)
    assert cfg.momentum_schedule is not None
    for k in range(STEPS):
        group = optimizer.param_groups[0]
        at = cfg.at(k + 1)
        assert cfg.lr_at(k + 1) == pytest.approx(group["lr"], rel=1e-12, abs=1e-15), k
        assert (at.beta1 if name == "adam" else at.momentum) == pytest.approx(_momentum(group), rel=1e-12), k
        optimizer.step()
        scheduler.step()


@pytest.mark.parametrize("shards", [1, 2, 3])
@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_cycled_momentum_equals_torch(name, sched, shards, tmp_path):
    w0, grads = _data(30 + shards)
    cfg = _ps_config(OPTIMIZERS[name], SCHEDULERS[sched], w0)
    want = _torch_run(OPTIMIZERS[name], SCHEDULERS[sched], w0, grads)
    np.testing.assert_allclose(_ps_run(cfg, w0, grads, shards, tmp_path), want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("shards", [1, 3])
def test_sparse_adam_with_cycled_beta1_equals_torch(shards, tmp_path):
    w0, grads = _data(40 + shards)
    rng = np.random.default_rng(shards)
    ids = [np.sort(rng.choice(w0.shape[0], size=3, replace=False)) for _ in range(STEPS)]
    make = lambda p: torch.optim.SparseAdam(p, lr=0.01, betas=(0.8, 0.99))  # noqa: E731
    cfg = _ps_config(make, SCHEDULERS["OneCycleLR"], w0)
    want = _torch_run(make, SCHEDULERS["OneCycleLR"], w0, grads, sparse_ids=ids)
    got = _ps_run(cfg, w0, grads, shards, tmp_path, sparse_ids=ids)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


def test_the_momentum_schedule_is_checkpointed_and_a_driver_value_ends_it():
    from pscluster.optimizer_config import config_from_dict, optimizer_from_pb, optimizer_to_pb

    cfg = _ps_config(OPTIMIZERS["adam"], SCHEDULERS["OneCycleLR"], np.zeros((2, 2)))
    assert config_from_dict(cfg.to_dict()) == cfg and optimizer_from_pb(optimizer_to_pb(cfg)) == cfg
    assert cfg.changed({"beta1": 0.9}).momentum_schedule is None
    assert cfg.changed({"learning_rate": 0.1}).momentum_schedule == cfg.momentum_schedule
    with pytest.raises(InvalidArgumentError, match="momentum_schedule needs a momentum"):
        ps_torch.Adagrad(0.1).changed({"momentum_schedule": cfg.momentum_schedule})
