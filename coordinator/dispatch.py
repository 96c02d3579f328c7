"""Closure dispatch to workers: the closure transport seam, framed TCP behind it, gRPC as the fallback.

`ClosureSender` is what the coordinator loop calls: it sends a RunClosureRequest over the worker's
framed closure port when it has one, else over gRPC (both are a `ClosureTransport`), and turns
every answer or failure into a scheduler event. `FramedDispatcher` keeps one connection per closure in flight, open and reused;
each has a reader thread blocked on its socket that hands the reply (or the failure) to callbacks.
Which connection carries which attempt is attempts.py's plain bookkeeping; this module does the I/O.
Abandoning an attempt shuts its connection down, so a hung worker costs nothing but the socket. A
reader that meets anything unexpected reports the attempt failed (the closure is rescheduled) rather
than dying with the attempt unanswered. Sends and reply reads are bounded by the socket timeout; the
wait for a reply to *start* is not (a closure may run for hours: heartbeats decide when a worker is
gone, and `abandon` then shuts the socket, which ends the wait).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Literal, Protocol

import grpc
from pscluster.coordinator import scheduler as sch
from pscluster.coordinator.attempts import Attempts, Key
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc

from pscluster.config import Settings
from pscluster.net import rpc, tls
from pscluster.net.framing import STATUS_BY_VALUE, connect, read_reply, send_frame, send_hello, wait_readable

log = logging.getLogger(__name__)


class _Conn:
    def __init__(self, sock: socket.socket, wid: str) -> None:
        self.sock = sock
        self.wid = wid
        self.pending: Key | None = None
        self.abandoned = False


OnReply = Callable[[int, str, pb.RunClosureReply], None]  # (closure id, worker id, the worker's answer)
OnFailure = Callable[[int, str, str], None]  # (closure id, worker id, why the attempt failed)
Post = Callable[[sch.Event, pb.RunClosureReply | None], None]  # Inbox.post: (event, the answer to publish)


class ClosureTransport(Protocol):
    """One way to run closures on workers; answers and failures arrive through the callbacks."""

    def dispatch(self, wid: str, address: str, request: pb.RunClosureRequest) -> None:
        """Start one attempt of request on worker wid at address."""

    def abandon(self, cid: int, wid: str) -> None:
        """Stop waiting for an attempt (its answer, if any, is dropped)."""

    def forget(self, wid: str) -> None:
        """The worker is gone: close what leads to it."""

    def close(self) -> None:
        """Close everything."""


class FramedDispatcher:
    """The ClosureTransport over workers' framed closure ports (one connection per attempt in flight)."""

    def __init__(self, token: str | None, on_reply: OnReply, on_failure: OnFailure, connect_timeout: float = 2.0,
                 io_timeout: float = 30.0, tls_context: ssl.SSLContext | None = None) -> None:
        self._token = token or ""
        self._on_reply = on_reply
        self._on_failure = on_failure
        self._timeout = connect_timeout
        self._io_timeout = io_timeout
        self._tls = tls_context
        self._lock = threading.Lock()
        self._attempts: Attempts[_Conn] = Attempts()  # which connection carries what (attempts.py)

    def dispatch(self, wid: str, address: str, request: pb.RunClosureRequest) -> None:
        """Send request to worker wid at address; the outcome arrives through the callbacks."""
        key = (request.closure_id, wid)
        with self._lock:
            conn = self._attempts.reuse(wid)
        fresh = conn is None
        if conn is None:
            host, _, port = address.rpartition(":")
            try:
                sock = connect(host, int(port), self._timeout, self._tls, tls.WORKER_NAME)
            except OSError as exc:
                self._on_failure(request.closure_id, wid, f"cannot connect to its closure port {address}: {exc}")
                return
            sock.settimeout(self._io_timeout)
            conn = _Conn(sock, wid)
        with self._lock:
            self._attempts.carry(key, conn)
        if fresh:
            threading.Thread(target=self._read, args=(conn,), name=f"dispatch-{wid}", daemon=True).start()
        frame = pb.BulkRequest(closure=request)
        try:
            if fresh:
                send_hello(conn.sock, self._token)
            send_frame(conn.sock, frame.SerializeToString())
        except OSError:
            _shutdown(conn.sock)  # wakes the reader, which reports the failure once and closes the socket

    def _read(self, conn: _Conn) -> None:
        while True:
            try:
                wait_readable(conn.sock)
                reply, _ = read_reply(conn.sock)
            except Exception as exc:  # noqa: BLE001 - any failure (socket, garbage frame) fails the attempt
                with self._lock:
                    pending = self._attempts.broke(conn)
                conn.sock.close()
                if pending is not None:
                    self._on_failure(pending[0], pending[1], f"closure connection failed ({exc or 'closed'})")
                return
            with self._lock:
                pending = self._attempts.answered(conn)
            if pending is not None:
                try:
                    if reply.code:
                        self._on_failure(pending[0], pending[1], f"refused a closure "
                                         f"({STATUS_BY_VALUE.get(reply.code)}: {reply.message})")
                    else:
                        self._on_reply(pending[0], pending[1], reply.closure)
                except Exception as exc:
                    log.exception("closure %d: reply from %s could not be handled", pending[0], pending[1])
                    self._on_failure(pending[0], pending[1], f"its reply could not be handled ({exc})")

    def abandon(self, cid: int, wid: str) -> None:
        """Stop waiting for an attempt: close its connection."""
        with self._lock:
            conn = self._attempts.abandon((cid, wid))
        if conn is not None:
            _shutdown(conn.sock)

    def forget(self, wid: str) -> None:
        """Close the idle connections to a worker that is gone."""
        with self._lock:
            conns = self._attempts.forget(wid)
        for conn in conns:
            _shutdown(conn.sock)

    def close(self) -> None:
        """Close every connection."""
        with self._lock:
            conns = self._attempts.clear()
        for conn in conns:
            _shutdown(conn.sock)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class GrpcDispatcher:
    """The ClosureTransport over workers' RunClosure RPC (workers without a framed closure port)."""

    def __init__(self, settings: Settings, on_reply: OnReply, on_failure: OnFailure) -> None:
        self._settings = settings
        self._on_reply = on_reply
        self._on_failure = on_failure
        self._stubs: dict[str, tuple[grpc.Channel, pb_grpc.WorkerStub, str]] = {}  # worker id -> (channel, stub, address)
        self._rpcs: dict[tuple[int, str], grpc.Future[pb.RunClosureReply]] = {}

    def dispatch(self, wid: str, address: str, request: pb.RunClosureRequest) -> None:
        """Start one attempt; the answer arrives on a grpc callback thread."""
        entry = self._stubs.get(wid)
        if entry is None or entry[2] != address:
            if entry is not None:
                entry[0].close()
            channel = rpc.open_channel(address, self._settings, tls.WORKER_NAME)
            entry = self._stubs[wid] = (channel, pb_grpc.WorkerStub(channel), address)
        cid = request.closure_id
        fut = entry[1].RunClosure.future(request, timeout=self._settings.rpc_timeout_s * 100)
        self._rpcs[(cid, wid)] = fut
        fut.add_done_callback(lambda f: self._completed(cid, wid, f))

    def abandon(self, cid: int, wid: str) -> None:
        """Cancel the attempt's RPC."""
        fut = self._rpcs.pop((cid, wid), None)
        if fut is not None:
            fut.cancel()

    def forget(self, wid: str) -> None:
        """Close the worker's channel."""
        entry = self._stubs.pop(wid, None)
        if entry is not None:
            entry[0].close()

    def close(self) -> None:
        """Close every channel."""
        for entry in list(self._stubs.values()):
            entry[0].close()
        self._stubs.clear()

    def _completed(self, cid: int, wid: str, fut: grpc.Future[pb.RunClosureReply]) -> None:
        self._rpcs.pop((cid, wid), None)
        if fut.cancelled():
            return  # abandoned by the scheduler
        try:
            self._on_reply(cid, wid, fut.result())
        except grpc.RpcError as exc:
            self._on_failure(cid, wid, f"failed a closure RPC ({rpc.translate(exc, 'RunClosure')})")
        except Exception as exc:
            log.exception("closure %d: reply from %s could not be handled", cid, wid)
            self._on_failure(cid, wid, f"its reply could not be handled ({exc})")


class ClosureSender:
    """Sends closures to workers for the coordinator loop; answers come back through `post(event)`.

    A worker with a framed closure port gets its closures over FramedDispatcher, others over
    GrpcDispatcher; both answer through the same two callbacks, which become scheduler events:
    `Finished`/`TransportFailed`, posted with the RunClosureReply when the loop must publish it. Only the loop calls send/abandon/forget.
    """

    def __init__(self, settings: Settings, post: Post) -> None:
        self._post = post
        files = tls.files(settings)
        self._framed = FramedDispatcher(settings.token_value(), self._reply, self._failure,
                                        io_timeout=settings.socket_timeout_s,
                                        tls_context=tls.client_context(files) if files else None)
        self._grpc = GrpcDispatcher(settings, self._reply, self._failure)
        self._transports: tuple[ClosureTransport, ...] = (self._framed, self._grpc)

    def send(self, action: sch.Dispatch, request: pb.RunClosureRequest) -> None:
        """Start one attempt."""
        if action.closure_address:
            self._framed.dispatch(action.wid, action.closure_address, request)
        else:
            self._grpc.dispatch(action.wid, action.address, request)

    def abandon(self, cid: int, wid: str) -> None:
        """Stop waiting for an attempt."""
        for transport in self._transports:
            transport.abandon(cid, wid)

    def forget(self, wid: str) -> None:
        """The worker is gone: close its connections."""
        for transport in self._transports:
            transport.forget(wid)

    def close(self) -> None:
        """Close every connection."""
        for transport in self._transports:
            transport.close()

    def _failure(self, cid: int, wid: str, reason: str) -> None:
        self._post(sch.TransportFailed(cid, wid, reason), None)

    def _reply(self, cid: int, wid: str, reply: pb.RunClosureReply) -> None:
        if reply.retryable:
            log.warning("closure %d hit an unavailable PS: %s", cid, reply.error.message)
            self._post(sch.Finished(cid, wid, "retry"), None)
        else:
            outcome: Literal["user_error", "ok"] = "user_error" if reply.HasField("error") else "ok"
            self._post(sch.Finished(cid, wid, outcome), reply)
