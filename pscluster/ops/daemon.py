"""What every daemon shares: stop on a signal, and wait for its dependencies at start-up.

Daemons may start in any order (the README's `&` sequence races): a coordinator waits for every PS,
a worker for the coordinator; a PS needs nothing but its own port. Each waits with backoff, logs one
line per kind of failure (not one per attempt), and gives up after `startup_timeout_s` with a
StartupError that the CLI prints as one line.

    stop = daemon.stop_on_signals()
    daemon.wait_for("coordinator", "ps 1 at 127.0.0.1:7002", probe, settings.startup_timeout_s, stop)
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from pscluster.errors import PsclusterError, StartupError

log = logging.getLogger(__name__)


PARENT_POLL_S = 0.5


def stop_on_signals(parent_pid: int | None = None) -> threading.Event:
    """An Event set by SIGTERM or SIGINT, or once process `parent_pid` has ended (call from the main thread)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if parent_pid is not None:
        # The thread ends with the daemon's own stop, so its owner is that Event.
        threading.Thread(target=_stop_when_orphaned, args=(parent_pid, stop), name="parent-watch", daemon=True).start()
    return stop


def _stop_when_orphaned(parent_pid: int, stop: threading.Event) -> None:
    # A dead parent cannot send SIGTERM; the kernel reparents us, which getppid() shows.
    while not stop.wait(PARENT_POLL_S):
        if os.getppid() != parent_pid:
            log.warning("the program that started this daemon (pid %d) has ended; stopping", parent_pid)
            stop.set()


class Waiter:
    """Backoff and log-once bookkeeping for waiting on one dependency (no I/O of its own)."""

    def __init__(self, role: str, subject: str, timeout: float, clock: Callable[[], float] = time.monotonic,
                 started: float | None = None) -> None:
        self.role, self.subject, self.timeout = role, subject, timeout
        self._clock = clock
        self._started = clock() if started is None else started
        self._backoff = 0.05
        self._said: set[str] = set()

    def failed(self, err: PsclusterError) -> float:
        """Record a failed attempt; returns the seconds to wait before the next one.

        Raises:
            StartupError: err is not retryable (e.g. a wrong token), or the timeout has passed.
        """
        kind = type(err).__name__
        if not err.retryable:
            raise StartupError(f"{self.role}: {self.subject} refused us ({kind}: {err})")
        waited = self._clock() - self._started
        if waited >= self.timeout:
            raise StartupError(f"{self.role}: gave up after {self.timeout:g} s waiting for {self.subject} "
                               f"({kind}: {err}); set startup_timeout_s / PSCLUSTER_STARTUP_TIMEOUT_S to wait longer")
        if kind not in self._said:
            self._said.add(kind)
            log.warning("%s: waiting for %s (%s); retrying for up to %g s", self.role, self.subject, kind, self.timeout)
        delay = min(self._backoff, self.timeout - waited)
        self._backoff = min(self._backoff * 2, 1.0)
        return delay

    def succeeded(self) -> None:
        """Log the end of a wait that logged its start."""
        if self._said:
            log.info("%s: %s is up after %.1f s", self.role, self.subject, self._clock() - self._started)


def wait_for(role: str, subject: str, probe: Callable[[], object], timeout: float, stop: threading.Event,
             started: float | None = None) -> bool:
    """Call probe() until it returns; False if `stop` was set first.

    Raises:
        StartupError: probe's error is not retryable, or timeout seconds passed since `started` (default: now).
    """
    waiter = Waiter(role, subject, timeout, started=started)
    while not stop.is_set():
        try:
            probe()
        except PsclusterError as err:
            stop.wait(waiter.failed(err))
            continue
        waiter.succeeded()
        return True
    return False
