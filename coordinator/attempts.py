"""Which framed connection carries which closure attempt: the bookkeeping of dispatch.FramedDispatcher as
plain decisions; no sockets, no lock, no threads (the dispatcher holds its lock around every call and does
the I/O the answers ask for).

A connection to a worker is idle (parked under its worker, reused by the next dispatch) or busy
(carrying one attempt, keyed (closure id, worker id)). When its reader gets a reply the connection is
parked again; when the connection breaks it is dropped. Abandoning an attempt, forgetting a worker or
closing everything marks connections abandoned: their late answer or failure reaches nobody and they
are never parked again. A worker is known from its first dispatch until it is forgotten.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

Key = tuple[int, str]  # (closure id, worker id): one attempt


class Carrier(Protocol):
    """What the bookkeeping reads and marks on a connection."""

    wid: str
    pending: Key | None  # the attempt it carries now
    abandoned: bool


C = TypeVar("C", bound=Carrier)


class Attempts(Generic[C]):
    """Idle connections per worker and the connection of each attempt in flight."""

    def __init__(self) -> None:
        self._idle: dict[str, list[C]] = {}
        self._busy: dict[Key, C] = {}

    def workers(self) -> set[str]:
        """Workers this dispatcher keeps connections for (idle lists, even empty ones, included)."""
        return set(self._idle)

    def reuse(self, wid: str) -> C | None:
        """An idle connection to wid, taken out of the idle list (None: open a new one)."""
        idle = self._idle.setdefault(wid, [])
        return idle.pop() if idle else None

    def carry(self, key: Key, conn: C) -> None:
        """conn carries the attempt key from now on."""
        conn.pending = key
        self._busy[key] = conn

    def answered(self, conn: C) -> Key | None:
        """A reply came on conn: the attempt it answers, or None if nobody waits for it; conn is parked
        for reuse unless it was abandoned or its worker forgotten."""
        pending = self._release(conn)
        if not conn.abandoned and conn.wid in self._idle:
            self._idle[conn.wid].append(conn)
        return None if conn.abandoned else pending

    def broke(self, conn: C) -> Key | None:
        """conn failed (its reader closes it): the attempt to fail, or None if nobody waits for it."""
        pending = self._release(conn)
        idle = self._idle.get(conn.wid, [])  # .get: a worker forgotten stays forgotten
        if conn in idle:
            idle.remove(conn)
        return None if conn.abandoned else pending

    def abandon(self, key: Key) -> C | None:
        """Stop waiting for an attempt: its connection, to shut down (None: it is not in flight)."""
        conn = self._busy.pop(key, None)
        if conn is not None:
            conn.abandoned = True
        return conn

    def forget(self, wid: str) -> list[C]:
        """The worker is gone: its idle connections, to shut down."""
        conns = self._idle.pop(wid, [])
        for conn in conns:
            conn.abandoned = True
        return conns

    def clear(self) -> list[C]:
        """Forget everything: every connection, to shut down."""
        conns = [c for cs in self._idle.values() for c in cs] + list(self._busy.values())
        self._idle.clear()
        self._busy.clear()
        for conn in conns:
            conn.abandoned = True
        return conns

    def _release(self, conn: C) -> Key | None:
        pending, conn.pending = conn.pending, None
        if pending is not None:
            self._busy.pop(pending, None)
        return pending
