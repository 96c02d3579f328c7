"""Framed TCP transport shared by the bulk tensor path (PS) and closure dispatch (workers).

A frame is `<u32 header length><u64 payload length><header><payload>`; headers are BulkRequest /
BulkReply messages. `FrameServer` owns the listener and one named thread per connection, enforces the
size limits, and authenticates the first frame of each connection with the cluster token; a handler
serves each request (reading its payload and writing the reply) and raises PsclusterError for bad
input, which the server maps onto the reply's status code.

Timeouts: every accepted socket has `io_timeout_s` on each send and receive, so a peer that stops
reading or writing mid-frame loses its connection instead of holding a thread (and whatever it
waits behind) forever. Waiting for the *next* request on an idle connection is not a transfer and
is not bounded by it. Payloads go out through `send_buffer` in `CHUNK` pieces, so the timeout means
"no progress for that long", not "the whole payload within that long".
"""

from __future__ import annotations

import hmac
import logging
import select
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import grpc

from pscluster.errors import (ConfigError, InternalError, InvalidArgumentError, PsclusterError,
                              ResourceExhaustedError, UnauthenticatedError)
from pscluster.proto import pscluster_pb2 as pb

log = logging.getLogger(__name__)
PREFIX = struct.Struct("<IQ")
STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
CHUNK = 4 << 20  # bytes per send call of a payload: the unit of progress that io timeouts measure

# handler(conn, request, payload_len, per-connection state) serves one request
Handler = Callable[[socket.socket, pb.BulkRequest, int, dict[str, Any]], None]


def recv_exact(conn: socket.socket, n: int) -> bytes:
    """n bytes from conn, or ConnectionError at EOF."""
    buf = bytearray(n)
    recv_into(conn, memoryview(buf))
    return bytes(buf)


def recv_into(conn: socket.socket, target: memoryview) -> None:
    """Fill target from conn, or ConnectionError at EOF."""
    got = 0
    n = len(target)
    while got < n:
        k = conn.recv_into(target[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed")
        got += k


def send_frame(conn: socket.socket, header: bytes, payload_len: int = 0) -> None:
    """Send the prefix and header of a frame; the caller sends payload_len bytes after it."""
    conn.sendall(PREFIX.pack(len(header), payload_len) + header)


def send_buffer(conn: socket.socket, data: memoryview | bytes) -> None:
    """Send data in CHUNK pieces (each bounded by conn's timeout: a stalled reader raises TimeoutError)."""
    view = memoryview(data)
    if view.nbytes == 0:
        return
    view = view.cast("B")
    for start in range(0, len(view), CHUNK):
        conn.sendall(view[start:start + CHUNK])


def wait_readable(conn: socket.socket) -> None:
    """Block until conn has data, EOF or an error (an idle wait, not bounded by conn's timeout)."""
    pending = getattr(conn, "pending", None)  # a TLS socket may hold decrypted bytes the kernel no longer has
    if pending is not None and pending():
        return
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    poller.poll()


def read_reply(conn: socket.socket) -> tuple[pb.BulkReply, int]:
    """The next reply header on conn and the length of the payload that follows it."""
    header_len, payload_len = PREFIX.unpack(recv_exact(conn, PREFIX.size))
    reply = pb.BulkReply()
    reply.ParseFromString(recv_exact(conn, header_len))
    return reply, payload_len


def refuse_payload(conn: socket.socket, payload_len: int, what: str) -> None:
    """For requests that carry none: drain a payload sent anyway (the stream stays in step) and refuse it.

    Raises:
        InvalidArgumentError: payload_len > 0.
    """
    if payload_len:
        recv_exact(conn, payload_len)
        raise InvalidArgumentError(f"a {what} request carries no payload")


def reply_error(conn: socket.socket, err: PsclusterError) -> None:
    """Answer a request with err's status code and message."""
    try:
        send_frame(conn, pb.BulkReply(code=err.code.value[0], message=str(err)).SerializeToString())
    except OSError:
        pass


class FrameServer:
    """Accepts framed connections and hands each request to `handlers[kind]` until stop()."""

    def __init__(self, host: str, token: str | None, handlers: dict[str, Handler], max_header_bytes: int,
                 max_payload_bytes: int = 1 << 36, max_connections: int = 128, name: str = "frames",
                 port: int = 0, io_timeout_s: float = 30.0) -> None:
        self._token = token.encode() if token else None
        self._handlers = handlers
        self._max_header = max_header_bytes
        self._max_payload = max_payload_bytes
        self._io_timeout = io_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        try:
            self._listener = socket.create_server((host, port))
        except OSError as exc:
            raise ConfigError(f"cannot listen for {name} on {host}:{port}: {exc.strerror}") from exc
        self.port = int(self._listener.getsockname()[1])
        self._name = name
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True)

    @property
    def connections(self) -> int:
        """Connections open now."""
        with self._lock:
            return len(self._conns)

    def start(self) -> FrameServer:
        """Start accepting connections."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the listener and every connection; join the accept thread."""
        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone does not
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for conn in list(self._conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._thread.join(timeout=2)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                reply_error(conn, ResourceExhaustedError(f"too many {self._name} connections"))
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self._io_timeout)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name=f"{self._name}-conn", daemon=True).start()

    def _dispatch(self, conn: socket.socket, kind: str, request: pb.BulkRequest, payload_len: int,
                  state: dict[str, Any]) -> None:
        """Run one handler; its errors become the reply's status here, once, as the gRPC interceptor does.

        A handler reads its payload before it can fail, so after an error the stream is in step and
        the connection stays: PsclusterError keeps its code, anything else is INTERNAL with its message.
        A handler that fails mid-reply raises ConnectionError instead (the stream cannot be repaired).
        """
        try:
            self._handlers[kind](conn, request, payload_len, state)
        except (ConnectionError, OSError):
            raise
        except PsclusterError as err:
            reply_error(conn, err)
        except Exception as exc:  # noqa: BLE001 - a bug in a handler is answered, never a silent hang-up
            log.exception("%s %s request failed", self._name, kind)
            reply_error(conn, InternalError(f"{self._name} {kind}: {type(exc).__name__}: {exc}"))

    def _serve(self, conn: socket.socket) -> None:
        authed = self._token is None
        state: dict[str, Any] = {}
        try:
            while not self._stop.is_set():
                wait_readable(conn)
                header_len, payload_len = PREFIX.unpack(recv_exact(conn, PREFIX.size))
                if header_len > self._max_header or payload_len > self._max_payload:
                    # The stream cannot be resynchronised without reading it: answer, then hang up.
                    reply_error(conn, ResourceExhaustedError(
                        f"request of {header_len} header + {payload_len} payload bytes exceeds the limits "
                        f"({self._max_header} / {self._max_payload})"))
                    return
                request = pb.BulkRequest()
                try:
                    request.ParseFromString(recv_exact(conn, header_len))
                except Exception:  # noqa: BLE001 - protobuf's DecodeError: a malformed header
                    reply_error(conn, InvalidArgumentError("malformed request header"))
                    return
                if not authed:
                    if not hmac.compare_digest(request.token.encode(), self._token or b""):
                        reply_error(conn, UnauthenticatedError(f"{self._name} connection: missing or wrong token"))
                        return
                    authed = True
                kind = next((k for k in self._handlers if request.HasField(k)), None)
                if kind is None:
                    reply_error(conn, InvalidArgumentError(
                        f"request carries none of {sorted(self._handlers)} (this is a {self._name} port)"))
                    return
                self._dispatch(conn, kind, request, payload_len, state)
        except (ConnectionError, OSError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            self._slots.release()
            conn.close()


def stop_with(server: Any, frames: FrameServer) -> None:
    """Make `server.stop(grace)` (a grpc.Server's) also stop `frames`, so one call ends both listeners."""
    grpc_stop = server.stop

    def stop(grace: float | None) -> threading.Event:
        frames.stop()
        return grpc_stop(grace)  # type: ignore[no-any-return]

    server.stop = stop
