"""The framed server: accepts connections, authenticates each, and serves its requests with handlers.

`FrameServer` owns the listener, enforces the size limits and authenticates the first frame of each
connection with the cluster token (and TLS roles); a handler serves each request (reading its payload
and writing the reply) and raises PsclusterError for bad input, which the server maps onto the
reply's status code, once, here. Each connection is served by a thread of its own, except that a
server given an `inline` predicate serves the small requests of its plain connections from one loop
thread (pscluster/net/frame_loop.py). The wire format and its I/O helpers are in pscluster/net/framing.py.
"""

from __future__ import annotations

import errno
import hmac
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

import grpc

from pscluster.config import Settings
from pscluster.errors import (
    ConfigError,
    InternalError,
    InvalidArgumentError,
    PermissionDeniedError,
    PsclusterError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from pscluster.net import ports, tls
from pscluster.net.admission import HELLO_MAX_BYTES, ConnectionBudget
from pscluster.net.frame_loop import Served, ServingLoop
from pscluster.net.framing import PREFIX, recv_exact, refuse_payload, reply_error, unsent_bytes, wait_readable
from pscluster.net.refusals import RefusalLog
from pscluster.proto import pscluster_pb2 as pb

log = logging.getLogger(__name__)
_refusals = RefusalLog(log)
tls_role = tls.role_of_peercert

# handler(conn, request, payload_len, per-connection state) serves one request
Handler = Callable[[socket.socket, pb.BulkRequest, int, dict[str, Any]], None]
# inline(request, state): whether a payload-less request may be served on the loop thread (small, immediate reply);
# while the loop serves it, state[ON_LOOP] is True: a handler that finds it must wait after all answers instead
ON_LOOP = "on_loop"
Inline = Callable[[pb.BulkRequest, dict[str, Any]], bool]
PEEK_BYTES = 16 << 10  # a request header the loop serves fits in this (larger ones keep their thread)


class FrameServer:
    """Accepts framed connections and hands each request to `handlers[kind]` until stop()."""

    def __init__(self, host: str, token: str | None, handlers: dict[str, Handler], max_header_bytes: int,
                 max_payload_bytes: int = 1 << 36, max_connections: int = 128, name: str = "frames",
                 port: int = 0, io_timeout_s: float = 30.0, budget: ConnectionBudget | None = None,
                 auth_timeout_s: float = 10.0, idle_timeout_s: float | None = None,
                 tls_context: ssl.SSLContext | None = None, roles: frozenset[str] | None = None,
                 inline: Inline | None = None) -> None:
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
            if exc.errno == errno.EADDRINUSE:
                raise ports.in_use(host, port, f"the {name} framed port") from None
            raise ConfigError(f"cannot listen for {name} on {host}:{port}: {exc.strerror}") from exc
        self.port = int(self._listener.getsockname()[1])
        self._name = name
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True)
        # small ready requests of plain connections are served from one loop thread (pscluster/net/frame_loop.py)
        self._inline = inline
        self._loop = ServingLoop(name, self._serve_ready, self._end, idle_timeout_s) \
            if inline is not None and tls_context is None else None
        self._peek = bytearray(PEEK_BYTES)

    @property
    def connections(self) -> int:
        """Connections open now."""
        with self._lock:
            return len(self._conns)

    def start(self) -> FrameServer:
        """Start accepting connections."""
        if self._loop is not None:
            self._loop.start()
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
        if self._loop is not None:
            self._loop.stop()
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
        except Exception as exc:
            log.exception("%s %s request failed", self._name, kind)
            reply_error(conn, InternalError(f"{self._name} {kind}: {type(exc).__name__}: {exc}"))

    def _serve(self, raw: socket.socket, peer: str = "") -> None:
        conn = raw
        authed = False
        handed = False
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
            handed = self._requests(Served(conn, peer, state))
        except (ConnectionError, OSError):
            pass
        finally:
            if not handed:
                with self._lock:
                    self._conns.discard(raw)
                self._close(conn, peer, authed, state)

    def _requests(self, served: Served) -> bool:
        """Serve served's requests on this thread until it ends (False) or the loop takes it (True)."""
        conn = served.conn
        while not self._stop.is_set():
            if not wait_readable(conn, self._idle_timeout):
                return False  # idle for idle_timeout_s: the client reconnects when it needs the port again
            header_len, payload_len = PREFIX.unpack(recv_exact(conn, PREFIX.size))
            request = self._read_request(conn, header_len, payload_len)
            if request is None:
                return False
            self._run(conn, request, payload_len, served.state)
            if self._loop is not None and not payload_len and PREFIX.size + header_len <= PEEK_BYTES and \
                    self._inline is not None and self._inline(request, served.state):
                self._loop.adopt(served)
                return True
        return False

    def _resume(self, served: Served) -> None:
        """A handed-off connection's thread: serve it until it ends or goes back to the loop."""
        handed = False
        try:
            handed = self._requests(served)
        except (ConnectionError, OSError):
            pass
        finally:
            if not handed:
                self._end(served)

    def _serve_ready(self, served: Served) -> Callable[[], None] | None:
        """On the loop thread: serve the request waiting on served if it may be served here, else say
        what to do with the connection (a thread of its own, or closing it)."""
        conn = served.conn
        try:
            n = conn.recv_into(self._peek, PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        except OSError:
            return lambda: self._end(served)
        if n == 0:
            return lambda: self._end(served)  # the peer hung up
        handoff = lambda: self._handoff(served)  # noqa: E731
        if n < PREFIX.size:
            return handoff
        header_len, payload_len = PREFIX.unpack_from(self._peek)
        if payload_len or n < PREFIX.size + header_len:
            return handoff
        request = pb.BulkRequest()
        try:
            request.ParseFromString(bytes(self._peek[PREFIX.size:PREFIX.size + header_len]))
        except Exception:  # noqa: BLE001 - malformed: the thread path answers it precisely
            return handoff
        assert self._inline is not None
        if not self._inline(request, served.state) or unsent_bytes(conn):
            return handoff  # a stalled reader's replies pile up in its own thread, not here
        conn.recv_into(self._peek, PREFIX.size + header_len)  # consume what was peeked
        served.state[ON_LOOP] = True
        try:
            self._run(conn, request, 0, served.state)
        except (ConnectionError, OSError):
            return lambda: self._end(served)
        finally:
            served.state[ON_LOOP] = False
        return None

    def _handoff(self, served: Served) -> None:
        threading.Thread(target=self._resume, args=(served,), name=f"{self._name}-conn", daemon=True).start()

    def _end(self, served: Served) -> None:
        self._close(served.conn, served.peer, True, served.state)

    def _close(self, conn: socket.socket, peer: str, authed: bool, state: dict[str, Any]) -> None:
        with self._lock:
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


class Listeners:
    """A daemon's gRPC server and its framed port (if any), stopped as one."""

    def __init__(self, server: grpc.Server, frames: FrameServer | None = None) -> None:
        self.grpc = server
        self.frames = frames

    def stop(self, grace: float | None) -> threading.Event:
        """Stop the framed port, then the gRPC server (with grace); the Event is set once gRPC has stopped."""
        if self.frames is not None:
            self.frames.stop()
        return self.grpc.stop(grace)
