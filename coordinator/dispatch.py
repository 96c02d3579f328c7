"""Closure dispatch over framed TCP connections to workers (gRPC RunClosure is the fallback).

One connection per closure in flight, kept open and reused; each has a reader thread blocked on its
socket that hands the reply (or the failure) to the coordinator's callbacks. Abandoning an attempt
shuts its connection down, so a hung worker costs nothing but the socket.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections import defaultdict
from collections.abc import Callable

from pscluster.framing import read_reply, send_frame
from pscluster.proto import pscluster_pb2 as pb

log = logging.getLogger(__name__)


class _Conn:
    def __init__(self, sock: socket.socket, wid: str) -> None:
        self.sock = sock
        self.wid = wid
        self.pending: tuple[int, str] | None = None
        self.abandoned = False


class FramedDispatcher:
    """Sends RunClosureRequests to workers' closure ports and reports replies and failures."""

    def __init__(self, token: str | None, on_reply: Callable[[int, str, pb.BulkReply], None],
                 on_failure: Callable[[int, str, str], None], connect_timeout: float = 2.0) -> None:
        self._token = token or ""
        self._on_reply = on_reply
        self._on_failure = on_failure
        self._timeout = connect_timeout
        self._lock = threading.Lock()
        self._idle: dict[str, list[_Conn]] = defaultdict(list)
        self._busy: dict[tuple[int, str], _Conn] = {}

    def dispatch(self, wid: str, address: str, request: pb.RunClosureRequest) -> None:
        """Send request to worker wid at address; the outcome arrives through the callbacks."""
        key = (request.closure_id, wid)
        with self._lock:
            conn = self._idle[wid].pop() if self._idle[wid] else None
        fresh = conn is None
        if conn is None:
            host, _, port = address.rpartition(":")
            try:
                sock = socket.create_connection((host, int(port)), timeout=self._timeout)
            except OSError as exc:
                self._on_failure(request.closure_id, wid, f"cannot connect to its closure port {address}: {exc}")
                return
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, wid)
        conn.pending = key
        with self._lock:
            self._busy[key] = conn
        if fresh:
            threading.Thread(target=self._read, args=(conn,), name=f"dispatch-{wid}", daemon=True).start()
        frame = pb.BulkRequest(closure=request, token=self._token if fresh else "")
        try:
            send_frame(conn.sock, frame.SerializeToString())
        except OSError:
            conn.sock.close()  # the reader sees the failure and reports it once

    def _read(self, conn: _Conn) -> None:
        while True:
            try:
                reply, _ = read_reply(conn.sock)
            except (OSError, ConnectionError, ValueError) as exc:
                with self._lock:
                    pending, conn.pending = conn.pending, None
                    if pending is not None:
                        self._busy.pop(pending, None)
                    if conn in self._idle[conn.wid]:
                        self._idle[conn.wid].remove(conn)
                conn.sock.close()
                if pending is not None and not conn.abandoned:
                    self._on_failure(pending[0], pending[1], f"closure connection failed ({exc or 'closed'})")
                return
            with self._lock:
                pending, conn.pending = conn.pending, None
                if pending is not None:
                    self._busy.pop(pending, None)
                if not conn.abandoned:
                    self._idle[conn.wid].append(conn)
            if pending is not None and not conn.abandoned:
                self._on_reply(pending[0], pending[1], reply)

    def abandon(self, cid: int, wid: str) -> None:
        """Stop waiting for an attempt: close its connection."""
        with self._lock:
            conn = self._busy.pop((cid, wid), None)
        if conn is not None:
            conn.abandoned = True
            _shutdown(conn.sock)

    def forget(self, wid: str) -> None:
        """Close the idle connections to a worker that is gone."""
        with self._lock:
            conns = self._idle.pop(wid, [])
        for conn in conns:
            conn.abandoned = True
            _shutdown(conn.sock)

    def close(self) -> None:
        """Close every connection."""
        with self._lock:
            conns = [c for cs in self._idle.values() for c in cs] + list(self._busy.values())
            self._idle.clear()
            self._busy.clear()
        for conn in conns:
            conn.abandoned = True
            _shutdown(conn.sock)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
