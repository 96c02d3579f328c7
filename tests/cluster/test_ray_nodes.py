"""pscluster on a real multi-node Ray cluster on this machine (a head and a second raylet, all on 127.0.0.1).

The second node is taken away mid-run with its PS actor (and whatever worker actors Ray put there), a
worker actor is killed on top, and a fresh raylet joins: Ray restarts the PS on the new node, with a new
address; the job finds it through the directory actor and finishes with exact accounting.
"""

import time

import numpy as np
import pytest
import ray  # tests/conftest.py set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before any import of ray
from ray.cluster_utils import Cluster

import pscluster as ps
from tests.cluster.ray_helpers import wait_for_new_address
from tests.cluster.sockets import is_loopback, listening

# xdist_group: under `pytest -n 2 --dist loadgroup` the Ray tests of both files run on one
# worker, one after another: never two Ray clusters at once, each with its own raylets and dashboard.
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("ray")]

# A lost node is declared dead after about 5 s instead of Ray's default 15-30 s. Not faster: on a busy
# 2-core machine a raylet that just started misses 3 checks 500 ms apart and is declared dead itself.
FAST_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 5}
LOOPBACK_NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1"}


@pytest.fixture
def two_nodes():
    before = listening()
    nodes = Cluster(initialize_head=True, head_node_args={
        **LOOPBACK_NODE, "include_dashboard": False, "_system_config": FAST_HEALTH_CHECKS})
    try:
        nodes.add_node(**LOOPBACK_NODE)
        ray.init(address=nodes.address, log_to_driver=False, configure_logging=False)
        yield nodes, before
    finally:
        ray.shutdown()
        nodes.shutdown()  # kills every raylet, GCS and Ray worker process this cluster started


def two_counters_step(counters):
    time.sleep(0.01)
    for counter in counters:
        counter.push(np.array(-1, np.int64))
    return 1


@pytest.mark.timeout(300)
def test_a_lost_node_takes_a_ps_and_workers_ray_restarts_them_on_a_new_node_and_the_job_finds_them(two_nodes, tmp_path):
    from pscluster.ops.ray_launcher import RayCluster

    nodes, before = two_nodes
    cluster = RayCluster(num_ps=2, num_workers=2, checkpoint_dir=str(tmp_path / "ckpt")).start()
    coord = ps.ClusterCoordinator(cluster.settings(checkpoint_every_s=1.0), ps_resolver=cluster.resolver)
    try:
        coord.wait_for_workers(2, timeout=60)
        counters = [coord.create_variable(f"counter{i}", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
                    for i in range(2)]
        assert {c.shards[0].ps for c in counters} == {0, 1}
        ps_nodes = [cluster.ps_locations()[i][1] for i in range(2)]
        head = nodes.head_node.node_id
        assert head in ps_nodes and len(set(ps_nodes)) == 2, "one PS per node (STRICT_SPREAD)"
        victim = 1 - ps_nodes.index(head)  # the PS on the second node
        second = next(n for n in nodes.worker_nodes if n.node_id == ps_nodes[victim])
        old_address = cluster.resolver(victim)

        values = [coord.schedule(two_counters_step, args=(counters,)) for _ in range(300)]
        while coord.status().done < 60:
            time.sleep(0.01)
        worker = cluster.workers[0]
        workers_before = {w.worker_id for w in coord.status().workers if w.state == "alive"}
        nodes.remove_node(second, allow_graceful=False)  # the machine is gone: raylet, PS, its workers
        ray.kill(worker, no_restart=False)  # and a worker actor dies on top
        nodes.add_node(**LOOPBACK_NODE)  # a replacement machine joins
        new_address = wait_for_new_address(cluster, victim, old_address, timeout=120)

        coord.join(timeout=180)
        completed = sum(coord.fetch(values))
        assert completed == 300
        # (asked of the directory: a call to the restarted actor itself sometimes waits on Ray's actor
        # table for minutes after a node loss, though the PS serves)
        registered, new_node = cluster.ps_locations()[victim]
        assert registered == new_address and new_node not in (head, second.node_id), "restarted on the new node"
        assert coord.client.address(victim) == new_address != old_address
        lost = coord.lost_updates_by_variable()
        for counter in counters:
            assert int(counter.pull()) == completed - lost.get(counter.name, 0), lost
        coord.wait_for_workers(2, timeout=60)
        workers_after = {w.worker_id for w in coord.status().workers if w.state == "alive"}
        assert len(workers_after) == 2 and workers_after != workers_before, "the killed worker registered anew"
        beyond = [(a, p) for a, p in listening() - before if not is_loopback(a)]
        assert not beyond, f"listening beyond loopback: {beyond}"
    finally:
        coord.shutdown()
        cluster.stop()


@pytest.mark.timeout(240)
def test_deploy_ray_script_trains_on_a_local_ray_runtime_that_listens_on_loopback_only():
    """deploy/ray/train_on_ray.py as a user runs it: nothing of Ray or pscluster listens beyond 127.0.0.1."""
    import os
    import pathlib
    import signal
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "ray" / "train_on_ray.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    before = listening()
    proc = subprocess.Popen([sys.executable, str(script), "--steps", "300"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    seen: set[tuple[str, str]] = set()
    try:
        deadline = time.monotonic() + 200
        while proc.poll() is None:
            assert time.monotonic() < deadline, "train_on_ray.py did not finish"
            seen |= listening() - before
            time.sleep(0.2)
        output = proc.stdout.read()
        assert proc.returncode == 0, output[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # its own session: the script and the Ray processes it started
            proc.wait(timeout=30)
        proc.stdout.close()
    accuracy = float(output.rsplit("held-out accuracy:", 1)[1].split()[0])
    assert accuracy > 0.8, output[-2000:]
    assert any("raylet" in p or "gcs_server" in p for _, p in seen), "Ray's servers were seen listening"
    beyond = [(a, p) for a, p in seen if not is_loopback(a)]
    assert not beyond, f"listening beyond loopback: {beyond}"
