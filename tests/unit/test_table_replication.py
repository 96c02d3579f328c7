"""A dynamic table's shard under replication: forwards and a catch-up's whole state reach the backup."""

from __future__ import annotations

import numpy as np
import pytest
from pscluster.server import sync_replicas
from pscluster.server import table_state as ts
from pscluster.server.ps import ParameterServerCore
from pscluster.server.replication import Role
from pscluster.server.store import PushItem, ShardSpec
from pscluster.server.table_filters import initial_rows

from pscluster.errors import ResourceExhaustedError
from pscluster.optimizers import Adam
from pscluster.tables import Admission, TableConfig
from tests.unit.test_replication import make_core, pair  # noqa: F401 - the fixture, used by name

DYN = ("dyn", 0)
CFG = TableConfig(dim=2, capacity=64, initializer="uniform", init_value=0.1, admission=Admission("counter", min_count=2))


def create(core: ParameterServerCore) -> None:
    core.create(ShardSpec("dyn", 0, 1, (0, 2), (0, 2), 0, "<f4", Adam(0.1), True, 0, CFG.to_json()), None, "zeros", 0, 0)


def set_roles(core: ParameterServerCore, epoch: int = 1) -> None:
    core.replication.set_roles(epoch, [Role(DYN, epoch, 0, 1)])


def push(core: ParameterServerCore, pid: str, keys: list[int]) -> None:
    k = np.array(keys, np.int64)
    core.push(pid, 0, [PushItem(DYN, np.ones((k.size, 2), np.float32), k)])


def same_table(a: ParameterServerCore, b: ParameterServerCore) -> None:
    ta, tb = a.store.get(DYN).table, b.store.get(DYN).table
    assert ta is not None and tb is not None and a.store.get(DYN).version == b.store.get(DYN).version
    sa, sb = ts.snapshot(ta), ts.snapshot(tb)
    assert sorted(sa) == sorted(sb) and all(np.array_equal(sa[k], sb[k]) for k in sa)


def test_a_dynamic_table_reaches_its_backup_by_forwards_and_by_catch_up(pair):
    a, b, links = pair
    create(a)
    for core in (b, a):
        set_roles(core)
    a.replication.wait([(DYN, a.store.get(DYN).version)])
    push(a, "c1.0", [-1, -1, 2**63 - 1])
    push(a, "c2.0", [2**63 - 1, 7, 7])
    same_table(a, b)  # rows, Adam's slots, admission candidates and versions, by forwards
    fresh = make_core(1, {0: a}, {})  # the backup restarts empty: the next update finds a gap
    set_roles(fresh)
    links[1].target = fresh
    push(a, "c3.0", [-1, 7, 12])
    same_table(a, fresh)  # by the catch-up's whole state
    fresh.replication.stop()


def test_rows_a_pull_creates_and_evicts_reach_the_backup_with_their_metadata(pair):
    a, b, _ = pair
    cfg = TableConfig(dim=2, capacity=6, initializer="uniform", init_value=0.1)  # admission "always": pulls create
    a.create(ShardSpec("dyn", 0, 1, (0, 2), (0, 2), 0, "<f4", Adam(0.1), True, 0, cfg.to_json()), None, "zeros", 0, 0)
    for core in (b, a):
        set_roles(core)
    a.replication.wait([(DYN, a.store.get(DYN).version)])
    push(a, "c1.0", [1, 2, 3])
    a.pull([(DYN, np.array([4, 5, 4], np.int64))])  # two new rows, after the push's
    push(a, "c2.0", [1, 6])
    a.pull([(DYN, np.array([7, 8, -9], np.int64))])  # a full shard: the pull evicts 3 rows for its own
    a.pull([(DYN, np.array([7, 10], np.int64))])  # and again, between the same two updates
    push(a, "c3.0", [7])  # its reply waits for the backup, which took the pulls' forwards before it
    tb = b.store.get(DYN).table
    assert tb is not None and tb.stats.evicted > 0
    same_table(a, b)  # rows, slots, last-touched steps, counters: the backup is the primary


def test_an_on_demand_sweep_evicts_the_same_keys_on_the_backup_before_it_returns(pair):
    """Evict() on the primary: the backup evicts exactly the keys its primary evicted, in order with the
    pulls and pushes around it, and the call returns only once it has (an LFU sweep, decided by the primary)."""
    from pscluster.tables import Eviction

    a, b, _ = pair
    cfg = TableConfig(dim=2, capacity=64, eviction=Eviction("steps", max_idle=1))
    a.create(ShardSpec("dyn", 0, 1, (0, 2), (0, 2), 0, "<f4", Adam(0.1), True, 0, cfg.to_json()), None, "zeros", 0, 0)
    for core in (b, a):
        set_roles(core)
    a.replication.wait([(DYN, a.store.get(DYN).version)])
    push(a, "c1.0", [1, 2, 3])
    push(a, "c2.0", [4])
    a.pull([(DYN, np.array([5], np.int64))])  # a row made at version 2, before the sweep at version 2
    push(a, "c3.0", [4, 5])  # keys 1, 2, 3: idle 2 pushes > max_idle 1; 4 and 5: touched now
    assert b.evict("dyn") == 0  # a backup does not sweep on its own: it follows its primary
    assert a.evict("dyn") == 3
    tb = b.store.get(DYN).table
    assert tb is not None and tb.stats.evicted == 3 and np.array_equal(tb.lookup(np.array([1, 2, 3])), [-1] * 3)
    same_table(a, b)
    keys, _ = a.evicted_keys("dyn")
    assert keys.tolist() == [1, 2, 3] and a.evict("dyn") == 0  # reported once; nothing more is idle
    push(a, "c4.0", [1])  # a key evicted on demand comes back fresh on both copies
    same_table(a, b)


def test_evict_keys_evicts_exactly_the_live_keys_named():
    from pscluster.server.dynamic_table import DynamicTable

    t = DynamicTable(TableConfig(dim=2, capacity=16), Adam(0.1))
    t.push(np.array([1, 2, 3, -1], np.int64), np.ones((4, 2), np.float32))
    assert t.evict_keys(np.array([3, 99, -1, 3], np.int64)).tolist() == [-1, 3]  # 99 was never live
    assert t.live == 2 and t.stats.evicted == 2 and t.report.drain()[0].tolist() == [-1, 3]


def test_a_sync_step_counts_a_key_once_for_admission_however_many_replicas_carry_it():
    core = ParameterServerCore(0, 1)
    sync_replicas.attach(core)
    core.sync.configure("sync", 2, 2, 0)
    create(core)  # admission: a key needs 2 occurrences
    for step in (0, 1):
        for replica in (0, 1):
            k = np.array([5], np.int64)
            core.push(f"c{step}.{replica}", step, [PushItem(DYN, np.full((1, 2), replica + 1.0, np.float32), k)])
        table = core.store.get(DYN).table
        assert table is not None and table.live == step  # step 0 counts 5 once: not admitted until step 1
    rows, _ = core.store.pull(DYN, np.array([5], np.int64))
    # admitted by step 1's push, the table's update 2: Adam's fresh slots with bias correction at t = 2
    move = 0.1 * (0.1 / (1 - 0.9**2)) / np.sqrt(0.001 / (1 - 0.999**2))
    np.testing.assert_allclose(rows, initial_rows(np.array([5], np.int64), CFG) - move, atol=1e-5)


def test_a_sync_step_whose_new_keys_do_not_fit_is_skipped_settles_and_tells_its_last_replica():
    core = ParameterServerCore(0, 1)
    sync_replicas.attach(core)
    core.sync.configure("sync", 2, 2, 0)
    cfg = TableConfig(dim=2, capacity=2, on_full="refuse")
    core.create(ShardSpec("dyn", 0, 1, (0, 2), (0, 2), 0, "<f4", Adam(0.1), True, 0, cfg.to_json()), None, "zeros", 0, 0)

    def push_step(step: int, replica: int, keys: list[int]) -> None:
        k = np.array(keys, np.int64)
        core.push(f"c{step}.{replica}", step, [PushItem(DYN, np.ones((k.size, 2), np.float32), k)])

    push_step(0, 0, [1, 2])
    with pytest.raises(ResourceExhaustedError, match="3 new keys do not fit"):
        push_step(0, 1, [3])  # completes step 0, whose 3 new keys exceed the 2-row shard
    table = core.store.get(DYN).table
    assert table is not None and table.live == 0 and core.store.get(DYN).version == 0  # nothing changed
    assert core.sync.settled(DYN, 0, timeout=1.0) == 0  # the step settled (skipped): no replica hangs on it
    push_step(1, 0, [1])
    push_step(1, 1, [2])  # the next step fits and applies
    assert table.live == 2 and core.store.get(DYN).version == 1


def test_seconds_eviction_on_a_backup_follows_its_primarys_clock_not_its_own(pair):
    """"Untouched for k seconds" was decided by each copy's own clock: a backup that applied an update 2 s later
    than its primary (or whose clock ran ahead) swept keys its primary kept. Each table operation now decides by
    one reading of the primary's clock, forwarded with it, and the backup repeats it at that reading."""
    from pscluster.tables import Eviction

    a, b, _ = pair
    cfg = TableConfig(dim=2, capacity=16, eviction=Eviction("seconds", max_idle=5, every_steps=1))
    a.create(ShardSpec("dyn", 0, 1, (0, 2), (0, 2), 0, "<f4", Adam(0.1), True, 0, cfg.to_json()), None, "zeros", 0, 0)
    now = {"a": 100.0, "b": 100.0}
    ta = a.store.get(DYN).table
    ta.clock, ta.epoch = (lambda: now["a"]), 0
    for core in (b, a):
        set_roles(core)
    a.replication.wait([(DYN, a.store.get(DYN).version)])  # the catch-up: the backup's table, epoch 0
    tb = b.store.get(DYN).table
    tb.clock = lambda: now["b"]
    push(a, "c1.0", [1, 2])  # touched at 100 on both
    a.pull([(DYN, np.array([3], np.int64))])  # a row-creating pull: touched at the primary's 100 too
    now["a"], now["b"] = 104.0, 107.0  # the backup's clock is 3 s ahead (or its apply came 3 s late)
    push(a, "c2.0", [4])  # the periodic sweep: idle 4 <= 5 on the primary, which keeps 1, 2 and 3
    assert sorted(ta.index.row_keys[ta.index.live_rows()].tolist()) == [1, 2, 3, 4]
    same_table(a, b)  # the backup kept them too (before: it evicted 1, 2 and 3 at idle 7)
    now["a"], now["b"] = 106.0, 100.0
    push(a, "c3.0", [4])  # idle 6 on the primary: 1, 2 and 3 go, on the backup too (its own clock says 0)
    assert sorted(ta.index.row_keys[ta.index.live_rows()].tolist()) == [4]
    same_table(a, b)
