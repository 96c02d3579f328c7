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
    """Which shards of this PS are frozen for a move, and how many pushes each has in flight (per step)."""

    def __init__(self, ps_index: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ps_index = ps_index
        self._clock = clock
        self._cond = threading.Condition()
        self._frozen: dict[Key, float] = {}  # shard -> when its freeze lease ends
        self._inflight: dict[tuple[Key, int], int] = {}  # (shard, step) -> pushes in flight
        self._open: dict[Key, frozenset[int]] = {}  # a sync job's frozen shard -> the steps it still admits
        self._progress: Counter[Key] = Counter()  # pushes admitted into or finished on a frozen shard

    @contextmanager
    def admit(self, keys: Iterable[Key], step: int = 0) -> Iterator[None]:
        """Hold keys in flight while the body runs (a push of `step`: apply and wait for the backup).

        Raises:
            UnavailableError: one of the shards is frozen for a move (retryable: re-read placement).
        """
        wanted = [(key, step) for key in keys]
        inflight = self._inflight
        # plain dict operations, not Counter's update/subtract (~25 us per replicated push in B15FLOOR)
        with self._cond:
            if self._frozen:
                now = self._clock()
                for key, _ in wanted:
                    until = self._frozen.get(key)
                    if until is not None and now < until and step not in self._open.get(key, ()):
                        raise UnavailableError(f"{name_of(key)} is moving off ps {self.ps_index}; retry (placement "
                                               "changes within milliseconds)")
                self._progress.update(key for key, _ in wanted if key in self._frozen)
            for held in wanted:
                inflight[held] = inflight.get(held, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                for held in wanted:
                    left = inflight[held] - 1
                    if left > 0:
                        inflight[held] = left
                    else:
                        del inflight[held]
                if self._frozen:  # only a freeze waits here (it set its shard in _frozen first, under the lock)
                    self._progress.update(key for key, _ in wanted if key in self._frozen)
                    self._cond.notify_all()

    def _waiting(self, key: Key) -> int:
        return sum(n for (k, _), n in self._inflight.items() if k == key)

    def freeze(self, key: Key, lease_s: float, drain: Callable[[float], None], between_steps: bool = False,
               on_frozen: Callable[[], None] | None = None) -> None:
        """Refuse new pushes for key, wait for those admitted already, then run drain(deadline) (wait for the
        backup to confirm the shard's version). The freeze is a lease of lease_s counted from its last
        progress (its start, a push admitted or finished, the drain's start and end): a slow drain under load
        does not end it while it moves, and a coordinator that died leaves it at most lease_s after that.

        between_steps (a sync job): a step's pushes wait for each other, so the steps with a push in flight
        stay open: their other replicas' pushes are still admitted, the next step's are refused, and the
        freeze waits until the open steps settled (the move falls between two steps).

        on_frozen (outside this gate's lock): called once new calls are refused, before the wait for those
        admitted: it wakes admitted calls that wait for something the freeze holds back (the sync state's
        token waiters), so that they leave with a retryable error instead of holding the freeze.

        Raises:
            DeadlineExceededError: no push was admitted or finished for lease_s (the shard is thawed).
            UnavailableError: the shard was thawed (`thaw`) while the freeze waited; it stays thawed.
        """
        with self._cond:
            deadline = self._frozen[key] = self._clock() + lease_s
            if between_steps:
                self._open[key] = frozenset(step for k, step in self._inflight if k == key)
            self._progress[key] = 0
        if on_frozen is not None:
            on_frozen()
        with self._cond:
            seen = 0
            while True:
                if key not in self._frozen:  # thawed meanwhile (the coordinator's FreezeShard timed out): the
                    raise UnavailableError(f"{name_of(key)} was thawed on ps {self.ps_index} while its freeze "
                                           "waited for admitted pushes; the move was abandoned")  # pushes resume
                if self._waiting(key) <= 0:
                    break
                now = self._clock()
                if self._progress[key] != seen:  # progress: the lease starts again
                    seen = self._progress[key]
                    deadline = self._frozen[key] = now + lease_s
                    continue
                if now >= deadline:
                    waiting = self._waiting(key)
                    self._end(key)
                    raise DeadlineExceededError(f"{name_of(key)}: {waiting} pushes still in flight on ps "
                                                f"{self.ps_index}, none finished for {lease_s:.3f} s; the move was "
                                                "abandoned")
                self._cond.wait(deadline - now)
            self._open.pop(key, None)  # settled: every later push goes to the successor
            deadline = self._frozen[key] = self._clock() + lease_s
        try:
            drain(deadline)
        except BaseException:
            self.thaw([key])
            raise
        with self._cond:
            if key in self._frozen:  # not thawed meanwhile: the coordinator's switch gets a whole lease
                self._frozen[key] = self._clock() + lease_s

    def _end(self, key: Key) -> None:
        self._frozen.pop(key, None)
        self._open.pop(key, None)
        self._progress.pop(key, None)

    def thaw(self, keys: Sequence[Key]) -> None:
        """End the freeze of keys (after the switch, or when a move is abandoned)."""
        with self._cond:
            for key in keys:
                self._end(key)
            self._cond.notify_all()

    def is_frozen(self, key: Key) -> bool:
        """Whether key is frozen now (its lease has not ended)."""
        with self._cond:
            until = self._frozen.get(key)
            return until is not None and self._clock() < until

    def frozen(self) -> list[Key]:
        """Shards frozen now (their lease has not ended)."""
        with self._cond:
            now = self._clock()
            return sorted(k for k, until in self._frozen.items() if now < until)
