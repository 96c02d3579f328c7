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
import ssl
import struct
import threading
from collections.abc import Callable
from typing import Any

import grpc

from pscluster.admission import HELLO_MAX_BYTES, ConnectionBudget
from pscluster import tls
from pscluster.config import Settings
from pscluster.errors import (ConfigError, InternalError, InvalidArgumentError, PermissionDeniedError, PsclusterError,
                              ResourceExhaustedError, UnauthenticatedError, UnavailableError)
from pscluster.refusals import RefusalLog
from pscluster.proto import pscluster_pb2 as pb

log = logging.getLogger(__name__)
_refusals = RefusalLog(log)
tls_role = tls.role_of_peercert
PREFIX = struct.Struct("<IQ")
STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
CHUNK = 4 << 20  # bytes per send call of a payload: the unit of progress that io timeouts measure

# handler(conn, request, payload_len, per-connection state) serves one request
Handler = Callable[[socket.socket, pb.BulkRequest, int, dict[str, Any]], None]


GROW_BYTES = 1 << 20  # above this, a buffer grows with the bytes that arrive instead of being allocated up front


def recv_exact(conn: socket.socket, n: int) -> bytes:
    """n bytes from conn, or ConnectionError at EOF; memory follows the bytes received, not the n announced."""
    if n <= GROW_BYTES:
        buf = bytearray(n)
        recv_into(conn, memoryview(buf))
        return bytes(buf)
    grown = bytearray()
    while len(grown) < n:
        piece = conn.recv(min(GROW_BYTES, n - len(grown)))
        if not piece:
            raise ConnectionError("connection closed")
        grown += piece
    return bytes(grown)


def drain(conn: socket.socket, n: int) -> None:
    """Read and drop n bytes (a payload sent where none belongs) through a small buffer."""
    scratch = memoryview(bytearray(min(n, 64 << 10)))
    while n > 0:
        k = conn.recv_into(scratch, min(n, len(scratch)))
        if k == 0:
            raise ConnectionError("connection closed")
        n -= k


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


def wait_readable(conn: socket.socket, timeout_s: float | None = None) -> bool:
    """Block until conn has data, EOF or an error (True), or timeout_s passes first (False).

    An idle wait: conn's own io timeout does not bound it, timeout_s does (None: forever).
    """
    pending = getattr(conn, "pending", None)  # a TLS socket may hold decrypted bytes the kernel no longer has
    if pending is not None and pending():
        return True
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else max(0, int(timeout_s * 1000))))


def send_hello(conn: socket.socket, token: str | None) -> None:
    """Open a framed connection: the first frame carries the token and nothing else (at most HELLO_MAX_BYTES)."""
    send_frame(conn, pb.BulkRequest(token=token or "").SerializeToString())


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
        drain(conn, payload_len)
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
                 port: int = 0, io_timeout_s: float = 30.0, budget: ConnectionBudget | None = None,
                 auth_timeout_s: float = 10.0, idle_timeout_s: float | None = None,
                 tls_context: ssl.SSLContext | None = None, roles: frozenset[str] | None = None) -> None:
        self._token = token.encode() if token else None
        self._handlers = handlers
        self._max_header = max_header_bytes
        self._max_payload = max_payload_bytes
        self._io_timeout = io_timeout_s
        self._auth_timeout = auth_timeout_s
        self._idle_timeout = idle_timeout_s
        self.budget = budget or ConnectionBudget(max_connections)
        self._tls = tls_context
        self._roles = roles  # mutual TLS: the certificate roles this port serves
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
                conn, addr = self._listener.accept()
            except OSError:
                return
            peer = str(addr[0])
            refused = self.budget.admit(peer)
            if refused is not None:
                conn.settimeout(1.0)  # the answer is best effort: a flood must not hold the accept loop
                reply_error(conn, UnavailableError(f"{self._name} port: {refused}; retry later"))
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(min(self._io_timeout, self._auth_timeout))
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, peer), name=f"{self._name}-conn", daemon=True).start()

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

    def _serve(self, raw: socket.socket, peer: str = "") -> None:
        conn = raw
        authed = False
        state: dict[str, Any] = {}
        try:
            if self._tls is not None:
                wrapped = self._handshake(raw)
                if wrapped is None:
                    return
                conn = wrapped
            # the first frame must come within auth_timeout_s and authenticate in a few KiB
            if not wait_readable(conn, self._auth_timeout) or not self._authenticate(conn):
                return
            authed = True
            self.budget.authenticated()
            conn.settimeout(self._io_timeout)
            while not self._stop.is_set():
                if not wait_readable(conn, self._idle_timeout):
                    return  # idle for idle_timeout_s: the client reconnects when it needs the port again
                header_len, payload_len = PREFIX.unpack(recv_exact(conn, PREFIX.size))
                request = self._read_request(conn, header_len, payload_len)
                if request is None:
                    return
                self._run(conn, request, payload_len, state)
        except (ConnectionError, OSError):
            pass
        finally:
            with self._lock:
                self._conns.discard(raw)
                self._conns.discard(conn)
            self.budget.release(peer, authed)
            conn.close()
            for release in state.get("on_close", ()):  # what handlers tied to this connection (a segment)
                release()

    def _handshake(self, raw: socket.socket) -> socket.socket | None:
        """The TLS side of a connection (the handshake bounded by auth_timeout_s), role checked; None if refused."""
        assert self._tls is not None
        try:
            conn = self._tls.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            _refusals.note(f"{self._name} connection", f"TLS handshake failed ({type(exc).__name__})")
            return None
        with self._lock:  # the wrapped socket owns the descriptor now: stop() must reach it
            self._conns.discard(raw)
            self._conns.add(conn)
        if self._roles is not None:
            role = tls_role(conn.getpeercert())
            if role not in self._roles:
                _refusals.note(f"{self._name} connection", f"certificate role {role or 'none'!r}")
                reply_error(conn, PermissionDeniedError(f"{self._name} port: a {role or 'certificate-less'} peer may "
                                                        f"not use it (allowed: {', '.join(sorted(self._roles))})"))
                conn.close()
                return None
        return conn

    def _authenticate(self, conn: socket.socket) -> bool:
        """Read and check the first frame: a hello, or (small) a request carrying the token, then served."""
        header_len, payload_len = PREFIX.unpack(recv_exact(conn, PREFIX.size))
        if header_len > HELLO_MAX_BYTES:
            reply_error(conn, UnauthenticatedError(
                f"{self._name} connection: the first frame must authenticate within {HELLO_MAX_BYTES} header bytes"))
            return False
        request = self._read_request(conn, header_len, payload_len)
        if request is None:
            return False
        if self._token is not None and not hmac.compare_digest(request.token.encode(), self._token):
            _refusals.note(f"{self._name} connection", "missing or wrong token")
            reply_error(conn, UnauthenticatedError(f"{self._name} connection: missing or wrong token"))
            return False
        if request.WhichOneof("op") is not None:
            self._run(conn, request, payload_len, {})
        elif payload_len:
            reply_error(conn, InvalidArgumentError("a hello frame carries no payload"))
            return False
        return True

    def _read_request(self, conn: socket.socket, header_len: int, payload_len: int) -> pb.BulkRequest | None:
        """The request header, or None after answering why the connection ends."""
        if header_len > self._max_header or payload_len > self._max_payload:
            # The stream cannot be resynchronised without reading it: answer, then hang up.
            reply_error(conn, ResourceExhaustedError(
                f"request of {header_len} header + {payload_len} payload bytes exceeds the limits "
                f"({self._max_header} / {self._max_payload})"))
            return None
        request = pb.BulkRequest()
        try:
            request.ParseFromString(recv_exact(conn, header_len))
        except Exception:  # noqa: BLE001 - protobuf's DecodeError: a malformed header
            reply_error(conn, InvalidArgumentError("malformed request header"))
            return None
        return request

    def _run(self, conn: socket.socket, request: pb.BulkRequest, payload_len: int, state: dict[str, Any]) -> None:
        kind = request.WhichOneof("op")
        if kind not in self._handlers:
            # a stray frame (a hello, another port's request): its payload is drained, the stream stays
            refuse_payload(conn, payload_len, "hello" if kind is None else kind)
            reply_error(conn, InvalidArgumentError(
                f"request carries none of {sorted(self._handlers)} (this is a {self._name} port)"))
            return
        self._dispatch(conn, kind, request, payload_len, state)


def limits(settings: Settings, roles: frozenset[str] | None = None) -> dict[str, Any]:
    """FrameServer keyword arguments from settings: timeouts, connection budget, payload limit, and TLS
    (with mutual TLS, `roles` are the certificate roles the port serves)."""
    files = tls.files(settings)
    return {"io_timeout_s": settings.socket_timeout_s, "auth_timeout_s": settings.auth_timeout_s,
            "idle_timeout_s": settings.idle_timeout_s, "max_payload_bytes": settings.max_tensor_bytes,
            "budget": ConnectionBudget(settings.max_connections, settings.max_connections_per_peer,
                                       settings.max_unauthenticated),
            "tls_context": tls.server_context(files) if files else None,
            "roles": roles if files and files.require_client_cert else None}


def connect(host: str, port: int, timeout: float, context: ssl.SSLContext | None,
            server_name: str | None = None) -> socket.socket:
    """A client connection to a framed port (TLS when context is given, verified against server_name or host)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if context is None:
        return sock
    try:
        return context.wrap_socket(sock, server_hostname=server_name or host)
    except BaseException:
        sock.close()
        raise


def stop_with(server: Any, frames: FrameServer) -> None:
    """Make `server.stop(grace)` (a grpc.Server's) also stop `frames`, so one call ends both listeners."""
    grpc_stop = server.stop

    def stop(grace: float | None) -> threading.Event:
        frames.stop()
        return grpc_stop(grace)  # type: ignore[no-any-return]

    server.stop = stop
