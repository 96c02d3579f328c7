"""The hash index's compiled loops (server/table_jit.py) agree with the numpy definitions they replace."""

import numpy as np
import pytest
from pscluster.server import table_kernels
from pscluster.server.hash_index import HashIndex, home_slot

from pscluster.tables import mix64


def test_the_compiled_hash_is_mix64_so_keys_keep_their_shards_and_buckets() -> None:
    keys = np.concatenate([np.array([0, -1, 1, 2**63 - 1, -(2**63), 2**32], np.int64),
                           np.random.default_rng(1).integers(-(2**63), 2**63 - 1, 200, dtype=np.int64)])
    assert [table_kernels.mix(int(k)) for k in keys] == mix64(keys).tolist()


def test_a_key_found_only_past_its_bucket_or_behind_a_false_tag_match_is_still_found() -> None:
    """Keys that share a home bucket, more than it holds, with no tag bits (every slot a candidate): the
    grouped first pass settles none of the later ones, the full probe must."""
    ids = np.arange(-3_000_000, 3_000_000, dtype=np.int64)
    same = ids[home_slot(mix64(ids), 1024) == 512][:40]
    index = HashIndex(capacity=1_000, tag_bits=0)
    rows = index.insert(same)
    np.testing.assert_array_equal(index.lookup(same), rows)
    np.testing.assert_array_equal(index.lookup(same[::-1][:33]), rows[::-1][:33])  # groups of 32 and a tail
    index.remove(rows[:5])
    np.testing.assert_array_equal(index.lookup(same), np.concatenate([[-1] * 5, rows[5:]]))


def test_grouping_by_shard_gives_each_shard_exactly_the_keys_shard_of_places_there_in_order() -> None:
    from pscluster.tables import shard_of

    keys = np.concatenate([np.array([0, -1, 2**63 - 1, -(2**63)], np.int64),
                           np.random.default_rng(2).integers(-(2**63), 2**63 - 1, 5_000, dtype=np.int64)])
    for n in (1, 2, 3, 7):
        parts = table_kernels.group_by_shard(keys, n)
        assert len(parts) == n
        for i, part in enumerate(parts):
            np.testing.assert_array_equal(part, np.flatnonzero(shard_of(keys, n) == i))
    assert [p.size for p in table_kernels.group_by_shard(keys[:0], 3)] == [0, 0, 0]


def test_repeated_marks_every_occurrence_of_a_key_that_occurs_twice_or_more() -> None:
    keys = np.array([5, -1, 5, 0, 2**63 - 1, -1, 7, 5, -(2**63)], np.int64)
    np.testing.assert_array_equal(table_kernels.repeated(keys), [1, 1, 1, 0, 0, 1, 0, 1, 0])
    assert table_kernels.repeated(np.array([3, 1, 2], np.int64)) is None
    assert table_kernels.repeated(np.zeros(0, np.int64)) is None
    many = np.random.default_rng(3).integers(-50, 50, 1_000).astype(np.int64)
    _, inverse, counts = np.unique(many, return_inverse=True, return_counts=True)
    np.testing.assert_array_equal(table_kernels.repeated(many), counts[inverse] > 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_repeats_are_summed_in_float64_in_arrival_order_as_a_dict_would(dtype) -> None:
    """A dict of float64 sums, one part after another: for float64 rows the order of the additions shows
    (numpy's reduceat adds runs of 8 or more parts pairwise)."""
    rng = np.random.default_rng(4)
    keys = rng.integers(-20, 20, 500).astype(np.int64)
    grads = (rng.standard_normal((500, 3)) * 10.0 ** rng.integers(-6, 6, (500, 1))).astype(dtype)
    in_dup = table_kernels.repeated(keys)
    got_keys, got_counts, got = table_kernels.sum_repeated(keys, grads, in_dup)
    sums: dict[int, list[float]] = {}
    counts: dict[int, int] = {}
    for k, g in zip(keys[in_dup].tolist(), grads[in_dup].astype(np.float64)):
        acc = sums.setdefault(k, [0.0, 0.0, 0.0])
        for d in range(3):
            acc[d] += float(g[d])
        counts[k] = counts.get(k, 0) + 1
    singles = int((~in_dup).sum())
    order = sorted(sums)
    np.testing.assert_array_equal(got_keys, np.concatenate([keys[~in_dup], np.array(order, np.int64)]))
    np.testing.assert_array_equal(got_counts, [1] * singles + [counts[k] for k in order])
    assert got.dtype == dtype
    assert got[singles:].tobytes() == np.array([sums[k] for k in order], np.float64).astype(dtype).tobytes()
    assert got[:singles].tobytes() == grads[~in_dup].tobytes()


def test_read_only_keys_and_gradients_run_the_versions_load_compiled_not_new_ones() -> None:
    """A request's keys and gradients are read-only views of its buffer: numba would compile a version
    for those inside the request (seconds on a PS, past a client's socket timeout on a busy machine)."""
    table_kernels.load()
    jit = table_kernels._kernels()
    names = ("lookup", "place", "erase", "move", "repeated", "sum_repeated", "group_by_shard")
    before = {name: len(getattr(jit, name).signatures) for name in names}
    keys = np.frombuffer(np.array([3, 1, 3, 2], np.int64).tobytes(), np.int64)
    assert not keys.flags.writeable
    for dtype in (np.float32, np.float64):
        grads = np.frombuffer(np.ones((4, 2), dtype).tobytes(), dtype).reshape(4, 2)
        in_dup = table_kernels.repeated(keys)
        assert in_dup is not None and in_dup.tolist() == [True, False, True, False]
        table_kernels.sum_repeated(keys, grads, in_dup)
    index = HashIndex(capacity=16)
    rows = index.insert(keys[1:])
    np.testing.assert_array_equal(index.lookup(keys), [rows[1], rows[0], rows[1], rows[2]])
    index.remove(rows[:1])
    table_kernels.group_by_shard(keys, 3)
    assert {name: len(getattr(jit, name).signatures) for name in names} == before


def test_an_index_asked_for_fewer_slots_than_a_bucket_gets_a_whole_bucket_not_an_out_of_bounds_write() -> None:
    index = HashIndex(capacity=100, slots=4)
    rows = index.insert(np.array([1, 2, -1, 2**63 - 1], np.int64))
    np.testing.assert_array_equal(index.lookup(np.array([2**63 - 1, 1, 3], np.int64)), [rows[3], rows[0], -1])


def test_big_endian_keys_and_gradients_are_read_as_their_values_not_rejected_or_misread() -> None:
    keys = np.array([5, 7, 5], np.int64)
    grads = np.arange(6, dtype=np.float32).reshape(3, 2)
    dup = table_kernels.repeated(keys)
    assert dup is not None
    native = table_kernels.sum_repeated(keys, grads, dup)
    swapped = table_kernels.sum_repeated(keys.astype(">i8"), grads.astype(">f4"), dup)
    for a, b in zip(native, swapped):
        np.testing.assert_array_equal(a, b)


def test_a_missing_numba_is_a_precise_failed_precondition_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from pscluster.errors import FailedPreconditionError
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    monkeypatch.delitem(sys.modules, "pscluster.server.table_jit", raising=False)
    monkeypatch.setattr(table_kernels, "_jit", None)
    with pytest.raises(FailedPreconditionError, match=r"numba>=0.68.*NUMBA_CACHE_DIR"):
        table_kernels.mix(1)
