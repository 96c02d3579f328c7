"""The hash index's compiled loops (server/table_jit.py) agree with the numpy definitions they replace."""

import numpy as np
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
