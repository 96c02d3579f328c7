"""Jobs and their closure queues, served round-robin (pure data; `scheduler.decide` drives it).

A job is one client program: the embedded `ClusterCoordinator`'s own program (job `MAIN`, never
idle) or one `RemoteCoordinator` session on a coordinator daemon. Each job has its own FIFO queue;
`pop_next` takes one closure from each job with queued work in turn, so a job with 10,000 queued
closures delays a job with 1 queued closure by at most one closure per worker slot, never by its
whole queue. A job ends when its client says so or after `idle_timeout` s without a keepalive;
its record (queue, counters) is then dropped, so nothing here grows with the jobs a daemon has run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

MAIN = "main"  # the embedded program's job


@dataclass
class JobRec:
    """One client program's queue and counters."""

    job: str
    last_seen: float
    expires: bool = True  # False for MAIN: the embedded program ends with the coordinator
    queue: deque[int] = field(default_factory=deque)
    running: int = 0
    completed: int = 0
    failed: int = 0
    error_cid: int | None = None  # first closure that raised, until the job's join reports it


@dataclass
class JobQueues:
    """Every live job's queue, plus the round-robin turn over jobs with queued closures."""

    jobs: dict[str, JobRec] = field(default_factory=dict)
    turn: deque[str] = field(default_factory=deque)  # jobs with queued work, next to serve first
    queued: int = 0  # sum of the queues' lengths

    def __bool__(self) -> bool:
        return self.queued > 0

    def __len__(self) -> int:
        return self.queued

    def __iter__(self) -> Iterator[int]:
        """Queued closure ids, job by job in turn order (for tests and status)."""
        for job in self.turn:
            yield from self.jobs[job].queue

    def open(self, job: str, now: float, expires: bool = True) -> bool:
        """Start job (or refresh it); False if it already existed."""
        rec = self.jobs.get(job)
        if rec is not None:
            rec.last_seen = now
            return False
        self.jobs[job] = JobRec(job, now, expires)
        return True

    def push(self, job: str, cid: int, front: bool = False) -> None:
        """Queue cid in job (front: a retry goes before the job's other closures)."""
        rec = self.jobs[job]
        if not rec.queue:
            if front:
                self.turn.appendleft(job)
            else:
                self.turn.append(job)
        if front:
            rec.queue.appendleft(cid)
        else:
            rec.queue.append(cid)
        self.queued += 1

    def pop_next(self) -> int:
        """The next closure to run: the head of the job whose turn it is; that job goes to the back."""
        job = self.turn.popleft()
        rec = self.jobs[job]
        cid = rec.queue.popleft()
        self.queued -= 1
        if rec.queue:
            self.turn.append(job)
        return cid

    def drain(self, job: str | None = None) -> list[int]:
        """Remove and return every queued closure of job (None: of every job)."""
        jobs = list(self.turn) if job is None else ([job] if job in self.turn else [])
        cids: list[int] = []
        for name in jobs:
            rec = self.jobs[name]
            cids += rec.queue
            self.queued -= len(rec.queue)
            rec.queue.clear()
            self.turn.remove(name)
        return cids

    def idle(self, now: float, timeout: float | None) -> list[str]:
        """Jobs that expire and were not seen for more than timeout s."""
        if timeout is None:
            return []
        return [j.job for j in self.jobs.values() if j.expires and now - j.last_seen > timeout]

    def close(self, job: str) -> JobRec | None:
        """Drop job (its queue must have been drained); its record, or None if unknown."""
        rec = self.jobs.pop(job, None)
        if rec is not None and job in self.turn:
            self.turn.remove(job)
        return rec
