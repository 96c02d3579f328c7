"""Sync replicas and bounded staleness on a PS core, driven directly; no sockets."""

import threading

import numpy as np
import pytest
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.ps import ParameterServerCore
from pscluster.server.store import PushItem, ShardSpec
from pscluster.server.sync_replicas import attach

from pscluster.errors import DeadlineExceededError, InvalidArgumentError

SGD = OptimizerConfig("sgd", 0.1)


def core_with(shape=(4, 3), sparse=False):
    core = ParameterServerCore(0, 1)
    sync = attach(core)
    spec = ShardSpec("w", 0, 1, shape, shape, 0, "<f8", SGD, sparse, 0)
    core.create(spec, np.ones(shape), "", 0.0, 0)
    return core, sync


def run_step(core, sync, grads, step, first_cid):
    for i, g in enumerate(grads):
        cid = first_cid + i
        assert sync.take_token(cid, "", 1.0)[0] == step
        core.push(f"c{cid}.0", step, [PushItem(("w", 0), g)])
        sync.step_done(cid, step, "")


def test_r_equals_n_matches_sgd_on_the_mean_gradient():
    core, sync = core_with()
    sync.configure("sync", 3, 3, 0)
    rng = np.random.default_rng(1)
    want = np.ones((4, 3))
    for step in range(20):
        grads = [rng.normal(size=(4, 3)) for _ in range(3)]
        run_step(core, sync, grads, step, 100 * step)
        want -= 0.1 * np.mean(grads, axis=0)
    value, version = core.store.pull(("w", 0))
    np.testing.assert_allclose(value, want, rtol=1e-12)
    assert version == 20 and core.global_step == 20 and sync.dropped == 0


def test_stale_gradient_is_dropped_counted_and_not_applied():
    core, sync = core_with()
    sync.configure("sync", 2, 3, 0)
    run_step(core, sync, [np.ones((4, 3))] * 2, 0, 0)  # step 0 applied by two replicas
    before, version = core.store.pull(("w", 0))
    res = core.push("c9.0", 0, [PushItem(("w", 0), np.full((4, 3), 100.0))])  # the backup, late
    assert res[0].applied is False and sync.dropped == 1
    after, version_after = core.store.pull(("w", 0))
    np.testing.assert_array_equal(before, after)
    assert version_after == version


def test_a_repeat_of_a_counted_push_after_its_step_applied_is_not_counted_as_dropped():
    core, sync = core_with()
    sync.configure("sync", 2, 3, 0)
    run_step(core, sync, [np.ones((4, 3))] * 2, 0, 0)  # c0.0 and c1.0 made step 0
    before, version = core.store.pull(("w", 0))
    res = core.push("c1.0", 0, [PushItem(("w", 0), np.ones((4, 3)))])  # c1's retry: its reply was lost
    assert res[0].applied is False and sync.dropped == 0
    assert core.push("c5.0", 0, [PushItem(("w", 0), np.ones((4, 3)))])[0].applied is False  # a real backup
    assert sync.dropped == 1
    after, version_after = core.store.pull(("w", 0))
    np.testing.assert_array_equal(before, after)
    assert version_after == version


def test_duplicate_push_id_counts_once():
    core, sync = core_with()
    sync.configure("sync", 2, 2, 0)
    core.push("c1.0", 0, [PushItem(("w", 0), np.ones((4, 3)))])
    core.push("c1.0", 0, [PushItem(("w", 0), np.ones((4, 3)))])  # a rescheduled closure re-sends
    assert core.store.pull(("w", 0))[1] == 0  # still waiting for a second replica
    core.push("c2.0", 0, [PushItem(("w", 0), 3 * np.ones((4, 3)))])
    np.testing.assert_allclose(core.store.pull(("w", 0))[0], 1 - 0.1 * 2)


def test_sparse_rows_accumulate_and_average():
    core, sync = core_with((6, 2), sparse=True)
    sync.configure("sync", 2, 2, 0)
    core.push("a", 0, [PushItem(("w", 0), np.ones((1, 2)), np.array([1]))])
    core.push("b", 0, [PushItem(("w", 0), 3 * np.ones((2, 2)), np.array([1, 4]))])
    value = core.store.pull(("w", 0))[0]
    np.testing.assert_allclose(value[1], 1 - 0.1 * (1 + 3) / 2)
    np.testing.assert_allclose(value[4], 1 - 0.1 * 3 / 2)
    np.testing.assert_allclose(value[[0, 2, 3, 5]], 1)


def test_tokens_run_out_then_release_when_the_step_advances():
    core, sync = core_with()
    sync.configure("sync", 2, 3, 0)
    assert [sync.take_token(c, "", 1.0) for c in (1, 2, 3)] == [(0, 0), (0, 1), (0, 2)]
    with pytest.raises(DeadlineExceededError, match="all 3 are out"):
        sync.take_token(4, "", 0.05)
    got = []
    waiter = threading.Thread(target=lambda: got.append(sync.take_token(4, "", 5.0)))
    waiter.start()
    sync.step_done(1, 0, "")
    sync.step_done(2, 0, "")  # R = 2 reports: step 1 begins
    waiter.join(5)
    assert got == [(1, 0)] and core.global_step == 1
    sync.step_done(3, 0, "")  # the backup's late report changes nothing
    assert core.global_step == 1


def test_a_rescheduled_closure_gets_its_token_back():
    core, sync = core_with()
    sync.configure("sync", 2, 2, 0)
    assert sync.take_token(1, "", 1.0) == (0, 0)
    assert sync.take_token(2, "", 1.0) == (0, 1)
    assert sync.take_token(1, "", 0.05) == (0, 0)  # the token holder died; its closure runs again


def test_bounded_staleness_holds_a_fast_worker_back():
    core, sync = core_with()
    sync.configure("bounded", 0, 0, 1)
    assert sync.take_token(1, "slow", 1.0) == (0, 0)  # the slow worker starts its step 0 and stays in it
    for cid in (2, 3):
        sync.take_token(cid, "fast", 1.0)
        sync.step_done(cid, 0, "fast")
    with pytest.raises(DeadlineExceededError, match="2 steps ahead"):
        sync.take_token(4, "fast", 0.05)  # step 2 needs the slow worker's step 0 done
    sync.step_done(1, 0, "slow")
    assert sync.take_token(4, "fast", 1.0) == (2, 0)
    assert sync.max_spread <= 1


def test_bounded_counts_closures_in_flight_on_the_same_worker():
    core, sync = core_with()
    sync.configure("bounded", 0, 0, 1)
    sync.take_token(1, "slow", 1.0)
    assert sync.take_token(2, "fast", 1.0) == (0, 0)
    assert sync.take_token(3, "fast", 1.0) == (1, 0)  # two in flight: steps 0 and 1
    with pytest.raises(DeadlineExceededError):
        sync.take_token(4, "fast", 0.05)  # a third would be step 2, two ahead of the slowest
    assert sync.take_token(3, "fast", 0.05) == (1, 0)  # a rescheduled closure gets its token back


def test_bad_sync_configuration_is_rejected():
    _, sync = core_with()
    with pytest.raises(InvalidArgumentError, match="replicas_to_aggregate"):
        sync.configure("sync", 3, 2, 0)
    with pytest.raises(InvalidArgumentError, match="mode"):
        sync.configure("lockstep", 1, 1, 0)
    assert sync.mode == "async"


def test_bounded_worker_with_nothing_to_run_stops_holding_the_others_back():
    now = [0.0]
    core = ParameterServerCore(0, 1)
    sync = attach(core)
    sync._clock = lambda: now[0]
    sync.configure("bounded", 0, 0, 1)
    sync.take_token(1, "idle", 1.0)  # took one step's token, finished it, then its queue ran dry
    sync.step_done(1, 0, "idle")
    for cid in (2, 3):  # a newcomer starts level with the slowest: steps 1 and 2
        sync.take_token(cid, "busy", 1.0)
        sync.step_done(cid, 0, "busy")
    with pytest.raises(DeadlineExceededError):
        sync.take_token(4, "busy", 0.0)  # step 3 would be 2 ahead of idle's completed step
    now[0] += 2.5  # past the lease: "idle" no longer counts as the slowest
    assert sync.take_token(4, "busy", 1.0) == (3, 0)


def test_configuring_the_same_settings_again_mid_step_keeps_the_steps_accumulated_gradients():
    core, sync = core_with()
    sync.configure("sync", 2, 2, 0)
    assert sync.take_token(1, "", 1.0)[0] == 0 and sync.take_token(2, "", 1.0)[0] == 0
    core.push("c1.0", 0, [PushItem(("w", 0), np.full((4, 3), 1.0))])  # acknowledged: it waits in the accumulator
    assert sync.configure("sync", 2, 2, 0) == 0  # add_ps configures a PS that holds the open step
    core.push("c2.0", 0, [PushItem(("w", 0), np.full((4, 3), 3.0))])
    value, version = core.store.pull(("w", 0))
    np.testing.assert_allclose(value, np.ones((4, 3)) - 0.1 * 2.0)  # the mean of both gradients applied
    assert version == 1
    sync.configure("sync", 1, 2, 0)  # a real change still starts over
    assert sync.replicas_to_aggregate == 1
