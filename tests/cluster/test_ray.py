"""pscluster on a real local Ray runtime, kept on loopback: train, kill a worker actor, exact counter."""

import time

import numpy as np
import pytest
import ray  # tests/conftest.py set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before any import of ray

import pscluster as ps
from tests.cluster.ray_helpers import wait_for_new_address
from tests.cluster.sockets import is_loopback, listening

# xdist_group: under `pytest -n 2 --dist loadgroup` the Ray tests of both files run on one
# worker, one after another: never two Ray clusters at once, each with its own raylets and dashboard.
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("ray")]


@pytest.fixture(scope="module")
def local_ray():
    before = listening()
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False)
    try:
        yield before
    finally:
        ray.shutdown()


def counter_step(counter):
    time.sleep(0.01)
    counter.push(np.array(-1, np.int64))
    return 1


def test_train_on_ray_kill_a_worker_actor_counter_is_exact_and_all_on_loopback(local_ray):
    from pscluster.ops.ray_launcher import RayCluster

    cluster = RayCluster(num_ps=2, num_workers=2).start()
    coord = ps.ClusterCoordinator(cluster.settings(), ps_resolver=cluster.resolver)
    try:
        coord.wait_for_workers(2, timeout=60)
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        w = coord.create_variable("w", initial_value=np.zeros((8, 2), np.float32),
                                  partitioner=ps.FixedShardsPartitioner(2), optimizer=ps.SGD(0.5))
        assert {pl.ps for pl in w.shards} == {0, 1}
        values = [coord.schedule(counter_step, args=(counter,)) for _ in range(200)]
        while coord.status().done < 60:
            time.sleep(0.01)
        victim = cluster.workers[0]
        old_pid = ray.get(victim.pid.remote())
        ray.kill(victim, no_restart=False)  # Ray restarts the actor; it registers again
        coord.join(timeout=120)
        assert int(counter.pull()) == 200 and sum(coord.fetch(values)) == 200
        assert ray.get(victim.pid.remote(), timeout=60) != old_pid
        coord.wait_for_workers(2, timeout=60)
        new = listening() - local_ray
        assert new, "Ray and pscluster listen somewhere"
        beyond = [(a, p) for a, p in new if not is_loopback(a)]
        assert not beyond, f"listening beyond loopback: {beyond}"
    finally:
        coord.shutdown()
        cluster.stop()


def test_a_ps_actor_restarted_by_ray_with_a_new_address_is_found_and_accounting_stays_exact(local_ray, tmp_path):
    from pscluster.ops.ray_launcher import RayCluster

    cluster = RayCluster(num_ps=2, num_workers=2, checkpoint_dir=str(tmp_path / "ckpt")).start()
    coord = ps.ClusterCoordinator(cluster.settings(checkpoint_every_s=1.0), ps_resolver=cluster.resolver)
    try:
        coord.wait_for_workers(2, timeout=60)
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        values = [coord.schedule(counter_step, args=(counter,)) for _ in range(300)]
        while coord.status().done < 60:
            time.sleep(0.01)
        victim = counter.shards[0].ps
        old_address = cluster.resolver(victim)
        old_pid = ray.get(cluster.ps[victim].pid.remote())
        ray.kill(cluster.ps[victim], no_restart=False)  # Ray restarts it: any free port, its newest checkpoint
        new_address = wait_for_new_address(cluster, victim, old_address, timeout=90)
        coord.join(timeout=120)
        completed = sum(coord.fetch(values))
        assert completed == 300 and ray.get(cluster.ps[victim].pid.remote(), timeout=60) != old_pid
        # the coordinator (and the worker actors, whose pushes went on) found the PS at its new address
        assert coord.client.address(victim) == new_address != old_address
        lost = coord.lost_updates_by_variable().get("counter", 0)
        assert int(counter.pull()) == completed - lost
    finally:
        coord.shutdown()
        cluster.stop()
