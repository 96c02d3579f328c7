"""A bad gradient never poisons the model, on real daemons: a push holding NaN or Inf in a variable
of one PS is refused whole before it leaves the worker (neither PS applies a part), or skipped; in a
sync job the skipped step is applied nowhere and the next steps run."""

import copy

import numpy as np
import pytest
import torch
from pscluster.proto import pscluster_pb2 as pb
from torch.nn import functional as F  # noqa: N812

import pscluster as ps
import pscluster.torch as ps_torch
from pscluster.client import variables
from pscluster.errors import NonFiniteGradientError
from pscluster.ops.launcher import LocalCluster
from tests.cluster.test_torch import LR, Dense, batch, reference_sync

pytestmark = pytest.mark.cluster


def shard_versions(client):
    listings = client._gather([(i, "ListShards", pb.ListShardsRequest()) for i in range(client.num_ps)])
    return {(s.spec.variable, s.spec.shard_index): s.version for reply in listings for s in reply.shards}


@pytest.fixture(scope="module")
def two_ps(tmp_path_factory):
    cluster = LocalCluster(2, 0, workdir=tmp_path_factory.mktemp("nonfinite"), supervise=False)
    cluster.start()
    yield cluster
    cluster.stop()


def test_a_nan_in_one_ps_variable_is_refused_whole_and_changes_nothing_on_either_ps(two_ps):
    with ps.PSClient(two_ps.settings()) as client:
        a = client.create_variable("a", initial_value=np.ones((4, 3), np.float32), optimizer=ps.Adam(0.1))
        b = client.create_variable("b", initial_value=np.ones(3, np.float32), optimizer=ps.Adam(0.1))
        assert (a.shards[0].ps, b.shards[0].ps) == (0, 1)
        client.push([(a, np.ones((4, 3), np.float32)), (b, np.ones(3, np.float32))])
        before, versions = client.pull([a, b]), shard_versions(client)
        bad = np.ones(3, np.float32)
        bad[1] = np.nan
        with pytest.raises(NonFiniteGradientError, match=r"'b' \(1 of 3 values\)") as info:
            client.push([(a, np.full((4, 3), 5.0, np.float32)), (b, bad)])
        assert info.value.variables == ("b",)
        assert client.push([(a, np.full((4, 3), 5.0, np.float32)), (b, bad)], nonfinite="skip") == []
        after = client.pull([a, b])
        assert all(np.array_equal(x, y) for x, y in zip(before, after))
        assert shard_versions(client) == versions  # Adam's update count (bias correction) unchanged too
        assert client.nonfinite_counts() == {"rejected": 1, "skipped": 1}
        client.push([(a, np.ones((4, 3), np.float32)), (b, np.ones(3, np.float32))], max_norm=1e-3)
        assert all(v == versions[k] + 1 for k, v in shard_versions(client).items())


def test_psmodule_clips_its_gradients_by_global_norm_as_torch_and_leaves_buffers_alone(two_ps):
    x, y = batch(0, 0)
    want = Dense().double()
    F.cross_entropy(want(x), y).backward()
    torch.nn.utils.clip_grad_norm_(want.parameters(), 0.5, norm_type=2.0)
    with torch.no_grad():
        for p in want.parameters():
            p -= LR * p.grad
    with ps.PSClient(two_ps.settings()) as client:
        variables.set_default_client(client)
        try:
            model = ps_torch.PSModule(client, Dense().double(), ps_torch.SGD(lr=LR), prefix="clip/",
                                      partitioner=ps.FixedShardsPartitioner(2), max_norm=0.5)
            F.cross_entropy(model.pull()(x), y).backward()
            model.push()
            got = model.state_dict()
        finally:
            variables.set_default_client(None)
    for key, value in want.state_dict().items():  # running statistics: the batch's own change, unclipped
        np.testing.assert_allclose(got[key].numpy(), value.numpy(), rtol=1e-9, atol=1e-12, err_msg=key)


def test_jax_params_refuse_or_skip_a_nan_and_clip_by_global_norm_as_optax(two_ps):
    import jax.numpy as jnp
    import optax

    import pscluster.jax as ps_jax

    params = {"w": np.ones((4, 3)), "emb": np.ones((6, 2))}
    grads = {"w": np.full((4, 3), 2.0), "emb": np.full((2, 2), 3.0)}  # emb: the rows of ids [1, 4]
    dense_grads = {"w": grads["w"], "emb": np.zeros((6, 2))}
    dense_grads["emb"][[1, 4]] = grads["emb"]
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1))
    updates, _ = tx.update(jax_tree(dense_grads, jnp), tx.init(jax_tree(params, jnp)))
    want = {k: params[k] + np.asarray(updates[k]) for k in params}
    with ps.PSClient(two_ps.settings()) as client:
        variables.set_default_client(client)
        try:
            model = ps_jax.PSParams(client, params, ps_jax.sgd(0.1), sparse=["emb"], prefix="jaxclip/", max_norm=0.5,
                                    partitioner=ps.FixedShardsPartitioner(2))
            model.pull(ids={"emb": np.array([1, 4])})
            bad = {"w": grads["w"].copy(), "emb": grads["emb"]}
            bad["w"][0, 0] = np.inf
            with pytest.raises(NonFiniteGradientError, match=r"'jaxclip/w' \(1 of 12 values\)"):
                model.push(bad)
            model.nonfinite = "skip"
            assert model.push(bad) == []
            np.testing.assert_array_equal(model.state()["w"], params["w"])  # neither PS applied anything
            assert model.push(grads)
            got = model.state()
        finally:
            variables.set_default_client(None)
    for key in want:  # the table's norm counts only the pushed rows, as their zero elsewhere adds nothing
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=key)


def jax_tree(tree, jnp):
    return {k: jnp.asarray(v, dtype=jnp.float32) for k, v in tree.items()}


def poisoned_sync_step(model, bad_step):
    token = ps.sync_token()
    x, y = batch(token.step, token.replica)
    if token.step == bad_step and token.replica == 0:
        x = x * float("inf")  # an fp16-style overflow on one replica
    net = model.pull()
    F.cross_entropy(net(x), y).backward()
    versions = model.push()
    return token.step, len(versions)


def test_a_sync_step_with_a_non_finite_replica_is_skipped_everywhere_and_training_goes_on(fresh_cluster):
    cluster = fresh_cluster(2, 2, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings(heartbeat_timeout_s=30.0))  # 2 busy cores: no false deaths
    try:
        coord.wait_for_workers(2)
        model = ps_torch.PSModule(coord, Dense().double(), ps_torch.SGD(lr=LR), nonfinite="skip",
                                  partitioner=ps.FixedShardsPartitioner(2))
        coord.configure_sync("sync", replicas_to_aggregate=2, total_num_replicas=2)
        steps, bad = 4, 1
        results = [coord.schedule(poisoned_sync_step, args=(model, bad)) for _ in range(2 * steps)]
        coord.join(timeout=60)
        done = sorted(coord.fetch(results))
        assert [s for s, _ in done] == sorted(list(range(steps)) * 2)
        skipper, peer = sorted(n for s, n in done if s == bad)
        assert skipper == 0 and peer > 0  # the skipper's push returned [], its peer's every shard version
        # the reference: the same sync training with step `bad` left out entirely
        net = Dense().double()
        reference_sync(net, bad, 2)
        rest = copy.deepcopy(net)
        for step in range(bad + 1, steps):
            _one_sync_step(rest, step)
        want = rest.state_dict()
        for key, value in model.state_dict().items():
            np.testing.assert_allclose(value.numpy(), want[key].numpy(), rtol=1e-9, atol=1e-12, err_msg=key)
    finally:
        coord.shutdown()


def _one_sync_step(net, step, replicas=2):
    grads, buffers = [], []
    for r in range(replicas):
        replica = copy.deepcopy(net)
        x, y = batch(step, r)
        F.cross_entropy(replica(x), y).backward()
        grads.append([p.grad for p in replica.parameters()])
        buffers.append([b.clone() for b in replica.buffers()])
    with torch.no_grad():
        for i, p in enumerate(net.parameters()):
            p -= LR * torch.stack([g[i] for g in grads]).mean(0)
        for i, b in enumerate(net.buffers()):
            b += torch.stack([(bs[i] - b).double() for bs in buffers]).mean(0).to(b.dtype)
