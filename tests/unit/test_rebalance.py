"""The elastic-PS plan (coordinator/rebalance.py): which shard copies move when a PS joins or leaves."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from pscluster.coordinator import rebalance as rb
from pscluster.coordinator.replicas import striped_backup

from pscluster.errors import InvalidArgumentError


def striped(num_ps: int, shards: int, replicas: int) -> dict[int, rb.Place]:
    """The layout a cluster starts with: shard k on k mod P, its backup striped (as replicas.py)."""
    return {k: rb.Place(k % num_ps, striped_backup(k, num_ps) if replicas == 2 else None) for k in range(shards)}


def spread(layout: dict[int, rb.Place], active: list[int], role: str) -> list[int]:
    counts = Counter(getattr(p, role) for p in layout.values())
    return [counts.get(ps, 0) for ps in active]


def check(before: dict[int, rb.Place], after: dict[int, rb.Place], active: list[int], replicas: int) -> None:
    assert sorted(after) == sorted(before)
    for place in after.values():
        assert place.primary in active
        if replicas == 2:
            assert place.backup in active and place.backup != place.primary
        else:
            assert place.backup is None
    for role in ("primary",) + (("backup",) if replicas == 2 else ()):
        counts = spread(after, active, role)
        assert max(counts) - min(counts) <= 1, (role, counts)


@pytest.mark.parametrize("replicas", [1, 2])
def test_adding_a_ps_moves_only_its_share_onto_it(replicas: int) -> None:
    before = striped(3, 12, replicas)
    after = rb.rebalance(before, [0, 1, 2, 3], replicas)
    check(before, after, [0, 1, 2, 3], replicas)
    primary_moves = [m for m in rb.moves(before, after) if m.role == "primary"]
    assert len(primary_moves) == 3  # 12 shards on 4 PS: 3 each; the new one takes exactly 3
    assert {m.target for m in primary_moves} == {3}
    assert {m.source for m in primary_moves} == {0, 1, 2}  # one from each, not three from one


@pytest.mark.parametrize("replicas", [1, 2])
def test_removing_a_ps_moves_only_its_copies(replicas: int) -> None:
    before = striped(4, 12, replicas)
    after = rb.rebalance(before, [0, 1, 3], replicas)
    check(before, after, [0, 1, 3], replicas)
    for m in rb.moves(before, after):
        # nothing else moves, but a backup promoted to primary leaves its shard needing a new backup
        assert m.source == 2 or (m.role == "backup" and before[m.ordinal].backup == after[m.ordinal].primary)
    assert sum(1 for m in rb.moves(before, after) if m.role == "primary") == 3


def test_a_removed_primary_goes_to_its_in_sync_backup_when_that_keeps_the_balance() -> None:
    before = striped(4, 12, 2)
    after = rb.rebalance(before, [0, 1, 3], 2)
    for k, place in before.items():
        if place.primary == 2:
            assert after[k].primary == place.backup  # a freeze and a switch, no catch-up


def test_the_same_active_set_moves_nothing() -> None:
    for replicas in (1, 2):
        before = striped(3, 9, replicas)
        assert rb.moves(before, rb.rebalance(before, [0, 1, 2], replicas)) == []


def test_two_ps_with_two_replicas_hold_every_shard_on_both() -> None:
    before = striped(3, 6, 2)
    after = rb.rebalance(before, [0, 1], 2)
    check(before, after, [0, 1], 2)


def test_the_plan_is_deterministic_and_adding_then_removing_comes_back_balanced() -> None:
    before = striped(3, 10, 2)
    grown = rb.rebalance(before, [0, 1, 2, 3], 2)
    assert grown == rb.rebalance(before, [0, 1, 2, 3], 2)
    shrunk = rb.rebalance(grown, [0, 1, 2], 2)
    check(grown, shrunk, [0, 1, 2], 2)
    assert all(m.source == 3 or (m.role == "backup" and grown[m.ordinal].backup == shrunk[m.ordinal].primary)
               for m in rb.moves(grown, shrunk))


@pytest.mark.parametrize("num_ps,shards,replicas", list(itertools.product([2, 3, 5], [0, 1, 7, 16], [1, 2])))
def test_every_add_and_remove_ends_balanced_with_valid_copies(num_ps: int, shards: int, replicas: int) -> None:
    before = striped(num_ps, shards, replicas)
    for active in ([*range(num_ps + 1)], [*range(num_ps + 2)], [p for p in range(num_ps) if p != 1]):
        if len(active) < replicas:
            continue
        after = rb.rebalance(before, active, replicas)
        check(before, after, active, replicas)


def test_a_layout_with_a_promoted_backup_gets_a_new_one() -> None:
    before = {0: rb.Place(1, None), 1: rb.Place(1, 0)}  # shard 0 lost its backup in a failover
    after = rb.rebalance(before, [0, 1], 2)
    assert after[0] == rb.Place(1, 0) or after[0].backup not in (None, after[0].primary)


@pytest.mark.parametrize("active,match", [([], "cannot remove every PS"), ([0, 0], "names a PS twice"),
                                          ([-1, 0], "negative"), ([0], "replicas: 2 needs at least 2")])
def test_an_impossible_active_set_is_refused(active: list[int], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        rb.rebalance(striped(2, 4, 2), active, 2)


def test_replicas_other_than_one_or_two_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="replicas must be 1 or 2"):
        rb.rebalance(striped(2, 4, 1), [0, 1], 3)
