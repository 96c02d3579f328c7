"""Placement and partitioning: pure functions every client computes identically.

A variable is split along axis 0 into shards by a partitioner (as TF's Fixed/Min/MaxSizePartitioner);
the k-th shard created in the cluster (its `ordinal`) lives on PS task `k mod P`.

    rows = split_rows((1000, 64), np.float32, MaxSizePartitioner(max_shard_bytes=64 << 10))
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from pscluster.errors import InvalidArgumentError

PLACEMENT_VERSION = 1  # bump when ps_for_ordinal changes; recorded in checkpoints
# replicas: 2: the replica table's entry for the sync token queue, bounded clocks and global step (held by
# PS 0 at first, backed up like a shard); shard indices start at 0, so no variable's shard has this key
SYNC_STATE_KEY = ("sync-state", -1)


@dataclass(frozen=True)
class FixedShardsPartitioner:
    """Exactly `num_shards` shards (fewer if axis 0 is shorter)."""

    num_shards: int

    def count(self, rows: int, row_bytes: int) -> int:
        """Number of shards for `rows` rows of `row_bytes` each."""
        if self.num_shards < 1:
            raise InvalidArgumentError(f"FixedShardsPartitioner: num_shards must be >= 1, got {self.num_shards}")
        return min(self.num_shards, rows)


@dataclass(frozen=True)
class MinSizePartitioner:
    """As many shards as keep each at least `min_shard_bytes`, at most `max_shards`."""

    min_shard_bytes: int = 256 << 10
    max_shards: int = 1

    def count(self, rows: int, row_bytes: int) -> int:
        """Number of shards for `rows` rows of `row_bytes` each."""
        if self.min_shard_bytes < 1 or self.max_shards < 1:
            raise InvalidArgumentError(
                f"MinSizePartitioner: min_shard_bytes and max_shards must be >= 1, got "
                f"{self.min_shard_bytes} and {self.max_shards}")
        return max(1, min(self.max_shards, rows, (rows * row_bytes) // self.min_shard_bytes))


@dataclass(frozen=True)
class MaxSizePartitioner:
    """The fewest shards that keep each at most `max_shard_bytes` (one row at least)."""

    max_shard_bytes: int
    max_shards: int | None = None

    def count(self, rows: int, row_bytes: int) -> int:
        """Number of shards for `rows` rows of `row_bytes` each."""
        if self.max_shard_bytes < 1 or (self.max_shards is not None and self.max_shards < 1):
            raise InvalidArgumentError(
                f"MaxSizePartitioner: max_shard_bytes and max_shards must be >= 1, got "
                f"{self.max_shard_bytes} and {self.max_shards}")
        rows_per_shard = max(1, self.max_shard_bytes // max(row_bytes, 1))
        n = math.ceil(rows / rows_per_shard)
        return max(1, min(n, self.max_shards or n, rows))


Partitioner = FixedShardsPartitioner | MinSizePartitioner | MaxSizePartitioner


def split_rows(shape: Sequence[int], dtype: np.dtype | type | str, partitioner: Partitioner | None) -> list[int]:
    """Rows per shard along axis 0; like numpy.array_split, the first shards take the remainder."""
    if partitioner is None:
        return [shape[0] if shape else 0]
    if not shape or shape[0] < 1:
        raise InvalidArgumentError(f"cannot partition a variable of shape {tuple(shape)}: axis 0 must be >= 1")
    rows = int(shape[0])
    row_bytes = math.prod(shape[1:]) * np.dtype(dtype).itemsize
    n = partitioner.count(rows, row_bytes)
    base, extra = divmod(rows, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def ps_for_new_shard(ordinal: int, num_ps: int, drained: Collection[int] = ()) -> int:
    """The PS a new shard is created on: `ordinal mod P` over the PS tasks a scale has not drained (all of
    them when none is drained, or every one is)."""
    if num_ps < 1:
        raise InvalidArgumentError("a cluster needs at least one PS task")
    active = [ps for ps in range(num_ps) if ps not in drained] or list(range(num_ps))
    return active[ordinal % len(active)]


def ps_for_ordinal(ordinal: int, num_ps: int) -> int:
    """The PS task that holds the shard created `ordinal`-th in the cluster."""
    if num_ps < 1:
        raise InvalidArgumentError("a cluster needs at least one PS task")
    return ordinal % num_ps
