"""The old primary's side of moving a shard to another PS (elastic PS, docs/elastic.md): freeze and drain.

A move makes the new PS the shard's backup first (it catches up and receives every update, as any backup:
server/replication.py). Then the coordinator freezes the shard on its primary: from that moment the
primary admits no new push for it (a retryable "moving" error: the client re-reads placement and retries
with the same push id), and the freeze returns once every push admitted before it has finished, including
its wait for the backup, and the backup confirmed the shard's current version. The coordinator then bumps
the shard's epoch and makes the backup its primary: everything acknowledged is on the new primary, and a
push that was applied here but not acknowledged is retried there, where its push id (forwarded with the
update when it got there) deduplicates it. Exactly once, with the shard refusing pushes only between the
freeze and the switch.

A freeze is a lease: it ends by itself `lease_s` after its last progress (an admitted push finishing, the
drain returning), so a coordinator that dies mid-move cannot leave a shard frozen (the table was not
switched then, this PS is still the primary, and pushes resume), while a drain that is slow under load but
moving is not cut short.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

from pscluster.server.replicator import name_of
from pscluster.server.store import Key

from pscluster.errors import DeadlineExceededError, UnavailableError


class ShardGate:
    """Which shards of this PS are frozen for a move, and how many pushes each has in flight."""

    def __init__(self, ps_index: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ps_index = ps_index
        self._clock = clock
        self._cond = threading.Condition()
        self._frozen: dict[Key, float] = {}  # shard -> when its freeze lease ends
        self._inflight: Counter[Key] = Counter()

    @contextmanager
    def admit(self, keys: Iterable[Key]) -> Iterator[None]:
        """Hold keys in flight while the body runs (a push: apply and wait for the backup).

        Raises:
            UnavailableError: one of the shards is frozen for a move (retryable: re-read placement).
        """
        wanted = list(keys)
        with self._cond:
            now = self._clock()
            for key in wanted:
                until = self._frozen.get(key)
                if until is not None and now < until:
                    raise UnavailableError(f"{name_of(key)} is moving off ps {self.ps_index}; retry (placement "
                                           "changes within milliseconds)")
            self._inflight.update(wanted)
        try:
            yield
        finally:
            with self._cond:
                self._inflight.subtract(wanted)
                for key in wanted:
                    if self._inflight[key] <= 0:
                        del self._inflight[key]
                self._cond.notify_all()

    def freeze(self, key: Key, lease_s: float, drain: Callable[[float], None]) -> None:
        """Refuse new pushes for key, wait for those admitted already, then run drain(deadline) (wait for the
        backup to confirm the shard's version). The freeze is a lease of lease_s counted from its last
        progress (its start, an admitted push finishing, the drain's start and end): a slow drain under load
        does not end it while it moves, and a coordinator that died leaves it at most lease_s after that.

        Raises:
            DeadlineExceededError: no admitted push finished for lease_s (the shard is thawed).
        """
        with self._cond:
            deadline = self._frozen[key] = self._clock() + lease_s
            waiting = self._inflight.get(key, 0)
            while waiting > 0:
                now = self._clock()
                if self._inflight.get(key, 0) < waiting:  # progress: the lease starts again
                    waiting = self._inflight.get(key, 0)
                    deadline = self._frozen[key] = now + lease_s
                    continue
                if now >= deadline:
                    self._frozen.pop(key, None)
                    raise DeadlineExceededError(f"{name_of(key)}: {waiting} pushes still in flight on ps "
                                                f"{self.ps_index}, none finished for {lease_s:.3f} s; the move was "
                                                "abandoned")
                self._cond.wait(deadline - now)
            deadline = self._frozen[key] = self._clock() + lease_s
        try:
            drain(deadline)
        except BaseException:
            self.thaw([key])
            raise
        with self._cond:
            if key in self._frozen:  # not thawed meanwhile: the coordinator's switch gets a whole lease
                self._frozen[key] = self._clock() + lease_s

    def thaw(self, keys: Sequence[Key]) -> None:
        """End the freeze of keys (after the switch, or when a move is abandoned)."""
        with self._cond:
            for key in keys:
                self._frozen.pop(key, None)
            self._cond.notify_all()

    def frozen(self) -> list[Key]:
        """Shards frozen now (their lease has not ended)."""
        with self._cond:
            now = self._clock()
            return sorted(k for k, until in self._frozen.items() if now < until)
