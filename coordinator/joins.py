"""What `join()` waits for: closures outstanding, the first closure error, and a dead background thread.

The coordinator loop settles a batch of finished closures at once, right after publishing the
snapshot that counts them, so a `join()` that returns sees `status()` and `global_step` up to date.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from pscluster.coordinator import events

from pscluster.errors import DeadlineExceededError, NotFoundError


class JoinState:
    """Outstanding count, first error and fatal error, under one condition variable."""

    def __init__(self, on_error_reported: Callable[[], None]) -> None:
        self._cond = threading.Condition()
        self._on_error_reported = on_error_reported
        self.outstanding = 0
        self._error: tuple[int, BaseException] | None = None
        self._fatal: BaseException | None = None

    def add(self) -> None:
        """One more closure scheduled.

        Raises:
            InternalError: a coordinator thread died (see fail).
        """
        with self._cond:
            if self._fatal is not None:
                raise self._fatal
            self.outstanding += 1

    def settle(self, finished: int, error: tuple[int, BaseException] | None) -> None:
        """finished closures reached a final state; error is the first (closure id, error) among them."""
        with self._cond:
            if error is not None and self._error is None:
                self._error = error
            self.outstanding -= finished
            if self.outstanding == 0:  # the only condition a join waits for (besides fail)
                self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """A background thread died: every join()/done()/schedule() raises error from now on."""
        with self._cond:
            if self._fatal is None:
                self._fatal = error
            self._cond.notify_all()

    def wait(self, timeout: float | None) -> None:
        """Block until nothing is outstanding; raise the pending closure error once (then clear it).

        Raises:
            DeadlineExceededError: closures still outstanding after timeout.
        """
        error = self.poll(timeout)
        if error is not None:
            raise error[1]

    def poll(self, timeout: float | None) -> tuple[int, BaseException] | None:
        """Like wait, but return the pending (closure id, error) instead of raising it (for the servicer).

        Raises:
            DeadlineExceededError: closures still outstanding after timeout.
        """
        self.drain(timeout)
        return self.take()[1]

    def drain(self, timeout: float | None) -> None:
        """Block until nothing is outstanding, leaving a pending closure error for join() to report.

        checkpoint() and configure_sync() drain: an error the user already saw through fetch() must
        not stop a save, and join() still reports it once.

        Raises:
            DeadlineExceededError: closures still outstanding after timeout.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self.outstanding == 0 or self._fatal is not None, timeout):
                raise DeadlineExceededError(f"join: {self.outstanding} closures still outstanding after {timeout} s")
            if self._fatal is not None:
                raise self._fatal

    def done(self) -> bool:
        """True when nothing is outstanding; raises the fatal or the pending closure error first."""
        finished, pending = self.take()
        if pending is not None:
            raise pending[1]
        return finished

    def take(self) -> tuple[bool, tuple[int, BaseException] | None]:
        """(nothing outstanding, the pending (closure id, error) or None), clearing the error; raises the fatal."""
        with self._cond:
            if self._fatal is not None:
                raise self._fatal
            pending, self._error = self._error, None
            finished = self.outstanding == 0
        if pending is not None:
            self._on_error_reported()
        return finished, pending


class JobJoins:
    """One JoinState per live job (its own outstanding count and first error), dropped when the job ends."""

    def __init__(self, on_error_reported: Callable[[str], None]) -> None:
        self._lock = threading.Lock()
        self._on_error_reported = on_error_reported
        self._jobs: dict[str, JoinState] = {}
        self._fatal: BaseException | None = None

    def __len__(self) -> int:
        return len(self._jobs)

    def open(self, job: str) -> bool:
        """Track job; False if it was tracked already."""
        with self._lock:
            if job in self._jobs:
                return False
            state = JoinState(on_error_reported=lambda: self._on_error_reported(job))
            if self._fatal is not None:
                state.fail(self._fatal)
            self._jobs[job] = state
            return True

    def get(self, job: str) -> JoinState:
        """The job's JoinState.

        Raises:
            NotFoundError: no such job (never opened, or it ended).
        """
        state = self._jobs.get(job)
        if state is None:
            raise NotFoundError(f"no job {job!r} on this coordinator (it ended: its client closed it or sent "
                                f"no keepalive for job_idle_timeout_s; start a new RemoteCoordinator)")
        return state

    def settle(self, job: str, finished: int, error: tuple[int, BaseException] | None) -> None:
        """finished closures of job reached a final state (nothing to do if the job has ended)."""
        state = self._jobs.get(job)
        if state is not None:
            state.settle(finished, error)

    def end(self, job: str, error: BaseException) -> None:
        """Forget job; a join still waiting on it raises error."""
        with self._lock:
            state = self._jobs.pop(job, None)
        if state is not None:
            state.fail(error)

    def fail(self, error: BaseException) -> None:
        """A background thread died: every job's join()/done()/schedule() raises error from now on."""
        with self._lock:
            self._fatal = self._fatal or error
            states = list(self._jobs.values())
        for state in states:
            state.fail(error)


class JobSessions:
    """The daemon's side of remote clients' jobs: open, keep alive, end, join (for the servicer)."""

    def __init__(self, joins: JobJoins, post: Callable[[events.Event], None], idle_timeout: float) -> None:
        self._joins = joins
        self._post = post  # hands an event to the coordinator loop
        self.keepalive_interval_s = min(5.0, idle_timeout / 5)  # how often a client must send KeepJob

    def open(self, job: str = "") -> str:
        """Start a job ("": a new one) or re-attach to a live one; returns its name.

        Raises:
            NotFoundError: job was named but has ended.
        """
        if job:
            self._joins.get(job)
            self._post(events.KeepJob(job))
            return job
        job = f"job-{os.urandom(4).hex()}"
        self._joins.open(job)
        self._post(events.OpenJob(job))
        return job

    def keep(self, job: str) -> bool:
        """The job's client is alive; False if the job has ended."""
        try:
            self._joins.get(job)
        except NotFoundError:
            return False
        self._post(events.KeepJob(job))
        return True

    def end(self, job: str, reason: str) -> None:
        """End job: its queued closures are cancelled, its state dropped (by the loop)."""
        self._post(events.EndJob(job, reason))

    def join(self, job: str, timeout: float | None) -> tuple[int, BaseException] | None:
        """Wait for job's closures; the first (closure id, error) among them, or None.

        Raises:
            DeadlineExceededError: closures still outstanding after timeout.
            NotFoundError: job has ended.
        """
        return self._joins.get(job).poll(timeout)

    def drain(self, job: str, timeout: float | None) -> None:
        """Wait for job's closures without taking its pending error (see JoinState.drain).

        Raises:
            DeadlineExceededError: closures still outstanding after timeout.
            NotFoundError: job has ended.
        """
        self._joins.get(job).drain(timeout)
