"""Through real PS daemons: a torch AdamW + cosine schedule, a driver's set_learning_rate, a checkpoint and
a SIGKILLed PS restored from it, and the variable still equals torch.optim's run to float64 rounding."""

import signal

import numpy as np
import pytest
import torch

import pscluster as ps
import pscluster.torch as ps_torch
from pscluster.errors import NotFoundError

pytestmark = pytest.mark.cluster


def test_schedule_and_driver_change_continue_exactly_across_a_ps_kill(fresh_cluster):
    cluster = fresh_cluster(2, 0, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings(auto_checkpoint=False))
    try:
        rng = np.random.default_rng(5)
        w0, grads = rng.normal(size=(9, 4)), [rng.normal(size=(9, 4)) for _ in range(8)]
        p = torch.nn.Parameter(torch.tensor(w0))
        opt = torch.optim.AdamW([p], lr=0.01, weight_decay=0.05)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6, eta_min=0.001)
        w = coord.create_variable("w", initial_value=w0, partitioner=ps.FixedShardsPartitioner(3),
                                  optimizer=ps_torch.from_torch(opt, sched))
        for k, g in enumerate(grads):
            if k == 4:
                assert coord.set_learning_rate(0.003) == 3  # every shard, from its next update
                opt.param_groups[0]["lr"], sched = 0.003, None
                coord.checkpoint(step=k)
                cluster.kill(cluster.ps[0], signal.SIGKILL)
                cluster.restart(cluster.ps[0])  # restores the checkpoint: rate, slots and update counts
            coord.client.push([(w, g)])
            p.grad = torch.tensor(g)
            opt.step()
            if sched is not None:
                sched.step()
        np.testing.assert_allclose(coord.client.pull([w])[0], p.detach().numpy(), rtol=1e-12, atol=1e-13)
        with pytest.raises(NotFoundError, match="no PS task holds nope"):
            coord.set_learning_rate(0.5, variables=["nope"])
    finally:
        coord.shutdown()
