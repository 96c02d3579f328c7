"""replicas: 2, bulk_transport: false, every item streamed (PullStream, PushStream): a SIGSTOPped primary
answers nothing, and a streamed push or pull waiting on it re-reads the replica table every 0.1 s and is
retried on the promoted backup once the table moved; before, it waited rpc_timeout_s (60 s)."""

import os
import signal
import threading
import time

import numpy as np
import pytest

import pscluster as ps
from tests.cluster.test_replicated_ps import poll, primary_of

pytestmark = pytest.mark.cluster
N = 64 * 1024  # 256 KiB of float32: 4 chunks of 64 KiB per streamed transfer


@pytest.mark.timeout(60)
def test_streamed_pushes_and_pulls_to_a_sigstopped_primary_go_to_the_new_one_long_before_the_rpc_timeout(
        fresh_cluster):
    cluster = fresh_cluster(2, 0, supervise=True, replicas=2)
    coord = ps.ClusterCoordinator(cluster.settings(bulk_transport=False, stream_threshold_bytes=0,
                                                   chunk_bytes=64 * 1024))
    stopped = None
    stop = threading.Event()
    acked: dict[str, list[float]] = {"push": [], "pull": []}
    errors: list[BaseException] = []
    try:
        counter = coord.create_variable("counter", shape=(N,), dtype="float32", optimizer=ps.SGD(1.0))
        key = ("counter", 0)
        poll(lambda: (c := primary_of(coord, key)) is not None and c.in_sync, "the backup to hold the counter")
        minus_one = -np.ones(N, np.float32)

        def loop(kind):
            while not stop.is_set():
                try:
                    if kind == "push":
                        coord.client.push([(counter, minus_one)])
                    else:
                        coord.client.pull([counter])
                except ps.PsclusterError as exc:
                    errors.append(exc)
                    return
                acked[kind].append(time.monotonic())

        threads = [threading.Thread(target=loop, args=(kind,), name=f"test-{kind}", daemon=True)
                   for kind in acked]
        for thread in threads:
            thread.start()
        poll(lambda: min(len(a) for a in acked.values()) > 10 or errors, "pushes and pulls under way")
        before = primary_of(coord, key)
        stopped = cluster.ps[before.primary].pid
        t0 = time.monotonic()
        os.kill(stopped, signal.SIGSTOP)
        # replies sent before the stop arrive within 20 ms; none come after it from the stopped PS
        poll(lambda: min(a[-1] for a in acked.values()) > t0 + 0.02 or errors, "a push and a pull answered by the "
             "new primary")
        assert not errors, errors
        assert max(a[-1] for a in acked.values()) - t0 < 5.0, "a streamed call waited on the stopped PS"
        assert primary_of(coord, key).primary != before.primary
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        poll(lambda: (c := primary_of(coord, key)).backup == before.primary and c.in_sync,
             "the woken PS to rejoin as backup")
        stop.set()
        for thread in threads:
            thread.join(timeout=20)
        assert not errors, errors
        np.testing.assert_array_equal(coord.client.pull([counter])[0], np.full(N, len(acked["push"]), np.float32))
        assert coord.lost_updates == 0
    finally:
        stop.set()
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        coord.shutdown()
