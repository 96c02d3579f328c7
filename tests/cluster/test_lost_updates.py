"""lost_updates is exact: a push applied by an attempt that later failed is re-applied, not lost."""

import os
import pathlib
import signal
import threading
import time

import numpy as np
import pytest

import pscluster as ps

pytestmark = pytest.mark.cluster


def push_then_park(counter, marker):
    """First attempt: push, write this worker's pid, then park until the worker is killed."""
    marker = pathlib.Path(marker)
    first = not marker.exists()
    counter.push(np.array(-1, np.int64))
    if first:
        marker.write_text(str(os.getpid()))
        threading.Event().wait(120)  # the test SIGKILLs this worker; the closure is re-run
    return "A"


def push_once(counter):
    counter.push(np.array(-1, np.int64))
    return "B"


def poll(condition, what, timeout=90.0):
    """Poll a progress condition with a deadline (the cluster's state, not elapsed time, decides)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_the_issues_scenario_counts_only_completed_updates_rolled_back(fresh_cluster, tmp_path):
    cluster = fresh_cluster(1, 2, supervise=True)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(2)
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        coord.checkpoint()  # the PS will come back at version 0
        marker = tmp_path / "a-pushed"
        a = coord.schedule(push_then_park, args=(counter, str(marker)))
        poll(marker.exists, "A's first push")
        b = coord.schedule(push_once, args=(counter,))
        assert b.fetch() == "B"  # B pushed (version 2) and completed
        ps_pid = cluster.ps[0].pid
        cluster.kill(cluster.ps[0], signal.SIGKILL)  # the supervisor restores it from version 0
        poll(lambda: coord.lost_updates >= 1, "the restart to be accounted")
        assert cluster.ps[0].pid != ps_pid
        a_pid = int(marker.read_text())
        [a_worker] = [w for w in cluster.workers if w.proc is not None and w.pid == a_pid]
        cluster.kill(a_worker, signal.SIGKILL)  # A's attempt dies; A re-runs on the new incarnation
        coord.join(timeout=90)
        assert a.fetch() == "A"
        completed = 2
        total = int(counter.pull())  # SGD(1.0) on gradient -1: +1 per applied push
        assert coord.status().retried >= 1
        assert (total, coord.lost_updates) == (1, 1)
        assert total == completed - coord.lost_updates
        assert coord.lost_updates_by_variable() == {"counter": 1}
    finally:
        coord.shutdown()
