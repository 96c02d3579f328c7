"""Hash-keyed dynamic tables on two real PS daemons: keys by hash, admission, checkpoint + SIGKILL."""

import numpy as np
import pytest
from pscluster.server.dynamic_table import DynamicTable

import pscluster as ps
from pscluster.errors import InvalidArgumentError
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
    again = client.create_variable("dyn_emb", shape=(None, 4), sparse=True, optimizer=ps.Adagrad(0.1), table=CFG)
    assert again == emb
    with ps.PSClient(client.settings) as other:  # discovered from the PS: still a dynamic table
        found = other.variables()["dyn_emb"]
        assert found.dynamic and np.array_equal(other.pull_rows(found, EDGE), reference(pushes, EDGE))
    with pytest.raises(InvalidArgumentError, match="no whole value"):
        client.pull([emb])


def test_dynamic_table_comes_back_from_a_checkpoint_after_sigkill(cluster, client):
    emb = client.create_variable("dyn_ckpt", shape=(None, 4), sparse=True, optimizer=ps.Adagrad(0.1), table=CFG)
    keys = np.arange(-40, 40, dtype=np.int64)
    for _ in range(2):
        client.push_rows(emb, keys, np.ones((keys.size, 4), np.float32))
    saved = client.pull_rows(emb, keys)
    client.checkpoint(step=7)
    client.push_rows(emb, keys, np.ones((keys.size, 4), np.float32))  # after the checkpoint
    newer = client.pull_rows(emb, keys)
    victim = cluster.ps[1]
    cluster.kill(victim)
    cluster.restart(victim)
    assert client.status()[1].restored_step == 7
    after = client.pull_rows(emb, keys)
    on_victim = shard_of(keys, 2) == [pl.shard_index for pl in emb.shards if pl.ps == 1][0]
    assert on_victim.any() and (~on_victim).any()
    np.testing.assert_array_equal(after[on_victim], saved[on_victim])
    np.testing.assert_array_equal(after[~on_victim], newer[~on_victim])
