"""VariableStore: idempotent creation, validation before change, exactly-once pushes, sparse rows."""

import numpy as np
import pytest
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.store import PushItem, ShardSpec, VariableStore

from pscluster.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError

SGD1 = OptimizerConfig("sgd", 1.0)


def spec(name="w", shape=(4, 2), dtype="<f4", index=0, num=1, offset=0, full=None, sparse=False, ordinal=0,
         optimizer=SGD1):
    return ShardSpec(name, index, num, tuple(full or shape), tuple(shape), offset, dtype, optimizer, sparse, ordinal)


def store_with(*specs, nan_policy="reject"):
    store = VariableStore(nan_policy=nan_policy)
    for s in specs:
        store.create(s, np.zeros(s.shape, s.dtype))
    return store


def test_create_is_idempotent_for_identical_definition():
    store = store_with(spec())
    shard, created = store.create(spec(ordinal=5), np.ones((4, 2), np.float32))
    assert not created
    assert shard.value.sum() == 0  # the existing value is kept


@pytest.mark.parametrize("other", [spec(shape=(5, 2)), spec(dtype="<f8"),
                                   spec(optimizer=OptimizerConfig("adam", 0.1))])
def test_conflicting_definition_is_a_clear_error(other):
    store = store_with(spec())
    with pytest.raises(AlreadyExistsError, match="exists as"):
        store.create(other, np.zeros(other.shape, other.dtype))


def test_push_applies_optimizer_and_bumps_version():
    store = store_with(spec())
    res = store.push("p1", [PushItem(("w", 0), np.ones((4, 2), np.float32))])
    assert res[0].applied and res[0].version == 1
    value, version = store.pull(("w", 0))
    np.testing.assert_array_equal(value, -np.ones((4, 2)))
    assert version == 1


def test_push_with_applied_push_id_is_ignored():
    store = store_with(spec())
    store.push("c7.0", [PushItem(("w", 0), np.ones((4, 2), np.float32))])
    res = store.push("c7.0", [PushItem(("w", 0), np.ones((4, 2), np.float32))])
    assert not res[0].applied and res[0].version == 1
    assert store.pull(("w", 0))[0].sum() == -8


def test_dedup_window_is_bounded():
    store = VariableStore(dedup_window=1000)
    store.create(spec(), np.zeros((4, 2), np.float32))
    for i in range(1500):
        store.push(f"p{i}", [PushItem(("w", 0), np.zeros((4, 2), np.float32))])
    assert len(store.get(("w", 0)).record) == 1000


BAD_PUSHES = [
    (PushItem(("w", 0), np.ones((3, 2), np.float32)), "shape"),
    (PushItem(("w", 0), np.ones((4, 2), np.float64)), "dtype"),
    (PushItem(("w", 0), np.full((4, 2), np.nan, np.float32)), "NaN"),
    (PushItem(("w", 0), np.full((4, 2), np.inf, np.float32)), "NaN or Inf"),
    (PushItem(("nope", 0), np.ones((4, 2), np.float32)), "unknown variable"),
    (PushItem(("emb", 0), np.ones((1, 2), np.float32), np.array([-1])), "outside rows"),
    (PushItem(("emb", 0), np.ones((1, 2), np.float32), np.array([10])), "outside rows"),
    (PushItem(("emb", 0), np.ones((2, 2), np.float32), np.array([1])), "row gradients"),
]


@pytest.mark.parametrize("bad,match", BAD_PUSHES, ids=[m for _, m in BAD_PUSHES])
def test_bad_push_is_rejected_and_changes_nothing(bad, match):
    store = store_with(spec(), spec("emb", (10, 2), sparse=True, ordinal=1), spec("v", ordinal=2))
    good = PushItem(("v", 0), np.ones((4, 2), np.float32))
    with pytest.raises((InvalidArgumentError, NotFoundError), match=match):
        store.push("p", [good, bad])  # the valid item in the same request must not apply either
    for key in [("w", 0), ("emb", 0), ("v", 0)]:
        value, version = store.pull(key)
        assert version == 0 and not value.any()
    assert len(store.get(("v", 0)).record) == 0


def test_nan_policy_allow_applies_nan():
    store = store_with(spec(), nan_policy="allow")
    store.push("p", [PushItem(("w", 0), np.full((4, 2), np.nan, np.float32))])
    assert np.isnan(store.pull(("w", 0))[0]).all()


def test_sparse_push_and_pull_use_global_row_ids_of_the_shard():
    store = store_with(spec("emb", (5, 2), index=1, num=2, offset=5, full=(10, 2), sparse=True))
    store.push("p", [PushItem(("emb", 1), np.ones((2, 2), np.float32), np.array([5, 9]))])
    rows, _ = store.pull(("emb", 1), np.array([9, 6, 5]))
    np.testing.assert_array_equal(rows, [[-1, -1], [0, 0], [-1, -1]])


def test_pull_chunks_reassemble_the_shard():
    store = store_with(spec(shape=(1000, 3)))
    store.push("", [PushItem(("w", 0), np.arange(3000, dtype=np.float32).reshape(1000, 3))])
    _, version, chunks = store.pull_chunks(("w", 0), 1024)
    data = b"".join(chunks)
    np.testing.assert_array_equal(np.frombuffer(data, np.float32).reshape(1000, 3),
                                  -np.arange(3000, dtype=np.float32).reshape(1000, 3))
    assert version == 1


@pytest.mark.parametrize("bad", [spec(name=""), spec(index=2, num=2), spec(dtype="|b1"), spec(dtype="<U4"),
                                 spec(shape=(4, 2), full=(3, 2), num=2)])
def test_invalid_spec_is_rejected(bad):
    with pytest.raises(InvalidArgumentError):
        VariableStore().create(bad, np.zeros(bad.shape, "f4"))


@pytest.mark.parametrize("kind", ["normal", "uniform"])
def test_a_random_initial_value_is_drawn_in_its_dtype_without_a_float64_copy(kind):
    import tracemalloc

    from pscluster.server.store import initial_value

    big = ShardSpec("t", 0, 1, (160_000, 64), (160_000, 64), 0, "float32", OptimizerConfig("sgd", 0.1), sparse=True)
    tracemalloc.start()
    try:
        value = initial_value(big, kind, 0.5, seed=3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert value.dtype == np.float32 and peak < 1.2 * value.nbytes  # was 3 x: a float64 draw, then its cast
    np.testing.assert_array_equal(value, initial_value(big, kind, 0.5, seed=3))  # restarts agree
    assert (abs(float(value.std()) - 0.5) < 0.01) if kind == "normal" else (np.abs(value).max() <= 0.5)


def test_a_repeated_push_answers_with_the_version_it_made_not_the_current_one():
    """The coordinator counts updates a PS restart lost by version: a retried push that reported the
    shard's current version would hide the version it made (one lost update uncounted)."""
    from pscluster.server.push_record import PushRecord

    store = VariableStore()
    spec = ShardSpec("c", 0, 1, (), (), 0, "<i8", OptimizerConfig("sgd", 1.0), False, 0)
    store.create(spec, np.zeros((), np.int64))
    one = [PushItem(("c", 0), np.array(-1, np.int64))]
    first = store.push("c7.0", one)[0]
    store.push("c8.0", one)
    store.push("c9.0", one)
    again = store.push("c7.0", one)[0]  # the retry of closure 7 after its reply was lost
    assert (first.version, first.applied) == (1, True)
    assert (again.version, again.applied) == (1, False)
    assert int(store.get(("c", 0)).value) == 3
    # a checkpoint keeps the versions; an older checkpoint without them restores with the shard's version
    restored = PushRecord.from_state(store.get(("c", 0)).record.state())
    assert restored.applied_at("c8.0") == 2
    old = PushRecord.from_state({"ids": ["c7.0"], "final_below": []}, version=3)
    assert old.applied_at("c7.0") == 3


def test_a_fused_push_copies_each_shards_value_after_it_and_a_repeat_copies_the_current_value():
    store = store_with(spec("a", (4, 2)), spec("b", (3,), ordinal=1))
    grads = [PushItem(("a", 0), np.ones((4, 2), np.float32)), PushItem(("b", 0), np.full(3, 2, np.float32))]
    out = np.full(4 * 8 + 3 * 4, 0xAB, np.uint8)
    res = store.push("c7.0", grads, values_into=out)
    assert [(r.version, r.applied, r.current) for r in res] == [(1, True, 1), (1, True, 1)]
    np.testing.assert_array_equal(out[:32].view(np.float32), -np.ones(8, np.float32))
    np.testing.assert_array_equal(out[32:].view(np.float32), np.full(3, -2, np.float32))
    store.push("c8.0", grads[:1])  # another closure moves "a" on
    out[:] = 0
    again = store.push("c7.0", grads, values_into=out)  # closure 7's retry: nothing applied twice
    assert [(r.version, r.applied, r.current) for r in again] == [(1, False, 2), (1, False, 1)]
    np.testing.assert_array_equal(out[:32].view(np.float32), np.full(8, -2, np.float32))  # "a" as it is now
    np.testing.assert_array_equal(out[32:].view(np.float32), np.full(3, -2, np.float32))
