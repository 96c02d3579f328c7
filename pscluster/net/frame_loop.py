"""One thread that serves the small requests of many framed connections, as an epoll event loop.

Why: with a thread per connection, a PS answering 4 workers' closures had 4 threads each woken ~0.6
times per step, and every wake-up on a busy 2-core host paid a cross-CPU wake (~45 us of CPU per side
for a ping-pong here, 8 us on one CPU) plus a GIL hand-off to whichever thread held it. One loop
thread serves ready connections back to back instead, waking at most once per batch.

What the loop serves is decided by its owner (`FrameServer`): only requests whose header is already
complete in the socket, that carry no payload on the socket and whose reply is small and immediate
(a PS push or pull through a shared-memory segment). Anything else - a partial frame, a payload, a
large reply, a request that may wait - is handed to a thread of its own, which returns the connection
here once it meets a request the loop may serve. So a stalled reader can still block only its own
thread, and a large transfer never delays the small ones.

Connections stay registered while the loop owns them; `serve` answers with what to do after they are
unregistered (hand off, or close), so a socket is never watched by the loop and used by a thread at once.
"""

from __future__ import annotations

import functools
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)
SWEEP_S = 1.0  # how often idle connections are looked for


@dataclass(eq=False)
class Served:
    """A connection and what belongs to it, whichever thread serves it now."""

    conn: socket.socket
    peer: str
    state: dict[str, Any] = field(default_factory=dict)
    last: float = field(default_factory=time.monotonic)


After = Callable[[], None]  # what to do with a connection once the loop has let go of it


class ServingLoop:
    """Serves adopted connections from one thread until stop()."""

    def __init__(self, name: str, serve: Callable[[Served], After | None], end: Callable[[Served], None],
                 idle_timeout_s: float | None) -> None:
        self._serve = serve  # serves what is ready; None: keep watching, else let go and call it
        self._end = end  # closes a connection the loop gives up (idle, stopping)
        self._idle_timeout = idle_timeout_s
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._incoming: list[Served] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-loop", daemon=True)

    def start(self) -> ServingLoop:
        """Start the loop thread."""
        self._thread.start()
        return self

    def adopt(self, served: Served) -> None:
        """Serve this connection from the loop from now on (any thread may call it)."""
        with self._lock:
            stopping = self._stop.is_set()
            if not stopping:
                self._incoming.append(served)
        if stopping:
            self._end(served)
            return
        self._wake()

    def stop(self) -> None:
        """End the loop: every connection it holds is ended; joins the thread."""
        with self._lock:
            self._stop.set()
        self._wake()
        self._thread.join(timeout=5)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (a wake-up is already pending) or closed (stopping)
            pass

    def _run(self) -> None:
        next_sweep = time.monotonic() + SWEEP_S
        try:
            while not self._stop.is_set():
                for key, _ in self._selector.select(timeout=SWEEP_S):
                    if key.data is None:
                        self._drain_wake()
                        continue
                    self._ready(key.data)
                with self._lock:
                    incoming, self._incoming = self._incoming, []
                for served in incoming:
                    served.last = time.monotonic()
                    self._selector.register(served.conn, selectors.EVENT_READ, served)
                if time.monotonic() >= next_sweep:
                    self._sweep()
                    next_sweep = time.monotonic() + SWEEP_S
        finally:
            with self._lock:
                incoming, self._incoming = self._incoming, []
            held = [key.data for key in self._selector.get_map().values() if key.data is not None]
            for served in held + incoming:
                self._let_go(served, functools.partial(self._end, served))
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _ready(self, served: Served) -> None:
        served.last = time.monotonic()
        try:
            after = self._serve(served)
        except Exception:
            log.exception("serving loop: request from %s failed", served.peer)
            after = functools.partial(self._end, served)
        if after is not None:
            self._let_go(served, after)

    def _let_go(self, served: Served, after: After) -> None:
        try:
            self._selector.unregister(served.conn)
        except (KeyError, ValueError):
            pass
        after()

    def _sweep(self) -> None:
        if self._idle_timeout is None:
            return
        cutoff = time.monotonic() - self._idle_timeout
        for key in list(self._selector.get_map().values()):
            served = key.data
            if served is not None and served.last < cutoff:
                self._let_go(served, functools.partial(self._end, served))

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass
