"""What `join()` waits for: closures outstanding, the first closure error, and a dead background thread.

The coordinator loop settles a batch of finished closures at once, right after publishing the
snapshot that counts them, so a `join()` that returns sees `status()` and `global_step` up to date.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from pscluster.errors import DeadlineExceededError


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
        with self._cond:
            if not self._cond.wait_for(lambda: self.outstanding == 0 or self._fatal is not None, timeout):
                raise DeadlineExceededError(f"join: {self.outstanding} closures still outstanding after {timeout} s")
        self.done()

    def done(self) -> bool:
        """True when nothing is outstanding; raises the fatal or the pending closure error first."""
        with self._cond:
            if self._fatal is not None:
                raise self._fatal
            pending, self._error = self._error, None
            finished = self.outstanding == 0
        if pending is not None:
            self._on_error_reported()
            raise pending[1]
        return finished
