"""What threads other than the coordinator loop may read: an immutable snapshot the loop publishes.

The loop owns `SchedulerState` and mutates it; any other thread (status, metrics, `num_workers`, the
servicer's heartbeats) reads the latest `Snapshot` instead, swapped in by one attribute assignment
after each batch of events. Nothing in a snapshot is shared with the loop's mutable state.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from pscluster.coordinator.scheduler import EndedJob, SchedulerState
from pscluster.proto import pscluster_pb2 as pb

RATE_WINDOW_S = 10.0


class WorkerView(NamedTuple):
    """One registered worker as of the snapshot."""

    wid: str
    address: str
    index: int  # type: ignore[assignment]  # a field named like tuple.index: WorkerView.index is the worker's
    state: str
    done: int
    last_seen: float
    inflight: tuple[int, ...]
    steps_per_s: float


class JobView(NamedTuple):
    """One job as of a snapshot."""

    job: str
    queued: int
    running: int
    completed: int
    failed: int
    last_seen: float
    expires: bool


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
    jobs: tuple[JobView, ...] = ()
    ended_jobs: tuple[EndedJob, ...] = ()

    @property
    def alive(self) -> int:
        """Workers registered and not leaving."""
        return sum(1 for w in self.workers if w.state == "alive")

    def knows(self, wid: str) -> bool:
        """True if wid is registered (alive or leaving)."""
        return any(w.wid == wid for w in self.workers)


def take(state: SchedulerState, meter: RateMeter) -> Snapshot:
    """A snapshot of state (called by the loop, the state's only owner)."""
    workers = tuple(WorkerView(w.wid, w.address, w.index, w.state, w.done, w.last_seen, tuple(w.inflight),
                               meter.rate(w.wid, w.done))
                    for w in state.workers.values())
    jobs = tuple(JobView(j.job, len(j.queue), j.running, j.completed, j.failed, j.last_seen, j.expires)
                 for j in state.queue.jobs.values())
    return Snapshot(len(state.queue), state.running(), state.completed, state.retried, state.failed,
                    state.paused, workers, jobs, tuple(state.ended_jobs))


def to_status(snap: Snapshot, now: float, *, lost_updates: int, global_step: int,
              sync_mode: str, lost_by_variable: dict[str, int] | None = None) -> pb.CoordinatorStatus:
    """A snapshot as the Status reply (`pscluster status`); a job's idle time is counted to now."""
    workers = [pb.WorkerState(worker_id=w.wid, address=w.address, state=w.state, closures_done=w.done,
                              steps_per_s=w.steps_per_s) for w in snap.workers]
    jobs = [pb.JobState(job=j.job, queued=j.queued, running=j.running, done=j.completed, failed=j.failed,
                        idle_s=now - j.last_seen if j.expires else 0.0) for j in snap.jobs]
    jobs += [pb.JobState(job=e.job, done=e.completed, failed=e.failed, ended=e.reason) for e in snap.ended_jobs]
    return pb.CoordinatorStatus(queued=snap.queued, running=snap.running, done=snap.completed,
                                retried=snap.retried, failed=snap.failed, workers=workers, lost_updates=lost_updates,
                                global_step=global_step, sync_mode=sync_mode, jobs=jobs,
                                lost_updates_by_variable={k: v for k, v in (lost_by_variable or {}).items() if v})


class RateMeter:
    """Closures completed per second by each worker over the last RATE_WINDOW_S.

    Owned by the loop: at each tick, one (time, done) sample per worker, kept for one window and only
    for workers still registered (bounded by workers x samples per window). The rate is the done count
    now minus the count at the oldest sample in the window; a worker not sampled yet registered less
    than a tick ago, with 0 done.
    """

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self._window = window
        self._samples: dict[str, deque[tuple[float, int]]] = {}

    def sample(self, state: SchedulerState, now: float) -> None:
        """Record each worker's done count at now; forget workers that are gone."""
        samples = {}
        for wid, worker in state.workers.items():
            series = self._samples.get(wid) or deque([(now, 0)])
            series.append((now, worker.done))
            while now - series[0][0] > self._window:
                series.popleft()
            samples[wid] = series
        self._samples = samples

    def rate(self, wid: str, done: int) -> float:
        """Closures per second by wid over the window, given its done count now."""
        series = self._samples.get(wid)
        return (done - (series[0][1] if series else 0)) / self._window
