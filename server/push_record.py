"""A shard's exactly-once record: the push ids it applied, kept only while a copy can still arrive.

A closure's n-th push has the id `c<closure id>.<n>` (pscluster/client/context.py), the same in every attempt,
so a rescheduled closure re-sends ids the shard may have applied already. A copy can arrive only while
the closure is not final: once the coordinator has resolved it, no attempt of it may change anything.
The coordinator says how far that holds: every push carries `final_below`, the lowest id among its
closures that are not final yet (ids rise with submission, one prefix per coordinator: the top bits).
So the record keeps, per coordinator prefix, the ids of closures at or above that mark, and a push of
a closure below it that is not in the record is a late copy (a SIGSTOPped attempt waking up long after
its closure finished elsewhere): refused, never applied. The record's size follows the closures in
flight, not the steps a job has taken (B11: PS RSS flat over 10 minutes of churn).

Ids of pushes made outside closures (`u<uuid>`) can only be re-sent by the client's own retry of one
call, within seconds: the newest OTHER_IDS of them are kept. A coordinator's record is dropped when
PREFIXES newer coordinators have pushed since (a coordinator restart starts a new prefix).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

OTHER_IDS = 4096
PREFIXES = 16


PushKey = tuple[str, "int | None"]  # a push id and the closure id in it (parsed once per push, not per shard)


def closure_of(push_id: str) -> int | None:
    """The closure id in `c<closure id>.<n>`, or None for another kind of id."""
    if not push_id.startswith("c"):
        return None
    head, dot, _ = push_id.partition(".")
    try:
        return int(head[1:]) if dot else None
    except ValueError:
        return None


def push_key(push_id: str) -> PushKey:
    """push_id with its closure id, for the `*_key` methods."""
    return push_id, closure_of(push_id)


class PushRecord:
    """Applied push ids of one shard (see the module docstring); the shard's lock guards it."""

    def __init__(self, window: int = 1_000_000) -> None:
        self._window = window  # a cap per prefix whatever the coordinator says (a safety net)
        # prefix -> id -> (closure id, the shard version the push was applied at)
        self._by_prefix: OrderedDict[int, OrderedDict[str, tuple[int, int]]] = OrderedDict()
        self._final_below: dict[int, int] = {}
        self._other: OrderedDict[str, int] = OrderedDict()  # id -> version applied at
        self._newest: tuple[int, OrderedDict[str, tuple[int, int]]] | None = None  # last prefix used, its ids

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._by_prefix.values()) + len(self._other)

    def advance(self, final_below: int) -> None:
        """Every closure of final_below's coordinator below it is final: forget their ids."""
        if final_below <= 0:
            return
        prefix = final_below >> 32
        if final_below <= self._final_below.get(prefix, 0):
            return
        self._final_below[prefix] = final_below
        ids = self._prefix(prefix)
        # ids are in apply order, which follows closure order up to the closures in flight
        while ids:
            pid, (cid, _) = next(iter(ids.items()))
            if cid >= final_below:
                break
            del ids[pid]

    def seen(self, push_id: str) -> bool:
        """True if push_id was applied, or is a late copy from a closure that is final already."""
        return self.seen_key(push_key(push_id))

    def seen_key(self, key: PushKey) -> bool:
        """`seen` for a parsed push id."""
        push_id, cid = key
        if cid is None:
            return push_id in self._other
        ids = self._by_prefix.get(cid >> 32)
        if ids is not None and push_id in ids:
            return True
        return cid < self._final_below.get(cid >> 32, 0)

    def applied_at(self, push_id: str) -> int | None:
        """The shard version push_id was applied at, if the record holds it (None for a late copy).

        A repeated push answers with this version, not the shard's current one: the coordinator counts the
        updates a PS restart lost by version, and the current version belongs to another push.
        """
        return self.applied_at_key(push_key(push_id))

    def applied_at_key(self, key: PushKey) -> int | None:
        """`applied_at` for a parsed push id."""
        push_id, cid = key
        if cid is None:
            return self._other.get(push_id)
        ids = self._by_prefix.get(cid >> 32)
        entry = ids.get(push_id) if ids is not None else None
        return entry[1] if entry is not None else None

    def add(self, push_id: str, version: int = 0) -> None:
        """Note push_id as applied at shard version `version`."""
        self.add_key(push_key(push_id), version)

    def add_key(self, key: PushKey, version: int = 0) -> None:
        """`add` for a parsed push id."""
        push_id, cid = key
        if cid is None:
            self._other[push_id] = version
            if len(self._other) > min(OTHER_IDS, self._window):
                self._other.popitem(last=False)
            return
        ids = self._prefix(cid >> 32)
        ids[push_id] = (cid, version)
        if len(ids) > self._window:
            ids.popitem(last=False)

    def _prefix(self, prefix: int) -> OrderedDict[str, tuple[int, int]]:
        newest = self._newest
        if newest is not None and newest[0] == prefix:  # one coordinator pushing: the common case
            return newest[1]
        ids = self._by_prefix.get(prefix)
        if ids is None:
            ids = self._by_prefix[prefix] = OrderedDict()
            while len(self._by_prefix) > PREFIXES:
                old, _ = self._by_prefix.popitem(last=False)
                self._final_below.pop(old, None)
        else:
            self._by_prefix.move_to_end(prefix)
        self._newest = (prefix, ids)
        return ids

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON-able)."""
        closures = [(pid, version) for ids in self._by_prefix.values() for pid, (_, version) in ids.items()]
        pairs = closures + list(self._other.items())
        return {"ids": [pid for pid, _ in pairs], "versions": [version for _, version in pairs],
                "final_below": sorted(self._final_below.values())}

    @classmethod
    def from_state(cls, state: dict[str, Any] | list[str], window: int = 1_000_000,
                   version: int = 0) -> PushRecord:
        """A record from `state()` (or the plain id list older checkpoints hold). Ids saved without their
        version (older checkpoints) get `version`: the shard's version in that checkpoint, which holds them."""
        record = cls(window)
        ids, marks = (state, []) if isinstance(state, list) else (state.get("ids", []), state.get("final_below", []))
        versions = [] if isinstance(state, list) else state.get("versions", [])
        if len(versions) != len(ids):
            versions = [version] * len(ids)
        for pid, applied in zip(ids, versions):
            record.add(pid, int(applied))
        for mark in marks:
            record.advance(int(mark))
        return record
