"""Real workers and PS daemons under a fault schedule keyed to completed closures; arithmetic oracles.

The fault tests run twice (`make_coord`): against an embedded ClusterCoordinator and against a
RemoteCoordinator talking to a `pscluster coordinator` daemon, so the two cannot drift apart.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from pscluster.coordinator.remote import RemoteCoordinator

import pscluster as ps
from pscluster.errors import AbortedError, UnavailableError
from tests.cluster.procs import make_coord  # noqa: F401 - the fixture

pytestmark = pytest.mark.cluster


def wait_done(coord, n, timeout=60.0):
    """Block until coord has completed n closures (faults are keyed to steps, not to sleeps)."""
    deadline = time.monotonic() + timeout
    while coord.status().done < n:
        assert time.monotonic() < deadline, f"only {coord.status().done} of {n} closures done"
        time.sleep(0.005)


def counter_step(counter, i, pause=0.01):
    time.sleep(pause)
    counter.push(np.array(-1, np.int64))
    return i


FAULT_STEPS = (50, 100, 160)


def gated_step(counter, i, gates):
    """Closure i waits, before pushing, until the test opened the gate of every fault step <= i."""
    import pathlib as _pathlib
    import time as _time
    level = sum(i >= s for s in FAULT_STEPS)
    gate = _pathlib.Path(gates) / f"open-{level}"
    deadline = _time.monotonic() + 120
    while level and not gate.exists():
        if _time.monotonic() > deadline:
            raise TimeoutError(f"gate {level} never opened")
        _time.sleep(0.005)
    counter.push(np.array(-1, np.int64))
    return i


def test_counter_exact_when_workers_are_killed_hung_and_added(fresh_cluster, make_coord, tmp_path):
    """Faults keyed to progress: closures past a fault's step park until that fault has landed, so
    each fault meets a run with exactly that many closures done and every worker busy."""
    cluster = fresh_cluster(2, 2, supervise=False)
    coord = make_coord(cluster)
    try:
        coord.wait_for_workers(2)
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        k = 300
        values = [coord.schedule(gated_step, args=(counter, i, str(tmp_path))) for i in range(k)]

        def landed_retry(fault):
            """Run a fault that ends a busy worker, then wait until its closures were handed back."""
            before = coord.status().retried
            fault()
            wait_for(lambda: coord.status().retried > before, "the victim's closures to be rescheduled")

        faults = {
            50: lambda: cluster.add_worker(),
            100: lambda: landed_retry(lambda: cluster.kill(cluster.workers[0], signal.SIGKILL)),
            160: lambda: landed_retry(lambda: cluster.kill(cluster.workers[1], signal.SIGSTOP)),
        }
        for level, step in enumerate(FAULT_STEPS, start=1):
            wait_done(coord, step)
            faults[step]()
            assert coord.status().done == step  # the fault landed mid-run: nothing past the gate ran
            (tmp_path / f"open-{level}").touch()
        coord.join(timeout=90)
        assert int(counter.pull()) == k
        assert [v.fetch() for v in values] == list(range(k))
        status = coord.status()
        assert status.retried >= 2 and status.failed == 0
        assert [w.address for w in status.workers] == [f"127.0.0.1:{_port(cluster.workers[2])}"]
        assert status.workers[0].closures_done > 0  # the added worker took part
    finally:
        coord.shutdown()


def wait_for(condition, what, timeout=60.0):
    """Poll a progress condition with a deadline."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _port(daemon):
    for line in daemon.log_path.read_text().splitlines():
        if line.startswith(("READY worker", "SERVING worker")):
            return line.split()[-1].rpartition(":")[2]
    raise AssertionError("worker never printed READY")


def test_preempted_worker_finishes_its_closures_and_exits_cleanly(fresh_cluster, make_coord):
    cluster = fresh_cluster(1, 2, supervise=False)
    coord = make_coord(cluster)
    try:
        coord.wait_for_workers(2)
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        values = [coord.schedule(counter_step, args=(counter, i, 0.02)) for i in range(100)]
        wait_done(coord, 20)
        victim = cluster.workers[0]
        cluster.kill(victim, signal.SIGTERM)
        assert victim.proc.wait(timeout=20) == 0
        coord.join(timeout=60)
        assert int(counter.pull()) == 100
        assert coord.fetch(values) == list(range(100))
        assert coord.num_workers() == 1
    finally:
        coord.shutdown()


def test_ps_killed_mid_run_restarts_from_checkpoint_and_run_completes(fresh_cluster, make_coord):
    cluster = fresh_cluster(2, 2, supervise=True)
    coord = make_coord(cluster)
    try:
        coord.wait_for_workers(2)
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        first = [coord.schedule(counter_step, args=(counter, i)) for i in range(50)]
        coord.checkpoint()  # joins, then saves at one global step
        rest = [coord.schedule(counter_step, args=(counter, i)) for i in range(50, 250)]
        wait_done(coord, 120)
        cluster.kill(cluster.ps[counter.shards[0].ps], signal.SIGKILL)  # the supervisor restores it
        coord.join(timeout=90)
        assert coord.fetch(first + rest) == list(range(250))
        total = int(counter.pull())
        assert coord.lost_updates > 0
        # exactly what was applied after the checkpoint (and acknowledged) is lost, and reported as lost
        assert total == 250 - coord.lost_updates
        assert coord.lost_updates_by_variable() == {"counter": coord.lost_updates}  # a RemoteCoordinator too
    finally:
        coord.shutdown()


def test_error_inside_a_closure_is_raised_by_join_and_not_retried(fresh_cluster, make_coord):
    cluster = fresh_cluster(1, 1, supervise=False)
    coord = make_coord(cluster, max_inflight_per_worker=1)
    try:
        coord.wait_for_workers(1)
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))

        def bad():
            counter.push(np.array(-1, np.int64))
            raise ValueError("bad batch 7")

        failing = coord.schedule(bad)
        queued = [coord.schedule(counter_step, args=(counter, i, 0.0)) for i in range(20)]
        with pytest.raises(ValueError, match="bad batch 7") as info:
            coord.join(timeout=30)
        assert "in bad" in info.value.__cause__.remote_traceback
        with pytest.raises(ValueError):
            failing.fetch()
        cancelled = sum(1 for v in queued if _raises(v, AbortedError))
        assert cancelled >= 1
        assert int(counter.pull()) == 1 + (20 - cancelled)  # the failing closure ran exactly once
        after = coord.schedule(counter_step, args=(counter, 99, 0.0))
        coord.join(timeout=30)
        assert after.fetch() == 99
    finally:
        coord.shutdown()


def test_checkpoint_after_a_fetched_closure_error_saves_and_join_still_reports_it(fresh_cluster, make_coord, tmp_path):
    cluster = fresh_cluster(1, 1, supervise=False, checkpoint_dir=str(tmp_path / "ckpt"))
    coord = make_coord(cluster)
    try:
        coord.wait_for_workers(1)
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))

        def bad():
            raise ValueError("bad batch 3")

        with pytest.raises(ValueError, match="bad batch 3"):
            coord.schedule(bad).fetch(timeout=30)
        coord.schedule(counter_step, args=(counter, 1, 0.0))
        paths = coord.checkpoint()
        assert paths and all(os.path.exists(p) for p in paths)
        assert coord.configure_sync("async") >= 0
        with pytest.raises(ValueError, match="bad batch 3"):  # the error is still reported, once
            coord.join(timeout=30)
        coord.join(timeout=30)
        assert int(counter.pull()) == 1  # SGD(1.0) of the one -1 gradient
    finally:
        coord.shutdown()


def _raises(value, kind):
    try:
        value.fetch()
    except kind:
        return True
    return False


def test_closures_wait_for_a_worker_and_time_out_with_a_clear_error(fresh_cluster, make_coord):
    cluster = fresh_cluster(1, 0, supervise=False)
    coord = make_coord(cluster, no_worker_timeout_s=3.0)
    try:
        value = coord.schedule(lambda: 1)
        with pytest.raises(UnavailableError, match="no live worker"):
            value.fetch(timeout=20)
        with pytest.raises(UnavailableError):
            coord.join(timeout=5)
        late = coord.schedule(lambda: 2)
        cluster.add_worker()
        assert late.fetch(timeout=30) == 2
    finally:
        coord.shutdown()


def test_restarted_coordinator_resumes_from_the_ps_state(fresh_cluster):
    cluster = fresh_cluster(2, 1, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    coord.wait_for_workers(1)
    w = coord.create_variable("w", initial_value=np.zeros(4, np.float32), optimizer=ps.SGD(1.0))
    for _ in range(10):
        coord.schedule(lambda: w.push(np.ones(4)))
    coord.checkpoint()
    coord.shutdown()
    again = ps.ClusterCoordinator(cluster.settings())
    try:
        assert again.global_step == 10
        w2 = again.create_variable("w", initial_value=np.zeros(4, np.float32), optimizer=ps.SGD(1.0))
        assert w2 == w and w2.pull().tolist() == [-10.0] * 4
        again.wait_for_workers(1)
        again.schedule(lambda: w2.push(np.ones(4)))
        again.join(timeout=30)
        assert w2.pull().tolist() == [-11.0] * 4
    finally:
        again.shutdown()


def test_coordinator_daemon_serves_remote_clients_that_reconnect(fresh_cluster, tmp_path):
    cluster = fresh_cluster(1, 2, supervise=False)
    log = open(tmp_path / "coord.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pscluster.ops.cli", "coordinator", "--cluster",
                             str(cluster.cluster_file)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while b"READY" not in (tmp_path / "coord.log").read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        client = RemoteCoordinator(cluster.settings())
        counter = client.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        values = [client.schedule(counter_step, args=(counter, i, 0.0)) for i in range(30)]
        ids = [v.closure_id for v in values]
        client.close()
        again = RemoteCoordinator(cluster.settings(), job=client.job)  # re-attach: same job, same results
        again.join(timeout=60)
        assert [again.remote_value(cid).fetch(timeout=30) for cid in ids] == list(range(30))
        assert int(counter.pull()) == 30
        again.schedule(_raise_key_error)
        with pytest.raises(KeyError):
            again.join(timeout=30)
        again.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _raise_key_error():
    raise KeyError("missing feature")
