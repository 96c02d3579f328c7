"""Hash-keyed dynamic tables on two real PS daemons: keys by hash, admission, checkpoint + SIGKILL."""

import numpy as np
import pytest
from pscluster.server.dynamic_table import DynamicTable

import pscluster as ps
from pscluster.errors import AlreadyExistsError, InvalidArgumentError, ResourceExhaustedError
from pscluster.ops.launcher import LocalCluster
from pscluster.tables import Admission, TableConfig, shard_of

pytestmark = pytest.mark.cluster
EDGE = np.array([0, -1, 2**63 - 1, -(2**63), 12345], np.int64)
CFG = TableConfig(dim=4, capacity=1_000, initializer="normal", init_value=0.1, admission=Admission("counter", min_count=2))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(2, 0, workdir=tmp_path_factory.mktemp("dyn"), supervise=False)
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with ps.PSClient(cluster.settings()) as c:
        yield c


def reference(pushes: list[tuple[np.ndarray, np.ndarray]], keys: np.ndarray) -> np.ndarray:
    """The same pushes on in-process shards (every push reaches both, as the client sends it)."""
    shards = [DynamicTable(CFG, ps.Adagrad(0.1)) for _ in range(2)]
    for k, g in pushes:
        where = shard_of(k, 2)
        for i, t in enumerate(shards):
            t.push(k[where == i], g[where == i])
    out = np.empty((keys.size, CFG.dim), np.float32)
    where = shard_of(keys, 2)
    for i, t in enumerate(shards):
        out[where == i] = t.pull(keys[where == i])[0]
    return out


def test_any_int64_key_is_admitted_updated_and_placed_by_its_hash(client):
    emb = client.create_variable("dyn_emb", shape=(None, 4), sparse=True, optimizer=ps.Adagrad(0.1), table=CFG)
    assert emb.dynamic and emb.num_shards == 2 and {pl.ps for pl in emb.shards} == {0, 1}
    rng = np.random.default_rng(0)
    pushes = []
    for _ in range(3):
        keys = np.concatenate([EDGE, rng.integers(-50, 50, 20)]).astype(np.int64)
        grads = rng.standard_normal((keys.size, 4)).astype(np.float32)
        client.push_rows(emb, keys, grads)
        pushes.append((keys, grads))
    probe = np.concatenate([EDGE, np.arange(-60, 60, dtype=np.int64)])
    np.testing.assert_array_equal(client.pull_rows(emb, probe), reference(pushes, probe))
    stats = client.table_stats(emb)
    assert stats["live_keys"] > 0 and stats["dropped_rows"] > 0 and stats["evicted_keys"] == 0
    again = client.create_variable("dyn_emb", shape=(None, 4), sparse=True, optimizer=ps.Adagrad(0.1), table=CFG)
    assert again == emb
    with ps.PSClient(client.settings) as other:  # discovered from the PS: still a dynamic table
        found = other.variables()["dyn_emb"]
        assert found.dynamic and np.array_equal(other.pull_rows(found, EDGE), reference(pushes, EDGE))
    with pytest.raises(InvalidArgumentError, match="no whole value"):
        client.pull([emb])


def test_dynamic_table_comes_back_from_a_full_checkpoint_and_an_increment_after_sigkill(cluster, client):
    cfg = TableConfig(dim=4, capacity=1_000, initializer="normal", init_value=0.1, increments=1,
                      admission=Admission("counter", min_count=2))
    emb = client.create_variable("dyn_ckpt", shape=(None, 4), sparse=True, optimizer=ps.Adagrad(0.1), table=cfg)
    keys = np.arange(-40, 40, dtype=np.int64)
    for _ in range(2):
        client.push_rows(emb, keys, np.ones((keys.size, 4), np.float32))
    client.checkpoint(step=7)  # full
    client.push_rows(emb, keys[:10], np.ones((10, 4), np.float32))
    saved = client.pull_rows(emb, keys)
    client.checkpoint(step=8)  # an increment on step 7
    client.push_rows(emb, keys, np.ones((keys.size, 4), np.float32))  # after the checkpoint
    newer = client.pull_rows(emb, keys)
    victim = cluster.ps[1]
    cluster.kill(victim)
    cluster.restart(victim)
    assert client.status()[1].restored_step == 8
    after = client.pull_rows(emb, keys)
    on_victim = shard_of(keys, 2) == [pl.shard_index for pl in emb.shards if pl.ps == 1][0]
    assert on_victim.any() and (~on_victim).any()
    np.testing.assert_array_equal(after[on_victim], saved[on_victim])
    np.testing.assert_array_equal(after[~on_victim], newer[~on_victim])


def test_torch_and_jax_adapters_train_a_dynamic_table_over_raw_int64_ids(client):
    import jax
    import jax.numpy as jnp
    import torch

    from pscluster.client import context
    from pscluster.jax import DynamicRows
    from pscluster.torch.dynamic import DynamicEmbedding

    table = client.create_variable("dyn_adapters", shape=(None, 3), sparse=True, optimizer=ps.SGD(1.0),
                                   initializer="uniform", init_scale=0.5)
    context.set_default_client(client)
    try:
        ids = torch.tensor([2**62, -7, 2**62, 0], dtype=torch.int64)
        offsets = torch.tensor([0, 2])
        before = client.pull_rows(table, ids.numpy())
        assert client.table_stats(table) == {"live_keys": 3, "evicted_keys": 0, "dropped_rows": 0}
        bag = DynamicEmbedding(table, mode="sum")
        out = bag(ids, offsets)
        np.testing.assert_allclose(out.detach().numpy(), [before[0] + before[1], before[2] + before[3]], rtol=1e-6)
        out.sum().backward()
        bag.push()
        after = client.pull_rows(table, ids.numpy())
        np.testing.assert_allclose(after, before - np.array([[2], [1], [2], [1]]), rtol=1e-6)  # 2**62 counted twice
        rows = DynamicRows(table)
        got, local = rows.pull(np.array([[0, -7], [0, 0]]))
        g = jax.grad(lambda r: jnp.sum(r[local]))(jnp.asarray(got))
        rows.push(np.asarray(g))
        np.testing.assert_allclose(client.pull_rows(table, [0, -7]), after[[3, 1]] - np.array([[3], [1]]), rtol=1e-6)
    finally:
        context.set_default_client(None)


def test_one_adapter_shared_by_closures_running_at_once_pushes_each_thread_its_own_keys(client):
    """A worker runs closures on several threads; one DynamicEmbedding / DynamicRows made outside the step
    is shared by them. Each thread pushes the gradient of the rows it pulled, never another thread's."""
    import threading

    import torch

    from pscluster.client import context
    from pscluster.jax import DynamicRows
    from pscluster.torch.dynamic import DynamicEmbedding

    threads = 4
    for kind in ("torch", "jax"):
        table = client.create_variable(f"dyn_shared_{kind}", shape=(None, 2), sparse=True, optimizer=ps.SGD(1.0))
        adapter = DynamicEmbedding(table) if kind == "torch" else DynamicRows(table)
        both_pulled = threading.Barrier(threads, timeout=30)
        errors = []

        def step(i, adapter=adapter, kind=kind, both_pulled=both_pulled, errors=errors):
            context.set_default_client(client)
            keys = np.arange(i * 10, i * 10 + 4, dtype=np.int64)
            try:
                if kind == "torch":
                    out = adapter(torch.from_numpy(keys))
                    both_pulled.wait()  # every thread has pulled before any pushes
                    out.sum().backward()
                    adapter.push()
                else:
                    got, _ = adapter.pull(keys)
                    both_pulled.wait()
                    adapter.push(np.ones_like(got))
            except Exception as exc:  # noqa: BLE001 - reported by the assert below
                errors.append(exc)

        workers = [threading.Thread(target=step, args=(i,), name=f"test-closure-{i}") for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=60)
        assert not errors, errors
        keys = np.concatenate([np.arange(i * 10, i * 10 + 4) for i in range(threads)])
        np.testing.assert_array_equal(client.pull_rows(table, keys), -np.ones((keys.size, 2), np.float32), kind)


def test_every_evicted_key_is_listed_over_the_wire_and_overflow_is_counted(client):
    cfg = TableConfig(dim=2, capacity=8, report_evicted=5)  # per shard: 8 rows, 5 evicted keys reported
    emb = client.create_variable("dyn_evict", shape=(None, 2), sparse=True, optimizer=ps.SGD(0.1), table=cfg)
    keys = np.arange(100, dtype=np.int64)
    where = shard_of(keys, 2)
    first = np.concatenate([keys[where == i][:8] for i in range(2)])  # fills both shards
    client.push_rows(emb, first, np.ones((first.size, 2), np.float32))
    assert client.evicted_keys(emb)[0].size == 0
    newer = np.concatenate([keys[where == i][8:11] for i in range(2)])  # 3 new keys per shard: 3 evicted each
    client.push_rows(emb, newer, np.ones((newer.size, 2), np.float32))
    evicted, overflowed = client.evicted_keys(emb)
    assert overflowed == 0 and evicted.size == 6 and set(evicted.tolist()) <= set(first.tolist())
    assert client.evicted_keys(emb)[0].size == 0  # read once: the report is empty again
    live_before = client.table_stats(emb)["evicted_keys"]
    more = np.concatenate([keys[where == i][11:19] for i in range(2)])  # 8 more per shard: 8 evicted, 5 kept
    client.push_rows(emb, more, np.ones((more.size, 2), np.float32))
    evicted, overflowed = client.evicted_keys(emb)
    assert (evicted.size, overflowed) == (10, 6)
    assert client.table_stats(emb)["evicted_keys"] - live_before == evicted.size + overflowed


def test_export_table_writes_sorted_keys_and_rows_of_every_shard(client, tmp_path):
    emb = client.create_variable("dyn_export", shape=(None, 3), sparse=True, optimizer=ps.SGD(0.5),
                                 table=TableConfig(dim=3, capacity=1_000, initializer="uniform", init_value=0.3))
    keys = np.concatenate([EDGE, np.random.default_rng(1).integers(-(2**62), 2**62, 300)]).astype(np.int64)
    client.push_rows(emb, keys, np.ones((keys.size, 3), np.float32))
    keys_path, values_path = client.export_table(emb, tmp_path)
    saved_keys, saved_rows = np.load(keys_path), np.load(values_path)
    assert saved_keys.dtype == np.int64 and np.array_equal(saved_keys, np.unique(keys))
    np.testing.assert_array_equal(saved_rows, client.pull_rows(emb, saved_keys))
    _, half = client.export_table(emb, tmp_path, float16=True)
    assert np.load(half).dtype == np.float16
    with pytest.raises(InvalidArgumentError, match="not a dynamic table"):
        client.export_table(client.create_variable("dense_x", shape=(3,)), tmp_path)


def test_a_push_one_ps_task_refuses_at_capacity_changes_no_ps_task(client):
    cfg = TableConfig(dim=2, capacity=6, on_full="refuse")
    emb = client.create_variable("dyn_refuse", shape=(None, 2), sparse=True, optimizer=ps.SGD(0.5), table=cfg)
    dense = client.create_variable("dense_refuse", shape=(2, 2), optimizer=ps.SGD(0.5))
    keys = np.arange(1_000, dtype=np.int64)
    on = [keys[shard_of(keys, 2) == i] for i in range(2)]
    first = np.concatenate([on[0][:6], on[1][:2]])  # shard 0 full, shard 1 has room for 4
    client.push_rows(emb, first, np.ones((first.size, 2), np.float32))
    rows_before, dense_before = client.pull_rows(emb, first), client.pull([dense])[0]
    more = np.concatenate([on[0][6:7], on[1][2:5]])  # shard 0 refuses its 1 new key, shard 1 would take 3
    with pytest.raises(ResourceExhaustedError, match=r"dyn_refuse\[0\]: 1 new keys do not fit"):
        client.push([(dense, np.ones((2, 2), np.float32))], rows=[(emb, more, np.ones((more.size, 2), np.float32))])
    assert client.table_stats(emb)["live_keys"] == 8  # shard 1 took none of its 3 new keys
    np.testing.assert_array_equal(client.pull_rows(emb, first), rows_before)
    np.testing.assert_array_equal(client.pull([dense])[0], dense_before)  # nor did the dense variable change


def test_a_table_saved_on_2_ps_and_restored_on_3_or_1_is_found_by_the_same_create_call(cluster, client, tmp_path):
    """A restore keeps the saved shard count, placed over the new tasks: the program's own create_variable
    call (one shard per PS task, no partitioner) must find the table, not refuse it as redefined."""
    cfg = TableConfig(dim=4, capacity=1_000, admission=Admission("counter", min_count=2))
    emb = client.create_variable("dyn_moved", shape=(None, 4), sparse=True, optimizer=ps.Adagrad(0.1), table=cfg)
    keys = np.arange(-30, 30, dtype=np.int64)
    for _ in range(3):
        client.push_rows(emb, keys, np.ones((keys.size, 4), np.float32))
    saved = client.pull_rows(emb, keys)
    client.checkpoint(step=21)
    for num_ps in (3, 1):
        with LocalCluster(num_ps, 0, workdir=tmp_path / f"ps{num_ps}", supervise=False,
                          checkpoint_dir=cluster.checkpoint_dir, restore=True) as again, \
                ps.PSClient(again.settings()) as other:
            found = other.create_variable("dyn_moved", shape=(None, 4), sparse=True, optimizer=ps.Adagrad(0.1),
                                          table=cfg)
            assert found.num_shards == 2
            np.testing.assert_array_equal(other.pull_rows(found, keys), saved)
            with pytest.raises(AlreadyExistsError, match="cannot redefine"):  # a real redefinition still is one
                other.create_variable("dyn_moved", shape=(None, 4), sparse=True, optimizer=ps.Adagrad(0.1),
                                      table=TableConfig(dim=4, capacity=2_000))


def test_table_calls_name_what_is_wrong_before_any_request(client, tmp_path):
    emb = client.create_variable("dyn_checks", shape=(None, 2), sparse=True, optimizer=ps.SGD(1.0))
    fixed = client.create_variable("fixed_checks", shape=(10, 2), sparse=True, optimizer=ps.SGD(1.0))
    with pytest.raises(InvalidArgumentError, match="does not fit int64"):
        client.pull_rows(emb, np.array([2**64 - 1], np.uint64))  # would read key -1's row
    with pytest.raises(InvalidArgumentError, match="gradient dtype int64"):
        client.push_rows(emb, [1], np.ones((1, 2), np.int64))
    with pytest.raises(InvalidArgumentError, match="TableConfig has dim=8"):
        client.create_variable("dyn_dims", shape=(None, 4), sparse=True, optimizer=ps.SGD(1.0),
                               table=TableConfig(dim=8))
    with pytest.raises(InvalidArgumentError, match="not a dynamic table"):
        client.table_stats(fixed)
    assert client.table_stats(emb) == {"live_keys": 0, "evicted_keys": 0, "dropped_rows": 0}
    client.push_rows(emb, np.array([2**63 - 1], np.uint64), np.ones((1, 2), np.float32))  # fits: accepted
    keys, values = client.export_table(emb, tmp_path / "not" / "yet")  # the folder is made
    assert keys.exists() and np.load(keys).tolist() == [2**63 - 1] and np.load(values).shape == (1, 2)


def test_evict_on_demand_runs_the_policy_now_and_lists_the_keys(client):
    from pscluster.tables import Eviction

    emb = client.create_variable("dyn_on_demand", shape=(None, 2), sparse=True, optimizer=ps.SGD(1.0),
                                 table=TableConfig(dim=2, eviction=Eviction("steps", max_idle=1)))
    old, new = np.arange(0, 40, dtype=np.int64), np.arange(100, 110, dtype=np.int64)
    client.push_rows(emb, old, np.ones((old.size, 2), np.float32))
    for _ in range(2):
        client.push_rows(emb, new, np.ones((new.size, 2), np.float32))  # `old` idle 2 pushes > 1 on each shard
    assert client.table_stats(emb)["live_keys"] == 50  # no trigger set: nothing evicted by itself
    assert client.evict(emb) == 40
    assert client.table_stats(emb) == {"live_keys": 10, "evicted_keys": 40, "dropped_rows": 0}
    keys, overflowed = client.evicted_keys(emb)
    assert keys.tolist() == old.tolist() and overflowed == 0
    assert client.evict(emb) == 0
    with pytest.raises(InvalidArgumentError, match="evict: fixed_evict is not a dynamic table"):
        client.evict(client.create_variable("fixed_evict", shape=(4, 2), sparse=True, optimizer=ps.SGD(1.0)))
