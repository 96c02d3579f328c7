"""What threads other than the coordinator loop may read: an immutable snapshot the loop publishes.

The loop owns `SchedulerState` and mutates it; any other thread (status, metrics, `num_workers`, the
servicer's heartbeats) reads the latest `Snapshot` instead, swapped in by one attribute assignment
after each batch of events. Nothing in a snapshot is shared with the loop's mutable state.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from pscluster.coordinator.scheduler import SchedulerState

RATE_WINDOW_S = 10.0


class WorkerView(NamedTuple):
    """One registered worker as of the snapshot."""

    wid: str
    address: str
    index: int
    state: str
    done: int
    last_seen: float
    inflight: tuple[int, ...]
    steps_per_s: float


class Snapshot(NamedTuple):
    """Counters and membership as of the end of one batch of loop events (immutable: a NamedTuple,
    cheap enough to build after every batch)."""

    queued: int = 0
    running: int = 0
    completed: int = 0
    retried: int = 0
    failed: int = 0
    paused: bool = False
    workers: tuple[WorkerView, ...] = ()

    @property
    def alive(self) -> int:
        """Workers registered and not leaving."""
        return sum(1 for w in self.workers if w.state == "alive")

    def knows(self, wid: str) -> bool:
        """True if wid is registered (alive or leaving)."""
        return any(w.wid == wid for w in self.workers)


def take(state: SchedulerState, rates: dict[str, float]) -> Snapshot:
    """A snapshot of state (called by the loop, the state's only owner)."""
    workers = tuple(WorkerView(w.wid, w.address, w.index, w.state, w.done, w.last_seen, tuple(w.inflight),
                               rates.get(w.wid, 0.0))
                    for w in state.workers.values())
    return Snapshot(len(state.queue), state.running(), state.completed, state.retried, state.failed,
                    state.paused, workers)


class RateMeter:
    """Closures completed per second by each worker over the last RATE_WINDOW_S, sampled at ticks.

    Owned by the loop: one (time, done) sample per worker per tick, kept for one window, and only for
    workers still registered, so it is bounded by workers x samples per window.
    """

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self._window = window
        self._samples: dict[str, deque[tuple[float, int]]] = {}
        self.rates: dict[str, float] = {}

    def sample(self, state: SchedulerState, now: float) -> None:
        """Record each worker's done count at now; recompute rates; forget workers that are gone."""
        samples = {}
        for wid, worker in state.workers.items():
            series = self._samples.get(wid) or deque()
            series.append((now, worker.done))
            while series and now - series[0][0] > self._window:
                series.popleft()
            samples[wid] = series
        self._samples = samples
        self.rates = {wid: (s[-1][1] - s[0][1]) / self._window for wid, s in samples.items()}
