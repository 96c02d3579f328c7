"""Refused callers logged in one line each, rate-limited: whoever can connect cannot flood the logs.

A daemon reachable on a shared network meets scanners and misconfigured clients; every refusal is
worth a line, but not a traceback, and not ten thousand lines a second. `RefusalLog.note` writes the
first refusal of a kind at once and then at most one line per `every_s`, saying how many it left out.
"""

from __future__ import annotations

import logging
import threading
import time


class RefusalLog:
    """One-line, rate-limited warnings about refused callers, per kind of refusal."""

    def __init__(self, log: logging.Logger, every_s: float = 10.0, kinds: int = 64) -> None:
        self._log = log
        self._every = every_s
        self._kinds = kinds
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}  # kind -> (time of last line, refusals left out since)

    def note(self, what: str, why: str) -> None:
        """Record one refusal of `what` (a port or method) because `why`; log it unless one was logged lately."""
        kind = f"{what}: {why}"
        now = time.monotonic()
        with self._lock:
            last, skipped = self._last.get(kind, (-self._every, 0))
            if now - last < self._every:
                self._last[kind] = (last, skipped + 1)
                return
            if kind not in self._last and len(self._last) >= self._kinds:
                self._last.pop(next(iter(self._last)))
            self._last[kind] = (now, 0)
        more = f" ({skipped} more since the last report)" if skipped else ""
        self._log.warning("refused %s%s", kind, more)
