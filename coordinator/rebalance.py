"""Which shards move where when a PS joins or leaves the active set: one pure function, no I/O.

`rebalance(layout, active, replicas)` takes where every shard lives now (ordinal -> primary, backup) and the
PS tasks that should hold shards from now on, and returns the layout to reach, moving as few shard copies
as it can:

- A copy on a PS that leaves the active set must move; a copy on an active PS stays unless its PS holds
  more than its share.
- Primaries are balanced by count: every active PS ends with floor(n/k) or ceil(n/k) of the n shards.
  A displaced primary prefers its own backup as the new primary (it holds the shard in sync already: the
  move is a freeze and a switch, no catch-up), then the PS holding the fewest primaries.
- With replicas: 2, backups are balanced the same way and never sit on their shard's primary; a shard
  whose backup was promoted, or whose backup leaves, gets one on the PS holding the fewest backups.
- Ties are broken by the lowest ordinal moving first and the lowest PS index receiving first, so the
  plan is the same on every run.

`moves(before, after)` lists the copies that change, for the executor (coordinator/replica_keeper.py) and
for an operator's dry run. docs/elastic.md explains the move protocol that carries a plan out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from pscluster.errors import InvalidArgumentError


class Place(NamedTuple):
    """Where one shard lives: its primary PS and its backup PS (None: one copy)."""

    primary: int
    backup: int | None = None


class Move(NamedTuple):
    """One copy of shard `ordinal` that changes PS: `role` is "primary" or "backup"; source None: it had none."""

    ordinal: int
    role: str
    source: int | None
    target: int


def check_active(current: Iterable[int], active: Sequence[int], replicas: int) -> None:
    """Refuse an active set that cannot hold the shards (empty, repeated, or fewer PS than copies).

    Raises:
        InvalidArgumentError: naming the bad set and what would be valid.
    """
    if len(set(active)) != len(active):
        raise InvalidArgumentError(f"the active PS set {list(active)} names a PS twice")
    if any(ps < 0 for ps in active):
        raise InvalidArgumentError(f"the active PS set {list(active)} holds a negative PS index")
    if not active:
        raise InvalidArgumentError(f"cannot remove every PS (active now: {sorted(set(current))}); at least one must "
                                   "hold the shards")
    if len(active) < replicas:
        raise InvalidArgumentError(f"replicas: {replicas} needs at least {replicas} active PS tasks; the plan leaves "
                                   f"{len(active)} ({list(active)})")


def rebalance(layout: Mapping[int, Place], active: Sequence[int], replicas: int = 1) -> dict[int, Place]:
    """The layout to reach so that only `active` PS tasks hold shards, balanced, with few moves (see above).

    Raises:
        InvalidArgumentError: `active` cannot hold the shards (see check_active), or replicas is not 1 or 2.
    """
    if replicas not in (1, 2):
        raise InvalidArgumentError(f"replicas must be 1 or 2, got {replicas}")
    check_active({p for place in layout.values() for p in place if p is not None}, active, replicas)
    order = sorted(active)
    primaries = _balance({o: p.primary for o, p in layout.items()}, order,
                         prefer={o: p.backup for o, p in layout.items() if p.backup is not None})
    if replicas == 1:
        return {o: Place(primaries[o]) for o in sorted(layout)}
    # a backup that stays where it is must not be its shard's new primary (it was promoted)
    backups = {o: (p.backup if p.backup is not None and p.backup != primaries[o] else None)
               for o, p in layout.items()}
    placed = _balance(backups, order, forbid=primaries)
    return {o: Place(primaries[o], placed[o]) for o in sorted(layout)}


def moves(before: Mapping[int, Place], after: Mapping[int, Place]) -> list[Move]:
    """The copies that change PS between two layouts of the same shards, primaries first, by ordinal."""
    out = [Move(o, "primary", before[o].primary, after[o].primary)
           for o in sorted(after) if before[o].primary != after[o].primary]
    for o in sorted(after):
        target = after[o].backup
        if target is not None and before[o].backup != target:
            out.append(Move(o, "backup", before[o].backup, target))
    return out


def _balance(current: Mapping[int, int | None], active: list[int], prefer: Mapping[int, int] | None = None,
             forbid: Mapping[int, int] | None = None) -> dict[int, int]:
    """One copy per shard on `active`, counts within one of each other, as few changes as possible.

    current: ordinal -> PS holding this copy now (None or an inactive PS: it must be placed). prefer: a PS
    to take a displaced copy when it is among the least loaded it may take; forbid: ordinal -> a PS that
    must not hold this copy (the shard's primary, for a backup).
    """
    prefer = prefer or {}
    forbid = forbid or {}
    n, k = len(current), len(active)
    cap = -(-n // k) if k else 0
    load = {ps: 0 for ps in active}
    placed: dict[int, int] = {}
    homeless: list[int] = []
    for o in sorted(current):
        ps = current[o]
        if ps is not None and ps in load and forbid.get(o) != ps and load[ps] < cap:
            placed[o] = ps
            load[ps] += 1
        else:
            homeless.append(o)  # lowest ordinals keep their place; the last ones past a full PS move

    def allowed(o: int) -> list[int]:
        return [ps for ps in active if forbid.get(o) != ps]

    for o in homeless:
        options = allowed(o)
        if not options:
            raise InvalidArgumentError(f"shard {o} has no PS to hold its copy among {active}")
        low = min(load[ps] for ps in options)
        least = [ps for ps in options if load[ps] == low]
        best = prefer[o] if prefer.get(o) in least else least[0]
        placed[o] = best
        load[best] += 1
    # counts within one: move copies from the fullest PS to the emptiest that may take them
    while True:
        high = max(active, key=lambda ps: (load[ps], -ps))
        moved = False
        for low in sorted(active, key=lambda ps: (load[ps], ps)):
            if load[high] - load[low] <= 1:
                break
            candidates = [o for o in sorted(placed) if placed[o] == high and forbid.get(o) != low]
            if candidates:
                o = next((c for c in candidates if prefer.get(c) == low), candidates[-1])
                placed[o] = low
                load[high] -= 1
                load[low] += 1
                moved = True
                break
        if not moved:
            return placed
