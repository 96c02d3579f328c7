"""Driver-decided changes (set_learning_rate / set_hyperparameters) on the PS side, without sockets:
they apply from the next update on every shard, survive a checkpoint restore into another number of
PS tasks, are refused whole when bad, and show in the PS's learning-rate gauge."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest
from pscluster.server.hyperparams import set_hyperparameters
from pscluster.server.ps import ParameterServerCore
from pscluster.server.store import PushItem

import pscluster as ps
import pscluster.torch as ps_torch
from pscluster.errors import InvalidArgumentError
from pscluster.ops.metrics import PsMetrics
from pscluster.optimizer_config import changes_from_json, changes_to_json
from pscluster.schedules import ExponentialDecay
from pscluster.specs import ShardSpec
from tests.unit.optim_harness import ShardedVariable

SHAPE = (6, 2)


def _change_everywhere(var: ShardedVariable, **changes):
    for store in var.stores:
        set_hyperparameters(store, ["w"], changes_from_json(changes_to_json(changes)))


def test_changes_apply_from_the_next_update_and_survive_a_restore(tmp_path):
    rng = np.random.default_rng(3)
    w0, grads = rng.normal(size=SHAPE), [rng.normal(size=SHAPE) for _ in range(9)]
    p = torch.nn.Parameter(torch.tensor(w0))
    opt = torch.optim.AdamW([p], lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)
    var = ShardedVariable("w", w0, ps_torch.from_torch(opt, sched), num_shards=3, num_ps=2)
    for k, g in enumerate(grads):
        if k == 3:  # the driver takes over: a constant rate and no decay (torch: the scheduler is no longer stepped)
            _change_everywhere(var, learning_rate=0.004, weight_decay=0.0)
            opt.param_groups[0].update(lr=0.004, weight_decay=0.0)
            sched = None
        if k == 5:
            var.restart(tmp_path, k, num_ps=1)
        if k == 7:
            _change_everywhere(var, schedule=ExponentialDecay(0.02, 1, 0.5))
            opt.param_groups[0]["lr"] = 0.02 * 0.5 ** 7  # a schedule runs on the variable's own count (7 updates)
        if k == 8:
            opt.param_groups[0]["lr"] = 0.02 * 0.5 ** 8
        var.push_dense(g)
        p.grad = torch.tensor(g)
        opt.step()
        if sched is not None:
            sched.step()
    np.testing.assert_allclose(var.value(), p.detach().numpy(), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("changes, message", [
    ({"amsgrad": True}, "cannot change amsgrad"),
    ({"learning_rate": -1.0}, "learning_rate must be >= 0"),
    ({"momentum": "fast"}, "bad hyper-parameter change"),
    ({"epsilon": float("inf")}, "epsilon must be finite"),
])
def test_a_bad_change_is_refused_and_changes_nothing(changes, message):
    var = ShardedVariable("w", np.zeros(SHAPE), ps.Adam(0.1), num_shards=2, num_ps=2)
    before = [s.spec for store in var.stores for s in store.shards()]
    with pytest.raises(InvalidArgumentError, match=message):
        for store in var.stores:
            set_hyperparameters(store, [], changes)
    assert [s.spec for store in var.stores for s in store.shards()] == before


def test_a_change_of_the_slot_variables_is_refused():
    var = ShardedVariable("w", np.zeros(SHAPE), ps_torch.RMSprop(lr=0.1), num_shards=1, num_ps=1)
    with pytest.raises(InvalidArgumentError, match="would change the slot variables"):
        set_hyperparameters(var.stores[0], ["w"], {"momentum": 0.9})


def test_malformed_change_json_is_refused():
    with pytest.raises(InvalidArgumentError, match="malformed"):
        changes_from_json("{not json")
    with pytest.raises(InvalidArgumentError, match="non-empty JSON object"):
        changes_from_json("[]")


def test_recreating_a_variable_after_a_change_finds_it_with_the_driver_settings():
    core = ParameterServerCore(0, 1)
    spec = ShardSpec("w", 0, 1, SHAPE, SHAPE, 0, "<f8", ps.SGD(0.1))
    core.create(spec, np.zeros(SHAPE), "", 0.0, 0)
    core.set_hyperparameters(["w"], changes_to_json({"learning_rate": 0.5}))
    shard = core.create(spec, np.zeros(SHAPE), "", 0.0, 0)  # the program restarted and creates it again
    assert shard.spec.optimizer.learning_rate == 0.5
    with pytest.raises(ps.PsclusterError, match="cannot redefine"):
        core.create(ShardSpec("w", 0, 1, SHAPE, SHAPE, 0, "<f8", ps.Adam(0.1)), np.zeros(SHAPE), "", 0.0, 0)


def test_dry_run_changes_nothing_and_unknown_variables_change_nothing_here():
    core = ParameterServerCore(0, 1)
    core.create(ShardSpec("w", 0, 1, SHAPE, SHAPE, 0, "<f8", ps.SGD(0.1)), np.zeros(SHAPE), "", 0.0, 0)
    assert core.set_hyperparameters(["w"], changes_to_json({"learning_rate": 0.5}), dry_run=True) == (1, ["w"])
    assert core.store.get(("w", 0)).spec.optimizer.learning_rate == 0.1
    assert core.set_hyperparameters(["other"], changes_to_json({"learning_rate": 0.5})) == (0, [])


def test_ps_gauge_shows_the_rate_of_the_next_update():
    core = ParameterServerCore(0, 1)
    core.create(ShardSpec("w", 0, 1, SHAPE, SHAPE, 0, "<f8", ps.SGD(ExponentialDecay(0.1, 1, 0.5))),
                np.zeros(SHAPE), "", 0.0, 0)
    metrics = PsMetrics(lambda: 1, lambda: 0, lambda: 0, lambda: 0, core.learning_rates)
    assert 'pscluster_ps_learning_rate{variable="w"} 0.1' in generate_latest(metrics.registry).decode()
    core.push("", 0, [PushItem(("w", 0), np.ones(SHAPE))])
    assert 'pscluster_ps_learning_rate{variable="w"} 0.05' in generate_latest(metrics.registry).decode()

