"""A PS's reads of its dynamic tables for the client's cluster-wide calls: eviction reports, export pages.

Plain functions over the store (the servicer translates, server/ps.py picks the shards this PS is the
primary of): each holds one shard's lock while it copies, never while anything is sent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

import numpy as np
from pscluster.server.dynamic_table import DynamicTable
from pscluster.server.push_record import push_key
from pscluster.server.store import Shard, VariableStore

from pscluster.errors import InvalidArgumentError
from pscluster.specs import Key

# rows of one ReadTable page at most, whatever the client asks (a page of 64-float rows is then 16 MiB)
MAX_PAGE_ROWS = 1 << 16


def table_shard(store: VariableStore, key: Key) -> Shard:
    """The dynamic table shard `key`, or NotFoundError / InvalidArgumentError (a fixed variable)."""
    shard = store.get(key)
    if shard.table is None:
        raise InvalidArgumentError(f"{shard.name} is not a dynamic table (shape (None, dim), sparse=True)")
    return shard


def table_counts(shard: Shard) -> dict[str, int]:
    """A dynamic table shard's live keys, evicted keys and dropped rows (ShardInfo's fields); {} otherwise."""
    table = shard.table
    if table is None:
        return {}
    return {"live_keys": table.live, "evicted_keys": table.stats.evicted, "dropped_rows": table.stats.dropped}


def pull_at(shard: Shard, version: int, keys: np.ndarray, clock_s: int | None = None) -> Literal["applied", "held", "gap"]:
    """A backup's repeat of its primary's row-creating pull of a dynamic table at `version` (as apply_at):
    the same keys on the same state, at the primary's seconds (clock_s), create and evict the same rows."""
    def pull(table: DynamicTable) -> None:
        table.pinned_s = clock_s
        try:
            table.pull(keys)
        finally:
            table.pinned_s = None

    return _at_version(shard, version, pull)


def evict_at(shard: Shard, version: int, keys: np.ndarray) -> Literal["applied", "held", "gap"]:
    """A backup's repeat of its primary's on-demand sweep at `version`: the same keys evicted (as pull_at)."""
    return _at_version(shard, version, lambda table: table.evict_keys(keys))


def _at_version(shard: Shard, version: int, op: Callable[[DynamicTable], object]) -> Literal["applied", "held", "gap"]:
    """Run op on the shard's table if this copy is exactly at `version` (an operation that keeps the version)."""
    with shard.lock:
        if version < shard.version:
            return "held"
        if version > shard.version or shard.table is None:
            return "gap"
        op(shard.table)
        return "applied"


def sweep(shards: Iterable[Shard], on_swept: Callable[[Shard, np.ndarray], None] | None = None) -> int:
    """Run each table shard's eviction policy now (the on-demand trigger); returns the keys evicted.
    `on_swept(shard, keys)` runs under the shard's lock (replicas: 2 queues the keys for the backup there)."""
    total = 0
    for shard in shards:
        assert shard.table is not None
        with shard.lock:
            gone = shard.table.sweep().evicted
            if gone.size and on_swept is not None:
                on_swept(shard, gone)
        total += int(gone.size)
    return total


def drain_evicted(shards: Iterable[Shard]) -> tuple[np.ndarray, int]:
    """Every key the shards' eviction reports hold (emptied) and the count of those that did not fit."""
    parts, overflowed = [], 0
    for shard in shards:
        assert shard.table is not None
        with shard.lock:
            keys, lost = shard.table.report.drain()
        parts.append(keys)
        overflowed += lost
    return (np.concatenate(parts) if parts else np.zeros(0, np.int64)), overflowed


def read_page(shard: Shard, start: int, max_rows: int, float16: bool) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(keys, values, next start or -1, version) of the live rows with ids in [start, start + max_rows).

    Raises:
        InvalidArgumentError: start < 0 or max_rows < 1.
    """
    table = shard.table
    assert table is not None
    if start < 0 or max_rows < 1:
        raise InvalidArgumentError(f"{shard.name}: ReadTable needs start >= 0 and max_rows >= 1, got {start}, {max_rows}")
    with shard.lock:
        high = table.index.high_water
        end = min(start + min(max_rows, MAX_PAGE_ROWS), high)
        live = table.index.live_rows()  # ascending; a scan of the shard's row range, no copy of its rows
        rows = live[np.searchsorted(live, start):np.searchsorted(live, end)]
        keys = table.index.row_keys[rows]
        values = table.values[rows].astype(np.float16) if float16 else table.values[rows]
        return keys, values, (end if end < high else -1), table.version


def check_room(store: VariableStore, push_id: str, items: list[tuple[Key, np.ndarray]]) -> None:
    """ResourceExhaustedError unless every table shard's new keys of a push would fit now (see CheckRoom);
    a shard that applied `push_id` already is skipped (its repeat applies nothing)."""
    pkey = push_key(push_id) if push_id else None
    for key, keys in items:
        shard = table_shard(store, key)
        assert shard.table is not None
        with shard.lock:
            if pkey is not None and shard.record.seen_key(pkey):
                continue
            shard.table.check_room(keys)
