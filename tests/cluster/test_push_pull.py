"""Fused push-pull (`push_pull: true`, async jobs): a push brings back the pushed variables' values and
the worker's next pull of them uses those instead of another round trip; over both tensor transports.
"""

import time

import numpy as np
import pytest

import pscluster as ps
from pscluster.client import context

pytestmark = pytest.mark.cluster


def push_then_pull(w, b, pause=0.0):
    """Push ones to w and b, then pull both: (values, whether the pull was served by the push's reply)."""
    fresh = context.current_client().fresh
    ps.push([(w, np.ones(w.shape, np.float32)), (b, np.ones(b.shape, np.float32))])
    time.sleep(pause)
    before = fresh.served
    values = ps.pull([w, b])
    return values, fresh.served - before


def pull_only(w, b):
    fresh = context.current_client().fresh
    before = fresh.served
    values = ps.pull([w, b])
    return values, fresh.served - before


def make_variables(coord):
    w = coord.create_variable("w", initial_value=np.arange(12, dtype=np.float32).reshape(6, 2),
                              partitioner=ps.FixedShardsPartitioner(2), optimizer=ps.SGD(1.0))
    b = coord.create_variable("b", initial_value=np.full(3, 5.0, np.float32), optimizer=ps.SGD(1.0))
    assert {pl.ps for pl in w.shards} == {0, 1}  # w's shards come back from both PS tasks
    return w, b


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "grpc"])
def test_a_pull_after_a_push_is_served_by_the_push_reply_with_the_values_after_that_push(fresh_cluster, bulk):
    cluster = fresh_cluster(2, 1, supervise=False, extra={"bulk_transport": bulk})
    coord = ps.ClusterCoordinator(cluster.settings(push_pull=True))
    try:
        coord.wait_for_workers(1)
        w, b = make_variables(coord)
        for k in range(1, 4):  # one worker: nothing else changes the variables between push and pull
            (wv, bv), served = coord.schedule(push_then_pull, args=(w, b)).fetch(timeout=60)
            assert served == 1
            np.testing.assert_array_equal(wv, np.arange(12, dtype=np.float32).reshape(6, 2) - k)
            np.testing.assert_array_equal(bv, np.full(3, 5.0 - k, np.float32))
        (wv, bv), served = coord.schedule(pull_only, args=(w, b)).fetch(timeout=60)
        assert served == 0  # each reply serves one pull: this one asked the PS tasks
        np.testing.assert_array_equal(bv, np.full(3, 2.0, np.float32))
        # the values served were the PS's own: the driver reads the same
        np.testing.assert_array_equal(b.pull(), bv)
    finally:
        coord.shutdown()


def test_without_push_pull_or_in_sync_mode_or_too_late_every_pull_asks_the_ps(fresh_cluster):
    cluster = fresh_cluster(2, 1, supervise=False, extra={"push_pull_max_age_s": 0.1})
    plain = ps.ClusterCoordinator(cluster.settings())
    try:
        plain.wait_for_workers(1)
        w, b = make_variables(plain)
        (_, bv), served = plain.schedule(push_then_pull, args=(w, b)).fetch(timeout=60)
        assert served == 0 and bv[0] == 4.0
    finally:
        plain.shutdown()
    coord = ps.ClusterCoordinator(cluster.settings(push_pull=True))  # a second job on the same cluster
    try:
        coord.wait_for_workers(1)
        (_, bv), served = coord.schedule(push_then_pull, args=(w, b, 0.3)).fetch(timeout=60)
        assert served == 0 and bv[0] == 3.0  # older than the worker's push_pull_max_age_s
        coord.configure_sync(mode="sync", replicas_to_aggregate=1)
        (_, bv), served = coord.schedule(push_then_pull, args=(w, b)).fetch(timeout=60)
        assert served == 0  # a sync PS accumulates: it answers without values, the pull reads the step's result
        assert bv[0] == 2.0
    finally:
        coord.shutdown()
