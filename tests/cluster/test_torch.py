"""pscluster.torch on real PS and worker daemons: dense and sparse models, sync mode, state_dict, export."""

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

import pscluster as ps
import pscluster.torch as ps_torch
from pscluster.errors import InvalidArgumentError
from tests.cluster.procs import make_coord  # noqa: F401 - the fixture: embedded and remote coordinator

pytestmark = pytest.mark.cluster
LR = 0.1


class Dense(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Linear: parameters, running statistics and a batch counter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(5, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def batch(step, replica):
    rng = np.random.default_rng([step, replica])
    return torch.from_numpy(rng.normal(size=(16, 5))), torch.from_numpy(rng.integers(0, 3, 16))


def sync_step(model):
    token = ps.sync_token()
    x, y = batch(token.step, token.replica)
    net = model.pull()
    F.cross_entropy(net(x), y).backward()
    model.push()
    return token.step


def reference_sync(net, steps, replicas):
    """The policy in plain torch: mean gradient of the replicas' batches, mean change of their buffers."""
    for step in range(steps):
        grads, buffers = [], []
        for r in range(replicas):
            replica = copy.deepcopy(net)
            F.cross_entropy(replica(batch(step, r)[0]), batch(step, r)[1]).backward()
            grads.append([p.grad for p in replica.parameters()])
            buffers.append([b.clone() for b in replica.buffers()])
        with torch.no_grad():
            for i, p in enumerate(net.parameters()):
                p -= LR * torch.stack([g[i] for g in grads]).mean(0)
            for i, b in enumerate(net.buffers()):
                change = torch.stack([(bs[i] - b).double() for bs in buffers]).mean(0)
                b += change.to(b.dtype)
    return net


def test_sync_training_of_a_dense_module_equals_torch_on_the_mean_gradient(fresh_cluster, make_coord):
    cluster = fresh_cluster(2, 2, supervise=False)
    coord = make_coord(cluster)
    try:
        coord.wait_for_workers(2)
        net = Dense().double()
        model = ps_torch.PSModule(coord, net, ps_torch.SGD(lr=LR), partitioner=ps.FixedShardsPartitioner(2))
        assert {pl.ps for pl in model.variables["fc1.weight"].shards} == {0, 1}
        coord.configure_sync("sync", replicas_to_aggregate=2, total_num_replicas=2)
        steps = 5
        results = [coord.schedule(sync_step, args=(model,)) for _ in range(2 * steps)]
        coord.join(timeout=120)
        assert sorted(coord.fetch(results)) == sorted(list(range(steps)) * 2)
        trained = model.state_dict()
        want = reference_sync(Dense().double(), steps, 2).state_dict()
        assert list(trained) == [k for k in want if k in trained] and set(trained) == set(want)
        for name, value in want.items():
            np.testing.assert_allclose(trained[name].numpy(), value.numpy(), rtol=1e-9, atol=1e-12, err_msg=name)
        assert int(trained["bn.num_batches_tracked"]) == steps
        net.load_state_dict(trained)  # strict: every key of the module, nothing else
    finally:
        coord.shutdown()


class Tables(nn.Module):
    """A sparse Embedding and a sparse EmbeddingBag (sum) into one linear score."""

    def __init__(self, rows=1000, device=None):
        super().__init__()
        torch.manual_seed(1)
        self.user = nn.Embedding(rows, 4, sparse=True, device=device)
        self.tags = nn.EmbeddingBag(rows, 4, mode="sum", sparse=True, device=device)
        self.out = nn.Linear(8, 1)

    def forward(self, users, tags, offsets):
        return self.out(torch.cat([self.user(users), self.tags(tags, offsets)], 1)).squeeze(1)


def sparse_batch(step):
    rng = np.random.default_rng(step)
    users = torch.from_numpy(rng.integers(0, 50, 8))
    tags = torch.from_numpy(rng.integers(900, 1000, 12))
    return users, tags, torch.tensor([0, 2, 3, 5, 6, 8, 9, 11]), torch.from_numpy(rng.normal(size=8))


def sparse_step(model, step):
    users, tags, offsets, y = sparse_batch(step)
    net = model.pull(ids={"user": users, "tags": tags})
    F.mse_loss(net(users, tags, offsets), y).backward()
    model.push()
    return tuple(net.user.weight.shape), tuple(net.tags.weight.shape)


def test_sparse_tables_pull_and_push_only_touched_rows_and_match_torch(fresh_cluster):
    cluster = fresh_cluster(2, 2, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(2)
        net = Tables()
        model = ps_torch.PSModule(coord, net, ps_torch.SGD(lr=LR), partitioner=ps.FixedShardsPartitioner(2))
        assert model.variables["user.weight"].sparse and not model.variables["out.weight"].sparse
        shapes = []
        for step in range(3):  # one closure at a time: an exact sequence of SGD steps
            shapes.append(coord.schedule(sparse_step, args=(model, step)).fetch())
        for step, (user_shape, tags_shape) in enumerate(shapes):  # the workers held only the batch's rows
            users, tags, _, _ = sparse_batch(step)
            assert user_shape == (len(np.unique(users)), 4) and tags_shape == (len(np.unique(tags)), 4)
        want = Tables()
        opt = torch.optim.SGD(want.parameters(), lr=LR)
        for step in range(3):
            users, tags, offsets, y = sparse_batch(step)
            opt.zero_grad()
            F.mse_loss(want(users, tags, offsets), y).backward()
            opt.step()
        trained = model.state_dict()
        for name, value in want.state_dict().items():
            np.testing.assert_allclose(trained[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
        untouched = np.setdiff1d(np.arange(1000), np.concatenate([sparse_batch(s)[0].numpy() for s in range(3)]))
        np.testing.assert_array_equal(trained["user.weight"].numpy()[untouched], net.user.weight.detach().numpy()[untouched])
    finally:
        coord.shutdown()


def test_bad_ids_get_precise_errors_and_push_nothing(fresh_cluster):
    cluster = fresh_cluster(1, 0, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        model = ps_torch.PSModule(coord, Tables(rows=100), ps_torch.SGD(lr=LR))
        before = model.state_dict()
        users, tags, offsets, y = sparse_batch(0)
        with pytest.raises(InvalidArgumentError, match=r"tags: id 9\d\d outside the table's rows \[0, 100\)"):
            model.pull(ids={"user": users, "tags": tags})
        with pytest.raises(InvalidArgumentError, match=r"got ids for unknown \['usr'\] and none for \['user'\]"):
            model.pull(ids={"usr": users, "tags": tags % 100})
        net = model.pull(ids={"user": users[:4], "tags": tags % 100})
        with pytest.raises(InvalidArgumentError, match=r"user: id \d+ was not pulled this step"):
            net(users, tags % 100, offsets)
        after = model.state_dict()
        for name in before:
            np.testing.assert_array_equal(after[name].numpy(), before[name].numpy(), err_msg=name)
        with pytest.raises(InvalidArgumentError, match="max_norm is not supported"):
            ps_torch.PSModule(coord, nn.Embedding(10, 2, sparse=True, max_norm=1.0), prefix="bad.")
    finally:
        coord.shutdown()


def test_meta_table_is_initialised_on_the_ps_and_exports_to_a_loadable_file(fresh_cluster, tmp_path):
    from safetensors.torch import load_file

    cluster = fresh_cluster(2, 1, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(1)
        net = Tables(rows=200_000, device="meta")  # the driver never holds the tables
        model = ps_torch.PSModule(coord, net, ps_torch.Adagrad(lr=0.1), partitioner=ps.FixedShardsPartitioner(2))
        coord.schedule(sparse_step, args=(model, 0)).fetch()
        coord.client.export(str(tmp_path / "model.safetensors"))
        exported = load_file(str(tmp_path / "model.safetensors"))
        loaded = Tables(rows=200_000)
        loaded.load_state_dict(exported)  # strict: the file holds exactly the module's state
        table = exported["user.weight"].numpy()
        assert table.shape == (200_000, 4) and 0.9 < table.std() < 1.1  # N(0, 1), as torch initialises
        np.testing.assert_array_equal(table, model.state_dict()["user.weight"].numpy())
    finally:
        coord.shutdown()


def test_padding_row_keeps_its_meaning_on_the_local_table(fresh_cluster):
    cluster = fresh_cluster(1, 0, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        net = nn.Embedding(50, 3, padding_idx=7, sparse=True)
        model = ps_torch.PSModule(coord, net, ps_torch.SGD(lr=1.0))
        before = model.state_dict()["weight"].numpy().copy()
        ids = torch.tensor([7, 3, 7, 9])
        model.pull(ids={"": ids})(ids).sum().backward()
        model.push()
        after = model.state_dict()["weight"].numpy()
        np.testing.assert_array_equal(after[7], before[7])  # the padding row gets no gradient
        np.testing.assert_allclose(after[[3, 9]], before[[3, 9]] - 1.0, rtol=1e-6)
        np.testing.assert_array_equal(np.delete(after, [3, 7, 9], 0), np.delete(before, [3, 7, 9], 0))
    finally:
        coord.shutdown()


def replica_of(model):
    import os
    import threading

    model.pull()
    return os.getpid(), threading.get_ident(), model._replica().serial


def test_a_model_passed_as_an_argument_reuses_its_worker_replicas(fresh_cluster):
    cluster = fresh_cluster(1, 1, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(1)
        model = ps_torch.PSModule(coord, Dense(), ps_torch.SGD(lr=LR))
        seen = {}
        for _ in range(6):  # pickled with every closure: unpickled 6 times on the worker
            pid, thread, serial = coord.schedule(replica_of, args=(model,)).fetch()
            assert seen.setdefault((pid, thread), serial) == serial
        assert len(seen) < 6  # some thread ran two of them: the check above compared something
    finally:
        coord.shutdown()


@pytest.mark.parametrize("case, message", [
    ("shape", r"w: pull target float32\[3, 4\] must be a writable C-contiguous float32\[4, 3\]"),
    ("dtype", r"w: pull target float64\[4, 3\] must be"),
    ("layout", r"w: pull target float32\[4, 3\] must be a writable C-contiguous"),
    ("rows", r"t: row id 10 outside \[0, 10\)"),
    ("row_shape", r"t: pull target float32\[3, 2\] must be a writable C-contiguous float32\[2, 2\]"),
])
def test_pull_into_bad_targets_get_precise_errors_and_fill_nothing(fresh_cluster, case, message):
    cluster = fresh_cluster(1, 0, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        w = coord.create_variable("w", initial_value=np.ones((4, 3), np.float32))
        t = coord.create_variable("t", initial_value=np.ones((10, 2), np.float32), sparse=True)
        good = np.zeros((4, 3), np.float32)
        dense = {"shape": np.zeros((3, 4), np.float32), "dtype": np.zeros((4, 3)),
                 "layout": np.zeros((3, 4), np.float32).T}.get(case, np.zeros((4, 3), np.float32))
        ids = np.array([1, 10]) if case == "rows" else np.array([1, 2])
        rows_out = np.zeros((3 if case == "row_shape" else 2, 2), np.float32)
        with pytest.raises(InvalidArgumentError, match=message):
            coord.client.pull_into([(w, good), (w, dense)], rows=[(t, ids, rows_out)])
        assert not good.any() and not rows_out.any()  # validated before any request
        coord.client.pull_into([(w, good)], rows=[(t, np.array([2, 1]), rows_out[:2])])  # unsorted ids: scattered
        assert good.all() and rows_out[:2].all()
    finally:
        coord.shutdown()


def test_a_module_that_cannot_live_on_the_ps_creates_no_variable(fresh_cluster):
    cluster = fresh_cluster(1, 0, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        half = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3).to(torch.float8_e4m3fn))
        with pytest.raises(InvalidArgumentError, match=r"1.weight: dtype torch.float8_e4m3fn has no PS equivalent"):
            ps_torch.PSModule(coord, half)
        meta = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta"))
        with pytest.raises(InvalidArgumentError, match="1.weight: only a sparse table may live on the meta device"):
            ps_torch.PSModule(coord, meta)
        assert coord.client.discover() == {}
    finally:
        coord.shutdown()


def test_one_pull_and_one_push_request_per_ps_task_per_step(fresh_cluster):
    from tests.cluster.test_operations import metric, ready_field, scrape

    cluster = fresh_cluster(2, 0, supervise=False, env={"PSCLUSTER_METRICS_PORT": "0"})
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        model = ps_torch.PSModule(coord, Tables(), ps_torch.SGD(lr=LR), partitioner=ps.FixedShardsPartitioner(2))
        shards = [pl.ps for v in model.variables.values() for pl in v.shards]
        assert sorted(shards) == [0, 0, 0, 1, 1, 1]  # 4 variables in 6 shards (out has one row)

        def requests(op):
            labels = f'{{op="{op}",transport="bulk"}}'
            return [metric(scrape(ready_field(d, "metrics")), "pscluster_ps_requests_total", labels) for d in cluster.ps]

        def step(k):
            users, tags, offsets, y = sparse_batch(k)
            F.mse_loss(model.pull(ids={"user": users, "tags": tags})(users, tags, offsets), y).backward()
            model.push()

        step(0)  # the counters exist from the first request on
        before = requests("pull"), requests("push")
        for k in range(3):
            step(k)
        after = requests("pull"), requests("push")
        assert [a - b for a, b in zip(after[0], before[0])] == [3, 3]
        assert [a - b for a, b in zip(after[1], before[1])] == [3, 3]
    finally:
        coord.shutdown()
