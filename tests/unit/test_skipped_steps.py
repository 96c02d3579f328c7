"""A sync step in which a replica's gradient was not finite is skipped on the PS: the replica's skip
counts towards the step (the token queue moves on) and the step's update is applied nowhere."""

import numpy as np
import pytest
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.ps import ParameterServerCore
from pscluster.server.store import PushItem, ShardSpec
from pscluster.server.sync_replicas import attach

from pscluster.errors import InvalidArgumentError

ADAM = OptimizerConfig("adam", 0.1)
EMPTY = np.empty(0)


def core_with_two_variables():
    core = ParameterServerCore(0, 1)
    sync = attach(core)
    for i, name in enumerate(["w", "b"]):
        spec = ShardSpec(name, 0, 1, (4, 3), (4, 3), 0, "<f8", ADAM, False, i)
        core.create(spec, np.ones((4, 3)), "", 0.0, 0)
    return core, sync


def state(core):
    return [(s.value.copy(), {k: v.copy() for k, v in s.slots.items()}, s.version) for s in core.store.shards()]


def assert_same(before, after):
    for (v0, s0, n0), (v1, s1, n1) in zip(before, after):
        np.testing.assert_array_equal(v0, v1)
        assert s0.keys() == s1.keys() and all(np.array_equal(s0[k], s1[k]) for k in s0)
        assert n0 == n1


def replica(core, sync, cid, step, grad=None):
    assert sync.take_token(cid, "", 1.0)[0] == step
    items = [PushItem((name, 0), EMPTY if grad is None else grad) for name in ("w", "b")]
    core.push(f"c{cid}.0", step, items, skip_step=grad is None)
    sync.step_done(cid, step, "")


def test_a_skipping_replica_skips_the_step_everywhere_and_the_next_step_runs():
    core, sync = core_with_two_variables()
    sync.configure("sync", 2, 2, 0)
    before = state(core)
    replica(core, sync, 1, 0, np.ones((4, 3)))
    replica(core, sync, 2, 0)  # its gradient held NaN: it says so instead of pushing
    assert_same(before, state(core))
    assert core.global_step == 1 and sync.skipped == 2 and sync.dropped == 0
    replica(core, sync, 3, 1, np.ones((4, 3)))  # the queue was not stalled: step 1 runs and applies
    replica(core, sync, 4, 1, np.ones((4, 3)))
    assert core.global_step == 2 and [s.version for s in core.store.shards()] == [1, 1]


def test_a_skip_that_arrives_first_also_skips_the_step():
    core, sync = core_with_two_variables()
    sync.configure("sync", 3, 3, 0)
    before = state(core)
    replica(core, sync, 1, 0)
    replica(core, sync, 2, 0, np.ones((4, 3)))
    replica(core, sync, 3, 0, np.ones((4, 3)))
    assert_same(before, state(core))
    assert core.global_step == 1


def backup_step(core, sync, orders, grads):
    """One step of 3 replicas (R = 2): replica c's gradient grads[c] (None: a skip), pushed to each variable
    in that variable's own order, as replicas reach different PS tasks at different times."""
    for cid in grads:
        assert sync.take_token(cid, "", 1.0)[0] == 0
    for name, order in orders.items():
        for cid in order:
            grad = grads[cid]
            core.push(f"c{cid}.0", 0, [PushItem((name, 0), EMPTY if grad is None else grad)], skip_step=grad is None)
    for cid in grads:
        sync.step_done(cid, 0, "")


def test_with_backups_one_skip_is_a_missing_backup_gradient_on_every_shard_whatever_the_order():
    core, sync = core_with_two_variables()
    sync.configure("sync", 2, 3, 0)
    want, _ = core_with_two_variables()
    mean = (np.full((4, 3), 1.0) + np.full((4, 3), 3.0)) / 2
    for name in ("w", "b"):  # what R = 2 finite gradients make: their mean, applied once
        want.push("ref", 0, [PushItem((name, 0), mean)])
    # on w both finite gradients come first, on b the skip does: the first-R rule applied w and skipped b
    backup_step(core, sync, {"w": [1, 3, 2], "b": [2, 1, 3]}, {1: np.full((4, 3), 1.0), 2: None, 3: np.full((4, 3), 3.0)})
    assert_same(state(want), state(core))
    assert sync.skipped == 0 and core.global_step == 1


def test_with_backups_more_than_n_minus_r_skips_skip_the_step_on_every_shard_whatever_the_order():
    core, sync = core_with_two_variables()
    sync.configure("sync", 2, 3, 0)
    before = state(core)
    backup_step(core, sync, {"w": [1, 2, 3], "b": [2, 3, 1]}, {1: np.full((4, 3), 1.0), 2: None, 3: None})
    assert_same(before, state(core))
    assert sync.skipped == 2 and core.global_step == 1
    assert sync.dropped == 1  # on b both skips settled the step: the finite gradient came after it, stale


def test_a_repeated_skip_is_counted_once():
    core, sync = core_with_two_variables()
    sync.configure("sync", 2, 2, 0)
    assert sync.take_token(1, "", 1.0)[0] == 0
    for _ in range(2):  # a client's retry after a lost reply
        core.push("c1.0", 0, [PushItem(("w", 0), EMPTY)], skip_step=True)
    core.push("c2.0", 0, [PushItem(("w", 0), np.ones((4, 3)))])
    assert sync.skipped == 1 and core.store.shards()[0].version == 0


def test_an_async_ps_changes_nothing_on_a_skip():
    core, sync = core_with_two_variables()
    before = state(core)
    results = core.push("c1.0", 0, [PushItem(("w", 0), EMPTY), PushItem(("b", 0), EMPTY)], skip_step=True)
    assert [r.applied for r in results] == [False, False]
    assert_same(before, state(core))


def test_the_ps_still_refuses_and_counts_a_nan_that_reaches_it():
    core, _ = core_with_two_variables()
    grad = np.ones((4, 3))
    grad[0, 0] = np.nan
    before = state(core)
    with pytest.raises(InvalidArgumentError, match=r"b\[0\]: gradient holds NaN"):
        core.push("c1.0", 0, [PushItem(("w", 0), np.ones((4, 3))), PushItem(("b", 0), grad)])
    assert_same(before, state(core))  # the request is validated whole before anything applies
    assert core.store.rejected_nonfinite == 1


def test_metrics_count_refused_and_skipped_pushes_on_the_ps_and_the_worker():
    from pscluster.ops.metrics import PsMetrics, WorkerMetrics

    core, sync = core_with_two_variables()
    sync.configure("sync", 1, 1, 0)
    assert sync.take_token(1, "", 1.0)[0] == 0
    core.push("c1.0", 0, [PushItem(("w", 0), EMPTY)], skip_step=True)
    with pytest.raises(InvalidArgumentError):
        core.push("c2.0", 1, [PushItem(("b", 0), np.full((4, 3), np.inf))])
    ps_metrics = PsMetrics(lambda: 2, lambda: 0, lambda: 0, lambda: 0, skipped=lambda: sync.skipped,
                           rejected=lambda: core.store.rejected_nonfinite)
    assert ps_metrics.registry.get_sample_value("pscluster_ps_skipped_updates") == 1
    assert ps_metrics.registry.get_sample_value("pscluster_ps_rejected_nonfinite_pushes") == 1
    worker = WorkerMetrics(lambda: {"rejected": 3, "skipped": 5})
    assert worker.registry.get_sample_value("pscluster_worker_nonfinite_pushes_total", {"action": "rejected"}) == 3
    assert worker.registry.get_sample_value("pscluster_worker_nonfinite_pushes_total", {"action": "skipped"}) == 5


def test_with_a_backup_a_skipped_step_releases_the_replies_that_waited_for_it_at_once():
    import threading
    import time

    from tests.unit.test_replication import KEY, Link, create, grad, make_core, roles, same

    peers: dict = {}
    links: dict[int, Link] = {}
    a, b = make_core(0, peers, links, timeout=20.0), make_core(1, peers, links, timeout=20.0)
    peers.update({0: a, 1: b})
    try:
        create(a, "adam")
        a.sync.configure("sync", 2, 2, 0)
        roles(a, b)
        before = a.store.get(KEY).version
        first: list = []
        waiting = threading.Thread(target=lambda: first.extend(a.push("c1.0", 0, [PushItem(KEY, grad(1.0))])))
        waiting.start()
        waiting.join(timeout=0.3)
        assert waiting.is_alive()  # its step has not settled yet
        started = time.monotonic()
        a.push("c2.0", 0, [PushItem(KEY, np.empty(0, np.float32))], skip_step=True)
        waiting.join(timeout=10)
        assert first and time.monotonic() - started < 5  # not held until the 20 s replication timeout
        assert a.store.get(KEY).version == before and a.sync.skipped == 1
        same(a, b, KEY)
        third = threading.Thread(target=lambda: a.push("c3.0", 1, [PushItem(KEY, grad(1.0))]))
        third.start()  # the next step runs and reaches the backup
        a.push("c4.0", 1, [PushItem(KEY, grad(3.0))])
        third.join(timeout=10)
        assert not third.is_alive() and a.store.get(KEY).version == before + 1
        same(a, b, KEY)
    finally:
        a.replication.stop()
        b.replication.stop()
