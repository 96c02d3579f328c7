"""A PS whose copies were failed over while it was stopped (SIGSTOP, then resumed) drops them at its next
roles update: nothing routes to them any more, and they held memory forever ('shards 3' in status)."""

import numpy as np
import pytest
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.ps import ParameterServerCore
from pscluster.server.replication import Replication, Role
from pscluster.server.store import ShardSpec, ensure_created

SPECS = [ShardSpec("w", i, 3, (6, 2), (2, 2), 2 * i, "<f4", OptimizerConfig("sgd", 1.0), False, i) for i in range(3)]


def test_copies_the_new_table_gives_other_ps_tasks_are_dropped_and_logged_the_others_kept(caplog):
    core = ParameterServerCore(1, 3)
    core.replication = Replication(core.store, 1, connect=lambda _: pytest.fail("no link in this test"))
    for spec in SPECS:
        ensure_created(core.store, spec, np.zeros((2, 2), np.float32), "zeros", 0.0, 0)
    new = ShardSpec("v", 0, 1, (2,), (2,), 0, "<f4", OptimizerConfig("sgd", 1.0), False, 3)
    ensure_created(core.store, new, np.zeros(2, np.float32), "zeros", 0.0, 0)  # not in any table yet
    # ps 1 leads w[0] and w[1] (alone: their backups are down) and backs up w[2]
    core.take_roles(1, [Role(("w", 0), 1, 1, -1), Role(("w", 1), 1, 1, -1), Role(("w", 2), 1, 0, 1)], [], 0)
    assert len(core.store.shards()) == 4
    # it was stopped; the coordinator promoted other copies of w[0] and w[2]; it resumes and hears of it
    with caplog.at_level("WARNING", logger="pscluster.server.ps"):
        core.take_roles(2, [Role(("w", 0), 2, 2, 0), Role(("w", 1), 1, 1, -1), Role(("w", 2), 2, 0, 2)], [], 0)
    assert sorted(s.spec.key for s in core.store.shards()) == [("v", 0), ("w", 1)]
    assert caplog.text.count("ps 1: deposed: dropped its copy of") == 2
    assert "w[0] (version 0): the replica table (epoch 2) has it on ps 2 (backup 0)" in caplog.text
    core.take_roles(3, [Role(("w", 0), 2, 2, 0), Role(("w", 1), 1, 1, -1), Role(("w", 2), 2, 0, 2)], [], 0)
    assert len(core.store.shards()) == 2  # nothing more to drop
