"""Several client programs on one coordinator daemon: each is a job with its own closures, errors and join."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from pscluster.coordinator.remote import RemoteCoordinator

import pscluster as ps
from tests.cluster.procs import Procs, read_until

pytestmark = pytest.mark.cluster

IDLE_TIMEOUT_S = "3"


def until(condition, what, timeout=90.0):
    """Poll condition until true (progress, not time, is what the tests wait for)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def daemon(fresh_cluster):
    """A coordinator daemon (job_idle_timeout_s=3) over 1 PS and 1 worker; yields the LocalCluster."""
    cluster = fresh_cluster(1, 1, supervise=False)
    procs = Procs()
    try:
        coord = procs.start("coordinator", "--cluster", str(cluster.cluster_file), "--exit-with-parent",
                            str(os.getpid()), env={"PSCLUSTER_JOB_IDLE_TIMEOUT_S": IDLE_TIMEOUT_S})
        read_until(coord, "READY coordinator")
        yield cluster
    finally:
        procs.close()


def job_state(coord, job):
    return next((j for j in coord.status().jobs if j.job == job and not j.ended), None)


def nap_step(pause):
    time.sleep(pause)
    return pause


def raise_value_error():
    raise ValueError("bad batch 7")


def test_one_jobs_error_is_raised_by_its_own_join_only_with_the_real_closure_id(daemon):
    x = RemoteCoordinator(daemon.settings())
    y = RemoteCoordinator(daemon.settings())
    try:
        assert x.job != y.job
        x.schedule(nap_step, args=(0.0,))
        bad = x.schedule(raise_value_error)
        until(lambda: job_state(x, x.job).failed == 1, "x's closure to fail")
        ys = [y.schedule(nap_step, args=(0.0,)) for _ in range(10)]
        y.join(timeout=60)  # the bug: this raised x's error
        assert y.fetch(ys) == [0.0] * 10
        with pytest.raises(ValueError, match="bad batch 7") as info:
            x.join(timeout=60)
        assert info.value.__cause__.closure_id == bad.closure_id != 0
        assert f"closure {bad.closure_id} raised ValueError" in str(info.value.__cause__)
        x.join(timeout=60)  # reported once
    finally:
        x.shutdown()
        y.shutdown()


def test_a_job_with_a_long_queue_does_not_starve_a_second_job(daemon):
    big = RemoteCoordinator(daemon.settings())
    small = RemoteCoordinator(daemon.settings())
    try:
        big.wait_for_workers(1)
        total = 300
        for _ in range(total):
            big.schedule(nap_step, args=(0.02,))
        mine = [small.schedule(nap_step, args=(0.0,)) for _ in range(5)]
        before = job_state(big, big.job).done
        small.join(timeout=90)
        after = job_state(big, big.job).done
        assert small.fetch(mine) == [0.0] * 5
        assert before < total - 100  # the contrast: a FIFO would finish big's remaining queue first
        # round-robin: while small has work, big gets at most one dispatch per small one, plus what ran already
        assert after - before <= 12, (before, after)
        big.join(timeout=120)
        assert job_state(big, big.job).done == total
    finally:
        big.shutdown()
        small.shutdown()


CLIENT = textwrap.dedent("""
    import sys, threading, time
    import numpy as np
    import pscluster as ps
    from pscluster.coordinator.remote import RemoteCoordinator

    coord = RemoteCoordinator(ps.load_settings(sys.argv[1]))
    counter = coord.create_variable("killed_job_counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))

    def step():
        time.sleep(0.05)
        counter.push(np.array(-1, np.int64))

    for _ in range(200):
        coord.schedule(step)
    print("SCHEDULED", coord.job, flush=True)
    threading.Event().wait()  # until SIGKILL
""")


def test_a_sigkilled_clients_queued_closures_are_cancelled_after_the_idle_timeout(daemon, tmp_path):
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    client = subprocess.Popen([sys.executable, str(script), str(daemon.cluster_file)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    observer = RemoteCoordinator(daemon.settings())
    try:
        job = read_until(client, "SCHEDULED")[-1].split()[-1]
        until(lambda: job_state(observer, job).done >= 3, "the client's closures to run")
        os.kill(client.pid, signal.SIGKILL)
        client.wait(timeout=10)
        until(lambda: job_state(observer, job) is None, "the killed client's job to end")
        until(lambda: observer.status().running == 0, "the closures already running to finish")
        status = observer.status()
        assert status.queued == 0
        counter = observer.create_variable("killed_job_counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        ran = int(counter.pull())
        assert 3 <= ran < 200  # the rest were cancelled, not run
        out = subprocess.run([sys.executable, "-m", "pscluster.ops.cli", "status", "--cluster", str(daemon.cluster_file)],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
        assert "jobs" in out.stdout and observer.job in out.stdout
        killed = next(line for line in out.stdout.splitlines() if job in line)
        assert "ended: no keepalive" in killed, out.stdout  # still listed, with why it ended
    finally:
        if client.poll() is None:
            os.kill(client.pid, signal.SIGKILL)
            client.wait(timeout=10)
        client.stdout.close()
        observer.close()
    fresh = RemoteCoordinator(daemon.settings())  # the worker is free for new jobs
    try:
        assert fresh.schedule(nap_step, args=(0.0,)).fetch(timeout=60) == 0.0
    finally:
        fresh.shutdown()
