"""pscluster.jax on real daemons: exact updates of dense leaves and table rows, sync mode, errors, export."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pscluster as ps
import pscluster.jax as ps_jax
from pscluster.errors import InvalidArgumentError

pytestmark = pytest.mark.cluster


def init():
    rng = np.random.default_rng(0)
    return {"emb": jnp.asarray(rng.normal(size=(1000, 4)), jnp.float32),
            "dense": {"w": jnp.asarray(rng.normal(size=(4, 2)), jnp.float32), "b": jnp.zeros(2)}}


def loss_fn(params, ids):
    h = params["emb"][ids] @ params["dense"]["w"] + params["dense"]["b"]
    return jnp.sum(jnp.tanh(h))


def sparse_step(model, batch):
    pulled = model.pull(ids={"emb": batch})
    assert pulled.params["emb"].shape == (len(set(batch)), 4)
    model.push(jax.grad(loss_fn)(pulled.params, pulled.ids["emb"]))
    return pulled.ids["emb"].tolist()


def test_dense_leaves_and_touched_rows_get_exactly_one_sgd_update(fresh_cluster, tmp_path):
    from safetensors.numpy import load_file

    cluster = fresh_cluster(2, 1, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(1)
        params = init()
        model = ps_jax.PSParams(coord, params, ps_jax.SGD(0.5), sparse=["emb"],
                                partitioner=ps.FixedShardsPartitioner(2))
        assert {pl.ps for pl in model.variables["emb"].shards} == {0, 1}
        batch = [7, 3, 7, 900]
        assert coord.schedule(sparse_step, args=(model, batch)).fetch() == [1, 0, 1, 2]
        grads = jax.grad(lambda p: loss_fn(p, jnp.asarray(batch)))(params)  # the same step in one process
        want = jax.tree_util.tree_map(lambda p, g: np.asarray(p) - 0.5 * np.asarray(g), params, grads)
        got = model.state()
        for name in ("w", "b"):
            np.testing.assert_allclose(got["dense"][name], want["dense"][name], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["emb"], want["emb"], rtol=1e-5, atol=1e-6)
        untouched = np.setdiff1d(np.arange(1000), batch)
        np.testing.assert_array_equal(got["emb"][untouched], np.asarray(params["emb"])[untouched])
        coord.client.export(str(tmp_path / "model.safetensors"))
        exported = load_file(str(tmp_path / "model.safetensors"))
        np.testing.assert_array_equal(exported["dense/w"], got["dense"]["w"])
    finally:
        coord.shutdown()


def bad_ids_step(model):
    model.pull(ids={"emb": [5, 1000]})


def dense_step(model):
    pulled = model.pull(ids={"emb": [0]})
    grads = jax.tree_util.tree_map(jnp.ones_like, pulled.params)
    model.push(grads)


def test_bad_ids_fail_the_closure_with_a_precise_error_and_change_nothing(fresh_cluster):
    cluster = fresh_cluster(1, 1, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(1)
        model = ps_jax.PSParams(coord, init(), ps_jax.SGD(1.0), sparse=["emb"])
        before = model.state()
        with pytest.raises(InvalidArgumentError, match=r"emb: id 1000 outside the table's rows \[0, 1000\)"):
            coord.schedule(bad_ids_step, args=(model,)).fetch()
        after = model.state()
        for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after)):
            np.testing.assert_array_equal(a, b)
    finally:
        coord.shutdown()


def test_sync_mode_averages_the_replicas_of_each_step(fresh_cluster):
    cluster = fresh_cluster(1, 2, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(2)
        coord.configure_sync("sync", replicas_to_aggregate=2, total_num_replicas=2)
        model = ps_jax.PSParams(coord, init(), ps_jax.SGD(0.25), sparse=["emb"])
        start = model.state()
        for _ in range(4):
            coord.schedule(dense_step, args=(model,))
        coord.join(timeout=60)
        got = model.state()
        # 4 closures = 2 steps of 2 replicas, each replica's gradient ones: 2 updates of 0.25 each
        np.testing.assert_allclose(got["dense"]["w"], np.asarray(start["dense"]["w"]) - 0.5, rtol=0, atol=1e-6)
        np.testing.assert_allclose(got["emb"][0], np.asarray(start["emb"][0]) - 0.5, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(got["emb"][1:], np.asarray(start["emb"][1:]))
        assert coord.sync_stats()["global_step"] == 2
    finally:
        coord.shutdown()


def test_a_table_given_by_shape_lives_only_on_the_ps(fresh_cluster):
    cluster = fresh_cluster(2, 1, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(1)
        params = {"emb": jax.ShapeDtypeStruct((200_000, 4), jnp.float32),
                  "dense": {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}}
        model = ps_jax.PSParams(coord, params, ps_jax.Adam(0.1), sparse=["emb"],
                                partitioner=ps.FixedShardsPartitioner(2))
        assert coord.schedule(sparse_step, args=(model, [199_999, 0])).fetch() == [1, 0]
        table = model.state()["emb"]
        assert table.shape == (200_000, 4) and 0.9 < table[1:-1].std() < 1.1  # N(0, 1) from the PS
    finally:
        coord.shutdown()
