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
