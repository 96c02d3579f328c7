"""Automatic checkpoints on a real cluster: variables newer than the checkpoint come back, and a
training program resumes from the restored global step after every daemon was SIGKILLed."""

import signal

import numpy as np
import pytest
from pscluster.server import checkpoint

import pscluster as ps
from tests.cluster.test_lost_updates import poll

pytestmark = pytest.mark.cluster


def count(counter, i):
    counter.push(np.array(-1, np.int64))
    return i


def test_a_variable_created_after_the_checkpoint_is_created_again(fresh_cluster):
    cluster = fresh_cluster(1, 2, supervise=True)
    coord = ps.ClusterCoordinator(cluster.settings(auto_checkpoint=False))
    try:
        coord.wait_for_workers(2)
        coord.create_variable("old", shape=(3,), optimizer=ps.SGD(1.0))
        coord.checkpoint()  # "counter" does not exist yet
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        first = [coord.schedule(count, args=(counter, i)) for i in range(50)]
        coord.join(timeout=90)
        cluster.kill(cluster.ps[0], signal.SIGKILL)  # restored without "counter"
        rest = [coord.schedule(count, args=(counter, i)) for i in range(50, 100)]
        coord.join(timeout=90)  # no NotFoundError reaches a closure
        assert coord.fetch(first + rest) == list(range(100))
        assert int(counter.pull()) == 50
        assert coord.lost_updates_by_variable() == {"counter": 50}
        assert int(counter.pull()) == 100 - coord.lost_updates
    finally:
        coord.shutdown()


def gated_count(counter, i, gate):
    """count, but closures from step 100 on wait for the gate file: the first run is killed mid-run
    whatever the machine's speed."""
    import os as _os
    import time as _time
    deadline = _time.monotonic() + 120
    while i >= 100 and not _os.path.exists(gate):
        if _time.monotonic() > deadline:
            raise TimeoutError("gate never opened")
        _time.sleep(0.01)
    return count(counter, i)


def resumable_run(coord, counter, total, gate):
    """The training program: run the steps the restored global step says are left."""
    start = coord.global_step
    values = [coord.schedule(gated_count, args=(counter, i, gate)) for i in range(start, total)]
    return start, values


def test_whole_cluster_killed_mid_run_resumes_from_the_restored_step(fresh_cluster, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    gate = str(tmp_path / "gate")
    total = 300
    cluster = fresh_cluster(2, 2, supervise=False, checkpoint_dir=ckpt_dir)
    coord = ps.ClusterCoordinator(cluster.settings(checkpoint_every_steps=25, checkpoint_every_s=None))
    try:
        coord.wait_for_workers(2)
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        start, _ = resumable_run(coord, counter, total, gate)
        assert start == 0
        steps = lambda: [s for s, _ in checkpoint.complete_steps(ckpt_dir)]  # noqa: E731
        poll(lambda: any(s >= 50 for s in steps()), "an automatic checkpoint at step >= 50")
        done_at_kill = coord.status().done
        for daemon in cluster.ps + cluster.workers:  # the whole cluster goes down
            cluster.kill(daemon, signal.SIGKILL)
        assert done_at_kill <= 100  # mid-run: the gate was never opened
    finally:
        coord.shutdown()
    newest = max(steps())

    again = fresh_cluster(2, 2, supervise=False, checkpoint_dir=ckpt_dir, restore=True)
    coord = ps.ClusterCoordinator(again.settings(checkpoint_every_steps=25, checkpoint_every_s=None))
    try:
        coord.wait_for_workers(2)
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        restored = int(counter.pull())
        open(gate, "w").close()
        start, values = resumable_run(coord, counter, total, gate)
        assert start == newest > 0
        coord.join(timeout=120)
        assert coord.fetch(values) == list(range(start, total))
        assert coord.global_step == total
        # each PS file holds at least the closures up to its step (saved while training went on)
        assert restored >= start and int(counter.pull()) == restored + total - start
    finally:
        coord.shutdown()
