"""replicas: 2, bulk_transport: false, every item streamed (PullStream, PushStream): a SIGSTOPped primary
answers nothing, and a streamed push or pull waiting on it re-reads the replica table every 0.1 s and is
retried on the promoted backup once the table moved; before, it waited rpc_timeout_s (60 s)."""

import time

import numpy as np
import pytest

import pscluster as ps
from tests.cluster.replicas import CallLoop, poll, primary_of, sigstopped, wait_rejoined_as_backup

pytestmark = pytest.mark.cluster
N = 64 * 1024  # 256 KiB of float32: 4 chunks of 64 KiB per streamed transfer


@pytest.mark.timeout(60)
def test_streamed_pushes_and_pulls_to_a_sigstopped_primary_go_to_the_new_one_long_before_the_rpc_timeout(
        fresh_cluster):
    cluster = fresh_cluster(2, 0, supervise=True, replicas=2)
    coord = ps.ClusterCoordinator(cluster.settings(bulk_transport=False, stream_threshold_bytes=0,
                                                   chunk_bytes=64 * 1024))
    loops: list[CallLoop] = []
    try:
        counter = coord.create_variable("counter", shape=(N,), dtype="float32", optimizer=ps.SGD(1.0))
        key = ("counter", 0)
        poll(lambda: (c := primary_of(coord, key)) is not None and c.in_sync, "the backup to hold the counter")
        minus_one = -np.ones(N, np.float32)
        push = CallLoop(lambda: coord.client.push([(counter, minus_one)]), "test-push").start()
        loops.append(push)
        loops.append(CallLoop(lambda: coord.client.pull([counter]), "test-pull").start())

        def errors():
            return [e for loop in loops for e in loop.errors]

        poll(lambda: min(len(loop.acked) for loop in loops) > 10 or errors(), "pushes and pulls under way")
        before = primary_of(coord, key)
        with sigstopped(cluster.ps[before.primary].pid) as t0:
            # a reply sent before the stop may reach its loop late on a loaded machine: count only calls that
            # returned after the table named the new primary (none can come from the stopped PS)
            poll(lambda: primary_of(coord, key).primary != before.primary or errors(), "the backup's promotion")
            promoted = time.monotonic()
            poll(lambda: min(loop.acked[-1] for loop in loops) > promoted or errors(),
                 "a push and a pull answered by the new primary")
            assert not errors(), errors()
            assert max(loop.acked[-1] for loop in loops) - t0 < 5.0, "a streamed call waited on the stopped PS"
        wait_rejoined_as_backup(coord, key, before.primary)
        for loop in loops:
            loop.stop()
        assert not errors(), errors()
        np.testing.assert_array_equal(coord.client.pull([counter])[0], np.full(N, len(push.acked), np.float32))
        assert coord.lost_updates == 0
    finally:
        for loop in loops:
            loop.stop()
        coord.shutdown()
