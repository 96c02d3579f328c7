"""Runnable counterparts of TensorFlow's parameter-server APIs (see docs/tensorflow.md).

    python examples/from_tensorflow.py            # runs every section on a local cluster
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import pscluster as ps
from pscluster.ops.launcher import LocalCluster


def parameter_server_strategy(cluster: LocalCluster) -> None:
    """tf.distribute.ParameterServerStrategy: variables on PS tasks, sharded by a partitioner."""
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        # strategy = tf.distribute.ParameterServerStrategy(resolver,
        #     variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner(...))
        # with strategy.scope(): emb = tf.Variable(tf.zeros([1000, 16]))
        emb = coord.create_variable("pss_emb", shape=(1000, 16), sparse=True, optimizer=ps.Adagrad(0.1),
                                    partitioner=ps.MinSizePartitioner(min_shard_bytes=16 << 10, max_shards=4))
        print(f"ParameterServerStrategy: {emb.name} in {emb.num_shards} shards on PS "
              f"{[pl.ps for pl in emb.shards]}")
    finally:
        coord.shutdown()


def cluster_coordinator(cluster: LocalCluster) -> None:
    """tf.distribute.coordinator.ClusterCoordinator: schedule / join / fetch, per-worker datasets."""
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(len(cluster.workers))
        w = coord.create_variable("cc_w", initial_value=np.zeros(3, np.float32), optimizer=ps.SGD(0.1))

        def dataset_fn(info=None):  # receives a WorkerInfo (worker_id, worker_index) on each worker
            rng = np.random.default_rng(0 if info is None else info.worker_index)
            while True:
                yield rng.normal(size=3).astype(np.float32) + np.array([1, 2, 3], np.float32)

        per_worker_iter = iter(coord.create_per_worker_dataset(dataset_fn))

        def step_fn(iterator):  # @tf.function def step_fn(iterator): ...
            target = next(iterator)
            grad = w.pull() - target  # d/dw 0.5 |w - target|^2
            w.push(grad)
            return float(np.square(grad).sum())

        losses = [coord.schedule(step_fn, args=(per_worker_iter,)) for _ in range(200)]
        coord.join()
        print(f"ClusterCoordinator: loss {coord.fetch(losses[0]):.2f} -> {coord.fetch(losses[-1]):.2f}; "
              f"w = {np.round(w.pull(), 1)}")
    finally:
        coord.shutdown()


def sync_replicas_optimizer(cluster: LocalCluster) -> None:
    """tf.compat.v1.train.SyncReplicasOptimizer(opt, replicas_to_aggregate, total_num_replicas)."""
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(len(cluster.workers))
        w = coord.create_variable("sync_w", initial_value=np.zeros(2), optimizer=ps.SGD(1.0))
        coord.configure_sync("sync", replicas_to_aggregate=2, total_num_replicas=2)

        def step_fn():
            token = ps.sync_token()  # the global step this gradient belongs to
            w.push(np.full(2, -(token.replica + 1.0)))  # replica 0 pushes -1, replica 1 pushes -2
            return token.step

        coord.fetch([coord.schedule(step_fn) for _ in range(10)])
        stats = coord.sync_stats()
        print(f"SyncReplicasOptimizer: {stats['global_step']} global steps, each applying the mean of 2 "
              f"gradients: w = {w.pull()}")
        coord.configure_sync("async")
    finally:
        coord.shutdown()


def replica_device_setter(cluster: LocalCluster) -> None:
    """tf.compat.v1.train.replica_device_setter(ps_tasks=P): variables round-robin over PS tasks."""
    with ps.PSClient(cluster.settings()) as client:
        names = [f"rds_{i}" for i in range(4)]
        placed = [client.create_variable(n, shape=(8,)) for n in names]
        print("replica_device_setter: " + ", ".join(f"{v.name} -> /job:ps/task:{v.shards[0].ps}" for v in placed))


def tf_config(cluster: LocalCluster) -> None:
    """TF_CONFIG: the same JSON configures pscluster ("chief" is the coordinator)."""
    spec = cluster.spec
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"ps": spec["ps"], "chief": [spec["coordinator"]]},
                                          "task": {"type": "chief", "index": 0}})
    try:
        settings = ps.load_settings()
        print(f"TF_CONFIG: task {settings.task_type}, PS tasks {settings.cluster.ps}")
    finally:
        del os.environ["TF_CONFIG"]


SECTIONS = [parameter_server_strategy, cluster_coordinator, sync_replicas_optimizer, replica_device_setter, tf_config]


def main() -> int:
    """Run every section on one local cluster (2 PS, 2 workers)."""
    with LocalCluster(2, 2) as cluster:
        for section in SECTIONS:
            section(cluster)
    return 0


if __name__ == "__main__":
    sys.exit(main())
