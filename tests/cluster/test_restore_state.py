"""A whole cluster restored from a checkpoint holds what the checkpointed one held, bit for bit: the next update
after the restore (Adam's m, v and update count t, and a learning rate changed before the save) equals the
update the uninterrupted cluster applies. (A resumed fit trains on this: tests/cluster/test_tutorial_resume.py.)"""

import shutil

import numpy as np
import pytest

import pscluster as ps

pytestmark = pytest.mark.cluster
SHAPES = {"conv": (32, 1, 3, 3), "dense": (128, 64), "bias": (128,)}  # one shard on each of 2 PS tasks or more


def grads(seed):
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape) * 0.01).astype(np.float32) for name, shape in SHAPES.items()}


def push(client, variables, seed):
    client.push([(variables[name], g) for name, g in grads(seed).items()])


@pytest.mark.timeout(60)
def test_the_update_after_a_whole_cluster_restore_equals_the_uninterrupted_clusters(fresh_cluster, tmp_path):
    rng = np.random.default_rng(0)
    first = fresh_cluster(2, 0, supervise=False, checkpoint_dir=tmp_path / "ckpt")
    with ps.PSClient(first.settings(), retry_for=5.0) as client:
        variables = {name: client.create_variable(name, initial_value=(rng.standard_normal(shape) * 0.05)
                                                  .astype(np.float32), optimizer=ps.Adam(1e-3))
                     for name, shape in SHAPES.items()}
        for seed in range(5):
            push(client, variables, seed)
        client.set_hyperparameters({"learning_rate": 5e-4})  # the rate a callback sets, checkpointed with the shards
        for seed in range(5, 8):
            push(client, variables, seed)
        client.checkpoint(8)
        shutil.copytree(tmp_path / "ckpt", tmp_path / "copy")
        push(client, variables, 99)
        uninterrupted = client.pull(list(variables.values()))
    first.stop()

    again = fresh_cluster(2, 0, supervise=False, checkpoint_dir=tmp_path / "copy", restore=True)
    with ps.PSClient(again.settings(), retry_for=5.0) as client:
        # the program creates its variables again, as a rerun does: the restored values stay
        variables = {name: client.create_variable(name, initial_value=np.zeros(shape, np.float32),
                                                  optimizer=ps.Adam(1e-3)) for name, shape in SHAPES.items()}
        push(client, variables, 99)
        restored = client.pull(list(variables.values()))
    for name, a, b in zip(SHAPES, uninterrupted, restored):
        np.testing.assert_array_equal(a, b, err_msg=name)
