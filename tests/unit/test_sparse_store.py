"""The store's sparse row path after its fast path (server/rows.py): sums, exactly-once, refusals, residency."""

import numpy as np
import pytest
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.store import PushItem, ShardSpec, VariableStore, ensure_created

from pscluster.errors import InvalidArgumentError

SGD = OptimizerConfig("sgd", 0.5)


def table(rows=10, dim=2, offset=0, full=None, optimizer=SGD, dtype="<f4"):
    spec = ShardSpec("emb", 0, 1, (full or rows, dim), (rows, dim), offset, dtype, optimizer, True, 0)
    store = VariableStore()
    store.create(spec, np.arange(rows * dim, dtype=dtype).reshape(rows, dim))
    return store


def test_unsorted_ids_with_duplicates_update_each_row_once_with_their_sum():
    store = table()
    before = store.pull(("emb", 0))[0]
    ids = np.array([7, 2, 7, 4, 2, 7])
    grads = np.arange(12, dtype=np.float32).reshape(6, 2)
    store.push("p", [PushItem(("emb", 0), grads, ids)])
    want = before.copy()
    for i, g in zip(ids, grads):
        want[i] -= 0.5 * g  # exact in float32 here: small integers and halves
    np.testing.assert_array_equal(store.pull(("emb", 0))[0], want)


def test_sorted_unique_ids_update_exactly_their_rows():
    store = table(offset=10, full=20)
    ids = np.array([10, 13, 19])
    store.push("p", [PushItem(("emb", 0), np.ones((3, 2), np.float32), ids)])
    after = store.pull(("emb", 0))[0]
    base = np.arange(20, dtype=np.float32).reshape(10, 2)
    changed = [0, 3, 9]
    np.testing.assert_array_equal(after[changed], base[changed] - 0.5)
    np.testing.assert_array_equal(np.delete(after, changed, axis=0), np.delete(base, changed, axis=0))


def test_a_repeated_push_id_applies_its_rows_once():
    store = table()
    item = PushItem(("emb", 0), np.ones((2, 2), np.float32), np.array([1, 3]))
    first = store.push("closure-9", [item])
    again = store.push("closure-9", [item])
    assert first[0].applied and not again[0].applied
    np.testing.assert_array_equal(store.pull(("emb", 0), np.array([1, 3]))[0], [[1.5, 2.5], [5.5, 6.5]])
    assert store.get(("emb", 0)).version == 1


@pytest.mark.parametrize("ids,match", [(np.array([3, 10]), "outside rows"), (np.array([-1, 2]), "outside rows")])
def test_a_row_outside_the_shard_is_refused_and_changes_no_row_nor_version(ids, match):
    store = table()
    before = store.pull(("emb", 0))[0]
    with pytest.raises(InvalidArgumentError, match=match):
        store.push("p", [PushItem(("emb", 0), np.ones((2, 2), np.float32), ids)])
    np.testing.assert_array_equal(store.pull(("emb", 0))[0], before)
    assert store.get(("emb", 0)).version == 0


def test_nan_row_gradients_are_refused_and_change_nothing():
    store = table()
    grads = np.ones((2, 2), np.float32)
    grads[1, 0] = np.nan
    with pytest.raises(InvalidArgumentError, match="NaN"):
        store.push("p", [PushItem(("emb", 0), grads, np.array([1, 2]))])
    np.testing.assert_array_equal(store.pull(("emb", 0))[0], np.arange(20, dtype=np.float32).reshape(10, 2))
    assert store.get(("emb", 0)).version == 0


def test_adam_slots_of_duplicate_rows_follow_the_summed_gradient():
    adam = OptimizerConfig("adam", 0.1)
    store, ref = table(optimizer=adam), table(optimizer=adam)
    store.push("p", [PushItem(("emb", 0), np.array([[1, 2], [3, 4]], np.float32), np.array([5, 5]))])
    ref.push("p", [PushItem(("emb", 0), np.array([[4, 6]], np.float32), np.array([5]))])
    for name in ("m", "v"):
        np.testing.assert_array_equal(store.get(("emb", 0)).slots[name], ref.get(("emb", 0)).slots[name])
    np.testing.assert_array_equal(store.pull(("emb", 0))[0], ref.pull(("emb", 0))[0])


def _rss_bytes():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_a_zeros_table_is_resident_from_creation_and_a_dense_zeros_variable_is_not():
    rows, dim = 1 << 18, 64  # 64 MiB of float32
    nbytes = rows * dim * 4
    for sparse in (True, False):
        spec = ShardSpec("t" if sparse else "d", 0, 1, (rows, dim), (rows, dim), 0, "float32", SGD, sparse, 0)
        before = _rss_bytes()
        shard, _ = ensure_created(VariableStore(), spec, None, "zeros", 0.0, 0)
        grown = _rss_bytes() - before
        assert not shard.value.any()
        if sparse:  # the first batches do not pay for mapping the whole table
            assert grown >= 0.9 * nbytes
        else:  # a dense variable is written whole by its first push anyway
            assert grown < 0.25 * nbytes
        del shard
