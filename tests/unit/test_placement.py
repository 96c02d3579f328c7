"""Partitioners and round-robin placement (pure)."""

import numpy as np
import pytest

from pscluster.errors import InvalidArgumentError
from pscluster.placement import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    ps_for_ordinal,
    split_rows,
)


def test_no_partitioner_is_one_shard():
    assert split_rows((10, 3), np.float32, None) == [10]
    assert split_rows((), np.float32, None) == [0]


def test_fixed_shards_split_like_array_split():
    assert split_rows((10, 3), np.float32, FixedShardsPartitioner(3)) == [4, 3, 3]
    assert split_rows((2, 3), np.float32, FixedShardsPartitioner(5)) == [1, 1]


def test_min_size_partitioner_keeps_shards_at_least_min_bytes():
    # 100 rows x 1 KiB = 100 KiB; min 30 KiB -> 3 shards, capped by max_shards
    assert split_rows((100, 256), np.float32, MinSizePartitioner(30 << 10, max_shards=8)) == [34, 33, 33]
    assert len(split_rows((100, 256), np.float32, MinSizePartitioner(30 << 10, max_shards=2))) == 2
    assert split_rows((100, 256), np.float32, MinSizePartitioner(1 << 30, max_shards=8)) == [100]


def test_max_size_partitioner_keeps_every_shard_under_max_bytes():
    rows = split_rows((1000, 64), np.float32, MaxSizePartitioner(64 << 10))  # 256 B/row -> 256 rows/shard
    assert len(rows) == 4 and sum(rows) == 1000
    assert max(rows) * 256 <= 64 << 10
    assert len(split_rows((1000, 64), np.float32, MaxSizePartitioner(64 << 10, max_shards=2))) == 2


@pytest.mark.parametrize("part", [FixedShardsPartitioner(0), MinSizePartitioner(0), MaxSizePartitioner(0),
                                  MaxSizePartitioner(10, max_shards=0)])
def test_bad_partitioner_is_rejected(part):
    with pytest.raises(InvalidArgumentError):
        split_rows((10, 2), np.float32, part)


def test_scalar_cannot_be_partitioned():
    with pytest.raises(InvalidArgumentError, match="axis 0"):
        split_rows((), np.float32, FixedShardsPartitioner(2))


def test_round_robin_placement_by_ordinal():
    assert [ps_for_ordinal(i, 3) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(InvalidArgumentError):
        ps_for_ordinal(0, 0)
