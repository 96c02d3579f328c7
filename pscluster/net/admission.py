"""Who may hold a framed port's connections: budgets that no unauthenticated peer can exhaust.

A framed port (PS bulk tensors, worker closures) gives each connection a thread. Without limits a
peer that does not even hold the token could open hundreds of idle connections and starve the
cluster's own clients. So a connection is admitted against three budgets: all connections
(`max_connections`), those of one peer address (`per_peer`), and those not authenticated yet
(`unauthenticated`, a small number: a real client authenticates in its first frame, within
`auth_timeout_s`). A refused connection is answered "too many connections" with UNAVAILABLE, which
clients retry with backoff, so a closure meets a busy port as a delay, never as a user error.
"""

from __future__ import annotations

import threading
from collections import Counter

HELLO_MAX_BYTES = 4096  # the largest header an unauthenticated peer may make a daemon read


class ConnectionBudget:
    """Admission counters of one listening port (thread-safe)."""

    def __init__(self, max_connections: int = 128, per_peer: int = 64, unauthenticated: int = 16) -> None:
        self.max_connections = max_connections
        self.per_peer = per_peer
        self.unauthenticated = unauthenticated
        self._lock = threading.Lock()
        self._total = 0
        self._pending = 0  # admitted, not authenticated yet
        self._by_peer: Counter[str] = Counter()

    def admit(self, peer: str) -> str | None:
        """Take a slot for a new connection from peer; None, or why it is refused."""
        with self._lock:
            if self._total >= self.max_connections:
                return f"too many connections ({self.max_connections})"
            if self._by_peer[peer] >= self.per_peer:
                return f"too many connections from {peer} ({self.per_peer})"
            if self._pending >= self.unauthenticated:
                return f"too many connections still authenticating ({self.unauthenticated})"
            self._total += 1
            self._pending += 1
            self._by_peer[peer] += 1
            return None

    def authenticated(self) -> None:
        """The connection admitted last by this thread's caller passed its token check."""
        with self._lock:
            self._pending -= 1

    def release(self, peer: str, authenticated: bool) -> None:
        """The connection closed."""
        with self._lock:
            self._total -= 1
            if not authenticated:
                self._pending -= 1
            self._by_peer[peer] -= 1
            if self._by_peer[peer] <= 0:
                del self._by_peer[peer]

    def counts(self) -> tuple[int, int, int]:
        """(connections, still authenticating, distinct peers) now."""
        with self._lock:
            return self._total, self._pending, len(self._by_peer)
