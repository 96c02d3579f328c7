"""Closure scheduling and worker membership as one pure state machine.

`decide(state, event, now)` updates `state` in place and returns the side effects to perform as
`Action`s; it does no I/O and reads no clock, so every path (dispatch, completion, worker loss,
rejoin, user error, cancellation, PS outage) is unit-tested by feeding events. The executor in
`coordinator.py` performs the actions (RPCs, resolving RemoteValues) and feeds results back as events.

Closure lifecycle: queued -> running -> done | failed | cancelled; running -> queued when its worker
dies, hangs (missed heartbeats), leaves, or the closure hit an unavailable PS. A record is dropped the
moment its closure reaches a final state (the Resolve/Cancel/FailUnscheduled action carries all the
executor needs), so the state holds only queued and running closures; counters replace scans.
Worker lifecycle: alive -> leaving (SIGTERM: no new work) -> gone; alive -> gone (death, hang).
Jobs (job_queues.py): every closure belongs to a job (one client program); queues are served
round-robin over jobs; a job's user error cancels only that job's queue; a job ends on EndJob or
after job_idle_timeout without a keepalive, its queued closures cancelled.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from pscluster.coordinator.events import (
    Abandon,
    Action,
    Cancel,
    Dispatch,
    EndJob,
    ErrorReported,
    Event,
    FailUnscheduled,
    Finished,
    Heartbeat,
    JobEnded,
    KeepJob,
    Leave,
    OpenJob,
    PsDown,
    PsUp,
    Register,
    Registered,
    Resolve,
    SetConcurrency,
    Submit,
    Tick,
    TransportFailed,
    WatchPs,
    WorkerGone,
)
from pscluster.coordinator.job_queues import MAIN, JobQueues

__all__ = [  # the events and actions are re-exported: the coordinator speaks of sch.Submit, sch.Dispatch, ...
    "Submit", "OpenJob", "KeepJob", "EndJob", "Register", "Heartbeat", "Leave", "Finished", "TransportFailed", "Tick",
    "PsDown", "PsUp", "SetConcurrency", "ErrorReported", "Dispatch", "Resolve", "Cancel", "Abandon", "WorkerGone",
    "Registered", "WatchPs", "FailUnscheduled", "JobEnded", "Event", "Action", "ClosureRec", "WorkerRec",
    "EndedJob", "SchedulerState", "ENDED_JOBS_SHOWN", "MAIN", "JobQueues", "decide",
]

ClosureState = Literal["queued", "running", "done", "failed", "cancelled"]


@dataclass
class ClosureRec:
    """Scheduling record of one closure."""

    cid: int
    job: str = MAIN
    state: ClosureState = "queued"
    workers: set[str] = field(default_factory=set)  # workers running an attempt now
    attempts: int = 0


@dataclass
class WorkerRec:
    """Membership record of one worker."""

    wid: str
    address: str
    index: int
    last_seen: float
    state: Literal["alive", "leaving"] = "alive"
    closure_address: str = ""  # framed closure port, if the worker has one
    inflight: set[int] = field(default_factory=set)
    done: int = 0


ENDED_JOBS_SHOWN = 8  # `pscluster status` shows the last few ended jobs; older ones are forgotten


class EndedJob(NamedTuple):
    """A job that ended: its final counters, for status."""

    job: str
    completed: int
    failed: int
    reason: str


@dataclass
class SchedulerState:
    """Everything the scheduler decides from."""

    max_inflight: int = 1
    heartbeat_timeout: float = 2.0
    max_attempts: int = 10
    no_worker_timeout: float | None = 300.0
    job_idle_timeout: float | None = 30.0
    closures: dict[int, ClosureRec] = field(default_factory=dict)
    queue: JobQueues = field(default_factory=JobQueues)
    workers: dict[str, WorkerRec] = field(default_factory=dict)
    next_index: int = 0
    paused: bool = False  # a PS is down: dispatch nothing until it is back
    max_running: int | None = None  # sync mode: at most N (total_num_replicas) closures at once
    no_worker_since: float | None = None
    retried: int = 0
    failed: int = 0
    completed: int = 0
    num_running: int = 0  # closures in state "running", kept by _move
    next_cid: int = 0  # one past the highest closure id submitted
    ended_jobs: deque[EndedJob] = field(default_factory=lambda: deque(maxlen=ENDED_JOBS_SHOWN))

    def __post_init__(self) -> None:
        self.queue.open(MAIN, 0.0, expires=False)

    def running(self) -> int:
        """Closures running now."""
        return self.num_running

    def unfinished(self) -> int:
        """Closures queued or running."""
        return len(self.queue) + self.running()

    def final_below(self) -> int:
        """The lowest id of a closure that is not final (every closure below it is), for the PS's record.

        Ids are submitted in increasing order (the coordinator allocates and enqueues under one lock),
        so `closures`, which holds exactly the closures not final yet, is ordered by id.
        """
        return next(iter(self.closures), self.next_cid)


def decide(state: SchedulerState, event: Event, now: float) -> list[Action]:
    """Apply one event to state; return the actions to perform, dispatches last."""
    actions: list[Action] = []
    if isinstance(event, Submit):
        state.next_cid = max(state.next_cid, event.cid + 1)
        job = state.queue.jobs.get(event.job)
        if job is None:
            actions.append(Cancel(event.cid, f"cancelled: job {event.job} has ended"))
        else:
            job.last_seen = now
            state.closures[event.cid] = ClosureRec(event.cid, event.job)
            state.queue.push(event.job, event.cid)
    elif isinstance(event, OpenJob):
        state.queue.open(event.job, now)
    elif isinstance(event, KeepJob):
        if event.job in state.queue.jobs:
            state.queue.jobs[event.job].last_seen = now
    elif isinstance(event, EndJob):
        actions += _end_job(state, event.job, event.reason)
    elif isinstance(event, Register):
        old = state.workers.get(event.wid)
        if old is None:
            state.workers[event.wid] = WorkerRec(event.wid, event.address, state.next_index, now,
                                                 closure_address=event.closure_address)
            state.next_index += 1
            actions.append(Registered(event.wid, state.next_index - 1))
        else:
            old.last_seen = now
            actions.append(Registered(event.wid, old.index, new=False))
    elif isinstance(event, Heartbeat):
        if event.wid in state.workers:
            state.workers[event.wid].last_seen = now
    elif isinstance(event, Leave):
        worker = state.workers.get(event.wid)
        if worker is not None:
            if worker.inflight:
                worker.state = "leaving"
            else:
                actions += _lose_worker(state, worker, "left (preempted)")
    elif isinstance(event, Finished):
        actions += _finished(state, event)
    elif isinstance(event, TransportFailed):
        worker = state.workers.get(event.wid)
        if worker is not None and event.cid in worker.inflight:
            actions += _lose_worker(state, worker, event.reason)
    elif isinstance(event, Tick):
        for worker in list(state.workers.values()):
            if now - worker.last_seen > state.heartbeat_timeout:
                actions += _lose_worker(
                    state, worker, f"missed heartbeats for {now - worker.last_seen:.1f} s "
                                   f"(timeout {state.heartbeat_timeout:.1f} s)")
        for idle in state.queue.idle(now, state.job_idle_timeout):
            actions += _end_job(state, idle, f"no keepalive from its client for more than "
                                            f"{state.job_idle_timeout:g} s (job_idle_timeout_s)")
        actions += _check_starvation(state, now)
    elif isinstance(event, PsDown):
        state.paused = True
    elif isinstance(event, PsUp):
        state.paused = False
    elif isinstance(event, SetConcurrency):
        state.max_running = event.limit
    elif isinstance(event, ErrorReported):
        if event.job in state.queue.jobs:
            state.queue.jobs[event.job].error_cid = None
    return actions + _dispatch(state)


def _move(state: SchedulerState, rec: ClosureRec, to: ClosureState) -> None:
    """The one place a closure changes state: keeps the running counts and drops final records."""
    delta = (to == "running") - (rec.state == "running")
    state.num_running += delta
    job = state.queue.jobs.get(rec.job)
    if job is not None:
        job.running += delta
        job.completed += to == "done"
        job.failed += to == "failed"
    rec.state = to
    if to in ("done", "failed", "cancelled"):
        del state.closures[rec.cid]


def _end_job(state: SchedulerState, job: str, reason: str) -> list[Action]:
    if job not in state.queue.jobs or job == MAIN:
        return []
    actions = _cancel_queued(state, job, f"job {job} ended: {reason}")
    rec = state.queue.jobs[job]
    state.ended_jobs.append(EndedJob(job, rec.completed, rec.failed, reason))
    state.queue.close(job)
    return actions + [JobEnded(job, reason)]


def _finished(state: SchedulerState, event: Finished) -> list[Action]:
    actions: list[Action] = []
    worker = state.workers.get(event.wid)
    if worker is not None:
        worker.inflight.discard(event.cid)
        if event.outcome == "ok":
            worker.done += 1
    rec = state.closures.get(event.cid)
    if rec is None or rec.state != "running":
        return actions  # a late answer from an attempt that was already replaced or resolved
    rec.workers.discard(event.wid)
    if event.outcome == "retry":
        if not rec.workers:
            _move(state, rec, "queued")
            actions += _requeue(state, rec)
            state.retried += 1
            if not state.paused:
                state.paused = True
                actions.append(WatchPs())
    else:
        _move(state, rec, "done" if event.outcome == "ok" else "failed")
        actions.append(Resolve(rec.cid))
        for other in rec.workers:  # first answer wins; stop waiting for duplicates
            if other in state.workers:
                state.workers[other].inflight.discard(rec.cid)
            actions.append(Abandon(rec.cid, other))
        rec.workers.clear()
        if event.outcome == "ok":
            state.completed += 1
        else:
            state.failed += 1
            job = state.queue.jobs.get(rec.job)
            if job is not None and job.error_cid is None:
                job.error_cid = rec.cid
            actions += _cancel_queued(state, rec.job, f"closure {rec.cid} raised an error")
    if worker is not None and worker.state == "leaving" and not worker.inflight:
        actions += _lose_worker(state, worker, "left (preempted) after finishing its closures")
    return actions


def _cancel_queued(state: SchedulerState, job: str, reason: str) -> list[Action]:
    actions: list[Action] = []
    for cid in state.queue.drain(job):
        _move(state, state.closures[cid], "cancelled")
        actions.append(Cancel(cid, f"cancelled: {reason}"))
    return actions


def _requeue(state: SchedulerState, rec: ClosureRec) -> list[Action]:
    """Put a closure that lost its attempt back at the head of its job's queue, or cancel it if its
    job has ended meanwhile (nobody waits for it)."""
    if rec.job in state.queue.jobs:
        state.queue.push(rec.job, rec.cid, front=True)
        return []
    _move(state, rec, "cancelled")
    return [Cancel(rec.cid, f"cancelled: job {rec.job} has ended")]


def _lose_worker(state: SchedulerState, worker: WorkerRec, reason: str) -> list[Action]:
    del state.workers[worker.wid]
    actions: list[Action] = []
    requeued = []
    for cid in sorted(worker.inflight):
        rec = state.closures[cid]
        rec.workers.discard(worker.wid)
        actions.append(Abandon(cid, worker.wid))
        if rec.state == "running" and not rec.workers:
            if rec.attempts >= state.max_attempts:
                _move(state, rec, "failed")
                state.failed += 1
                actions.append(FailUnscheduled(cid, f"closure {cid} lost its worker {rec.attempts} times; "
                                                    f"last: worker {worker.index} ({worker.address}) {reason}"))
                continue
            _move(state, rec, "queued")
            requeued.append(cid)
    for cid in reversed(requeued):
        actions += _requeue(state, state.closures[cid])
    state.retried += len(requeued)
    actions.insert(0, WorkerGone(worker.wid, worker.address, f"worker {worker.index} ({worker.address}) {reason}",
                                 tuple(requeued)))
    return actions


def _check_starvation(state: SchedulerState, now: float) -> list[Action]:
    if not state.queue or any(w.state == "alive" for w in state.workers.values()):
        state.no_worker_since = None
        return []
    if state.no_worker_since is None:
        state.no_worker_since = now
        return []
    if state.no_worker_timeout is None or now - state.no_worker_since < state.no_worker_timeout:
        return []
    actions: list[Action] = []
    reason = (f"no live worker for {now - state.no_worker_since:.0f} s "
              f"(no_worker_timeout_s={state.no_worker_timeout:g}); start a worker or raise the timeout")
    for cid in state.queue.drain():
        _move(state, state.closures[cid], "failed")
        state.failed += 1
        actions.append(FailUnscheduled(cid, reason))
    state.no_worker_since = None  # closures submitted later wait a full timeout of their own
    return actions


def _dispatch(state: SchedulerState) -> list[Action]:
    if state.paused or not state.queue:
        return []
    actions: list[Action] = []
    # Least-loaded first, so a new worker picks up work at once and stragglers get less. Only workers with
    # a free slot can take one (while closures queue up, most events find none: nothing to sort).
    workers = [w for w in state.workers.values() if w.state == "alive" and len(w.inflight) < state.max_inflight]
    if not workers:
        return []
    workers.sort(key=lambda w: (len(w.inflight), w.index))
    budget = None if state.max_running is None else state.max_running - state.running()
    progress = True
    while state.queue and progress and (budget is None or budget > 0):
        progress = False
        for worker in workers:
            if not state.queue or (budget is not None and budget <= 0):
                break
            if len(worker.inflight) >= state.max_inflight:
                continue
            cid = state.queue.pop_next()
            rec = state.closures[cid]
            _move(state, rec, "running")
            rec.attempts += 1
            rec.workers.add(worker.wid)
            worker.inflight.add(cid)
            actions.append(Dispatch(cid, worker.wid, worker.address, rec.attempts, worker.closure_address))
            progress = True
            if budget is not None:
                budget -= 1
    return actions
