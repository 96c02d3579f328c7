"""What the coordinator daemon keeps for its remote clients, and how long their calls may wait.

Retention rule (`RetainedValues`): the RemoteValue of a closure a remote client scheduled is held
until a Fetch returns its result (then dropped), or until `ttl` seconds after it finished without
being fetched (a client that went away), whichever comes first. An unfinished closure is never
dropped. So the daemon holds at most the closures outstanding plus those finished in the last `ttl`
seconds; nothing grows with the number of closures a job has run.

Long polls (`LongPolls`): Join and Fetch wait inside a gRPC server thread. At most `limit` of them wait
at once, each for at most `slice_s` (the client polls again), so the server's other threads stay free
for workers' Register/Heartbeat and for Status. A poll beyond the cap is refused at once with
ResourceExhaustedError, which the client treats as "not done yet": it backs off and polls again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pscluster.coordinator.values import RemoteValue

from pscluster.errors import ResourceExhaustedError


class RetainedValues:
    """Strong references to remote clients' RemoteValues, dropped when fetched or expired."""

    def __init__(self, ttl: float, clock: Callable[[], float]) -> None:
        self._ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, tuple[float, RemoteValue]] = OrderedDict()  # oldest stamp first

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, value: RemoteValue) -> None:
        """Hold value for a remote client."""
        now = self._clock()
        with self._lock:
            self._entries[value.closure_id] = (now, value)
            self._expire(now)

    def touch(self, cid: int) -> None:
        """The closure finished: its result is kept for ttl from now unless fetched."""
        if cid not in self._entries:  # the embedded API's closures are never retained
            return
        now = self._clock()
        with self._lock:
            entry = self._entries.get(cid)
            if entry is not None:
                self._entries[cid] = (now, entry[1])
                self._entries.move_to_end(cid)
            self._expire(now)

    def release(self, cid: int) -> None:
        """The client fetched the result: stop holding it."""
        with self._lock:
            self._entries.pop(cid, None)

    def _expire(self, now: float) -> None:
        while self._entries:
            cid, (stamp, value) = next(iter(self._entries.items()))
            if now - stamp < self._ttl:
                return
            if value.done():
                del self._entries[cid]
            else:  # still running: keep it, look again in ttl (touch re-stamps it when it finishes)
                self._entries[cid] = (now, value)
                self._entries.move_to_end(cid)


class LongPolls:
    """A cap on client calls waiting at once, and on how long each waits."""

    def __init__(self, limit: int, slice_s: float) -> None:
        self.limit = limit
        self.slice_s = slice_s
        self._lock = threading.Lock()
        self.waiting = 0  # polls holding a slot now

    @contextmanager
    def slot(self, requested: float) -> Iterator[float]:
        """Yield how long this poll may wait (0 needs no slot).

        Raises:
            ResourceExhaustedError: `limit` polls already wait; poll again after a backoff.
        """
        wait = max(0.0, min(requested, self.slice_s))
        if wait == 0.0:
            yield 0.0
            return
        with self._lock:
            if self.waiting >= self.limit:
                raise ResourceExhaustedError(
                    f"{self.limit} client calls already wait on this coordinator (the cap keeps server threads "
                    f"free for worker heartbeats); poll again")
            self.waiting += 1
        try:
            yield wait
        finally:
            with self._lock:
                self.waiting -= 1
