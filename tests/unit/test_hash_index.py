"""The dynamic tables' hash index against a Python dict, with the keys a sentinel would break."""

import numpy as np
import pytest
from pscluster.server.hash_index import HashIndex, home_slot, mix64, shard_of

from pscluster.errors import InvalidArgumentError, ResourceExhaustedError

EDGE = np.array([0, -1, 1, 2**63 - 1, -(2**63), 2**32, -(2**31)], np.int64)


def test_sentinel_values_never_collide_with_user_keys() -> None:
    index = HashIndex(capacity=16)
    rows = index.insert(EDGE)
    assert index.lookup(EDGE).tolist() == rows.tolist()
    assert index.lookup(np.array([2, 3], np.int64)).tolist() == [-1, -1]
    index.remove(rows[:2])  # 0 and -1 leave: their tombstones must not read as keys 0 or -1
    assert index.lookup(EDGE).tolist() == [-1, -1] + rows[2:].tolist()


@pytest.mark.parametrize("move_min,tag_bits", [(1 << 16, None), (8, None), (1 << 16, 0), (8, 1)])
def test_index_matches_a_dict_through_inserts_removes_and_rebuilds(move_min: int, tag_bits: int | None) -> None:
    """move_min=8: tables are moved a few slots per insert, so most steps run mid-move. tag_bits 0 or 1:
    most slots of a bucket carry the tag of the key looked up, so false tag matches are the common case."""
    rng = np.random.default_rng(3)
    index = HashIndex(capacity=5_000, move_min=move_min, tag_bits=tag_bits)
    moving = 0
    ref: dict[int, int] = {}
    for _ in range(300):
        batch = np.unique(rng.integers(-3_000, 3_000, 40)).astype(np.int64)
        absent = np.array([k for k in batch.tolist() if k not in ref], np.int64)
        if absent.size and len(ref) + absent.size <= index.capacity:
            for k, r in zip(absent.tolist(), index.insert(absent).tolist()):
                ref[k] = r
        drop = [k for k in batch.tolist()[::3] if k in ref]
        if drop:
            index.remove(np.array([ref.pop(k) for k in drop], np.int64))
        moving += index._old is not None
        probe = rng.integers(-3_100, 3_100, 200).astype(np.int64)
        assert index.lookup(probe).tolist() == [ref.get(k, -1) for k in probe.tolist()]
        assert index.live == len(ref)
    assert index.rebuilds > 1 and (moving > 10 or move_min > 8)
    live = index.live_rows()
    assert sorted(index.row_keys[live].tolist()) == sorted(ref)
    assert live.max() < index.capacity


def test_freed_rows_are_reused_so_rows_stay_below_capacity() -> None:
    index = HashIndex(capacity=4)
    rows = index.insert(np.array([10, 11, 12, 13], np.int64))
    with pytest.raises(ResourceExhaustedError):
        index.insert(np.array([14], np.int64))
    index.remove(rows[1:2])
    assert index.insert(np.array([14], np.int64)).tolist() == [rows[1]]
    assert index.high_water == 4


def test_capacity_beyond_int32_rows_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="capacity"):
        HashIndex(capacity=2**31)


def test_hash_and_shard_are_stable_values_not_process_dependent() -> None:
    # fixed expected values: a change of the hash would silently move every key to another shard
    assert mix64(np.array([0], np.int64)).tolist() == [16294208416658607535]
    shards = shard_of(np.arange(100_000, dtype=np.int64), 3)
    counts = np.bincount(shards, minlength=3)
    assert counts.min() > 32_000 and shards.max() == 2


def test_a_one_row_index_probes_empty_and_deleted_slots_safely() -> None:
    index = HashIndex(capacity=1)
    assert index.lookup(EDGE).tolist() == [-1] * EDGE.size
    row = index.insert(EDGE[:1])
    index.remove(row)
    assert index.lookup(EDGE).tolist() == [-1] * EDGE.size
    assert index.insert(EDGE[1:2]).tolist() == row.tolist()


def test_long_collision_chains_that_wrap_the_table_end_are_found_placed_and_freed() -> None:
    """Chains far longer than a probe window, starting in the last bucket of the slot table: the
    windowed rounds of the last keys must wrap, skip tombstones and stop at the first empty slot."""
    ids = np.arange(-3_000_000, 3_000_000, dtype=np.int64)
    home = home_slot(mix64(ids), 1024)
    same = ids[home == 1016][:300]
    assert same.size == 300
    index = HashIndex(capacity=1_000)
    ref: dict[int, int] = {}
    for part in np.array_split(same[:200], [1, 7, 70, 100]):  # batches below and above the windowed tail
        assert (index.lookup(part) == -1).all()
        ref.update(zip(part.tolist(), index.insert(part).tolist()))
    assert index.rebuilds == 0  # still the 1,024-slot table: every key in one chain
    np.testing.assert_array_equal(index.lookup(same[:200]), [ref[int(k)] for k in same[:200]])
    gone = same[:200][::3]
    index.remove(index.lookup(gone))
    for k in gone.tolist():
        del ref[k]
    assert (index.lookup(gone) == -1).all()
    fresh = same[200:260]
    ref.update(zip(fresh.tolist(), index.insert(fresh).tolist()))  # fills tombstones along the chain
    keys = np.array(list(ref), np.int64)
    np.testing.assert_array_equal(index.lookup(keys), list(ref.values()))
    assert (index.lookup(same[260:]) == -1).all()


def test_a_first_batch_into_an_empty_index_is_placed_without_probing_and_wraps_the_table_end() -> None:
    """The empty-index path sorts keys by home slot: 120 keys homed in the last bucket (8 slots) of the
    1,024-slot table fill it and wrap to the start, among keys homed at the start."""
    ids = np.arange(-3_000_000, 3_000_000, dtype=np.int64)
    home = home_slot(mix64(ids), 1024)
    keys = np.concatenate([ids[home == 1016][:120], ids[home == 0][:20], ids[home == 8][:20], ids[home == 504][:5]])
    keys = keys[np.random.default_rng(2).permutation(keys.size)]
    index = HashIndex(capacity=1_000)
    rows = index.insert(keys)
    assert index.rebuilds == 0 and index.live == keys.size
    np.testing.assert_array_equal(index.lookup(keys), rows)
    assert (index.lookup(ids[home == 1016][120:160]) == -1).all()
    index.remove(rows[::2])
    np.testing.assert_array_equal(index.lookup(keys), np.where(np.arange(keys.size) % 2 == 0, -1, rows))
    more = ids[home == 1016][160:190]
    np.testing.assert_array_equal(index.lookup(more), -1)
    np.testing.assert_array_equal(index.lookup(more[:0]), [])
    placed = index.insert(more)
    np.testing.assert_array_equal(index.lookup(more), placed)


def test_the_next_slot_table_is_written_before_the_batch_that_starts_a_move() -> None:
    """Its pages are committed over the inserts before the move (a stretch each), so the batch that starts
    the move does not fault in a page per key (138 ms for 65,536 keys at 8 M keys here)."""
    index = HashIndex(capacity=100_000, move_min=256)
    rng = np.random.default_rng(5)
    keys = np.unique(rng.integers(-(2**63), 2**63 - 1, 60_000, dtype=np.int64))
    used = 0
    for part in np.array_split(keys, 120):
        size, spare = index._slots.size, index._spare
        index.insert(part)
        if index._slots.size > size:  # a move started with this batch
            used += index._slots is spare
        elif index._spare is not None:
            assert (index.live + index._tombs) * 16 > size * 7  # only near the move: 8 B a slot for a while
            assert 0 < index._spare_done <= index._spare.size
    assert index.rebuilds >= 4 and used == index.rebuilds - 1  # the first batch outgrows the smallest table
    np.testing.assert_array_equal(index.row_keys[index.lookup(keys)], keys)


def test_lookups_of_a_table_that_stopped_growing_mid_move_finish_the_move() -> None:
    """advance (called by a dynamic table's pulls and pushes that insert nothing) moves a bounded stretch
    per key, so a table mid-move does not search two slot tables for good."""
    from pscluster.server import hash_index

    index = HashIndex(capacity=50_000, move_min=64)
    keys = np.unique(np.random.default_rng(6).integers(-(2**63), 2**63 - 1, 20_000, dtype=np.int64))
    rows = np.concatenate([index.insert(part) for part in np.array_split(keys, 40)])
    while index._old is None:  # grow until a move is under way
        more = np.arange(index.live, index.live + 100, dtype=np.int64) + 2**40
        keys, rows = np.concatenate([keys, more]), np.concatenate([rows, index.insert(more)])
    rounds = 0
    while index._old is not None:
        index.advance(16)
        rounds += 1
        np.testing.assert_array_equal(index.lookup(keys[::97]), rows[::97])
    assert 0 < rounds <= index._slots.size // (hash_index.MOVE_PER_KEY * 16) + 1
    np.testing.assert_array_equal(index.lookup(keys), rows)
