"""gRPC plumbing shared by every daemon and client: servers, channels, auth, error mapping, retries.

Servers: `create_server(settings, add_servicers)` binds, installs the one `ErrorInterceptor` (token
check + PsclusterError -> status) and returns `(server, port)`; callers `server.stop(grace)` in a
`finally`. Clients: `open_channel(address, settings)` attaches the token to every call, and
`call(...)` maps a status back onto the error tree, retrying only UNAVAILABLE / DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import hmac
import logging
import random
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar

import grpc

from pscluster.config import Settings
from pscluster.errors import ConfigError, PermissionDeniedError, PsclusterError, from_status
from pscluster.net import ports, tls
from pscluster.net.refusals import RefusalLog

log = logging.getLogger(__name__)
_refusals = RefusalLog(log)
TOKEN_KEY = "x-pscluster-token"
T = TypeVar("T")


KEEPALIVE_MS = 20_000  # a ping on every idle connection this often: a dead peer is found without a call


def channel_options(settings: Settings, keepalive_ms: int = KEEPALIVE_MS) -> list[tuple[str, Any]]:
    """Channel/server options: message size limits and keepalive suited to long training runs."""
    return [
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # the server's side of the same keepalive: it accepts a ping without calls this often (gRPC's own
        # default, 5 min, counted each of our pings a strike and ended an idle connection after three with
        # GOAWAY ENHANCE_YOUR_CALM "too_many_pings"); half the period leaves room for timer jitter
        ("grpc.http2.min_ping_interval_without_data_ms", keepalive_ms // 2),
        ("grpc.so_reuseport", 0),
        # A restarted daemon is back within a second or two: reconnect fast, not after 1 s..120 s backoff.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def _abort(context: grpc.ServicerContext, err: BaseException) -> None:
    if isinstance(err, PsclusterError):
        context.abort(err.code, str(err))
    log.exception("internal error in %s", type(err).__name__)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}")


def _check_role(context: grpc.ServicerContext, method: str, roles: frozenset[str] | None) -> None:
    """Mutual TLS: the peer certificate's role must be one that may call method."""
    if roles is None:
        return
    role = tls.role_of_context(context)
    if role not in roles:
        _refusals.note(method, f"certificate role {role or 'none'!r}")
        raise PermissionDeniedError(f"{method}: a {role or 'certificate-less'} peer may not call it "
                                    f"(allowed: {', '.join(sorted(roles))})")


def _wrap_unary(behavior: Callable[[Any, grpc.ServicerContext], Any], method: str = "",
                roles: frozenset[str] | None = None) -> Callable[..., Any]:
    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            _check_role(context, method, roles)
            return behavior(request, context)
        except Exception as err:  # noqa: BLE001 - the one mapping boundary
            _abort(context, err)

    return handle


def _wrap_stream(behavior: Callable[[Any, grpc.ServicerContext], Iterator[Any]], method: str = "",
                 roles: frozenset[str] | None = None) -> Callable[..., Any]:
    def handle(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            _check_role(context, method, roles)
            yield from behavior(request, context)
        except Exception as err:  # noqa: BLE001 - the one mapping boundary
            _abort(context, err)

    return handle


def _reject(code: grpc.StatusCode, message: str) -> Callable[..., Any]:
    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    return handle


class ErrorInterceptor(grpc.ServerInterceptor):
    """Checks the shared token on every call and maps PsclusterError onto gRPC status codes."""

    def __init__(self, token: str | None, check_roles: bool = False) -> None:
        self._token = token.encode() if token else None
        self._check_roles = check_roles  # mutual TLS: each method's allowed certificate roles (tls.ALLOWED)

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        if self._token is None:
            return True
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_KEY:
                got = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(got, self._token)
        return False

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if not self._authorized(details):
            # refused before the payload is parsed (no deserializer: garbage costs nothing and logs no
            # traceback), in one rate-limited line
            _refusals.note(str(details.method), "missing or wrong token")
            reject = _reject(grpc.StatusCode.UNAUTHENTICATED,
                             f"{details.method}: missing or wrong token in metadata {TOKEN_KEY!r}")
            uu, us, su, ss = reject, reject, reject, reject
            kw["request_deserializer"] = None
        else:
            uu = us = su = ss = None  # type: ignore[assignment]  # only the handler's own kind is set below
            method = str(details.method)
            roles = tls.allowed(method) if self._check_roles else None
            if handler.unary_unary:
                uu = _wrap_unary(handler.unary_unary, method, roles)
            if handler.stream_unary:
                su = _wrap_unary(handler.stream_unary, method, roles)
            if handler.unary_stream:
                us = _wrap_stream(handler.unary_stream, method, roles)
            if handler.stream_stream:
                ss = _wrap_stream(handler.stream_stream, method, roles)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(uu, **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(us, **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(su, **kw)
        assert ss is not None  # the remaining kind: a stream-stream handler
        return grpc.stream_stream_rpc_method_handler(ss, **kw)


def create_server(settings: Settings, add_servicers: Callable[[grpc.Server], None],
                  address: str | None = None, name: str = "rpc") -> tuple[grpc.Server, int]:
    """Start a gRPC server with the shared interceptor; returns (server, bound port).

    Raises:
        ConfigError: the address cannot be bound ("port N on HOST is in use" when another process has it).
    """
    address = address or settings.listen_address()
    pool = futures.ThreadPoolExecutor(max_workers=settings.server_threads, thread_name_prefix=name)
    files = tls.files(settings)
    server = grpc.server(pool, interceptors=[ErrorInterceptor(settings.token_value(),
                                                              check_roles=bool(files and files.require_client_cert))],
                         options=channel_options(settings))
    add_servicers(server)
    ports.check_free(address, f"the {name} gRPC port")  # before gRPC, which logs a raw line of its own
    try:
        port = server.add_secure_port(address, tls.server_credentials(files)) if files else \
            server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen on {address}: {exc}") from exc
    if port == 0:
        raise ConfigError(f"cannot listen on {address}: address in use or not local")
    server.start()
    return server, port


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._metadata = ((TOKEN_KEY, token),)

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=tuple(details.metadata or ()) + self._metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)




def open_channel(address: str, settings: Settings, server_name: str | None = None) -> grpc.Channel:
    """A channel to address (TLS when settings say so) that attaches the cluster token to every call.

    server_name: with TLS, the name the server's certificate must carry instead of address's host.
    """
    files = tls.files(settings)
    options = channel_options(settings)
    if files and server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    channel = grpc.secure_channel(address, tls.channel_credentials(files), options=options) \
        if files else grpc.insecure_channel(address, options=options)
    token = settings.token_value()
    if token:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(token))
    return channel



# what grpcio says when one side speaks TLS and the other does not, or the certificates do not match
TLS_MISMATCH = ("Socket closed", "handshake", "SSL", "ssl", "certificate")
TLS_HINT = ("if the cluster uses TLS, this program needs the same CA and its own certificate: tls_dir / --tls-dir "
            "from `pscluster certs`; without TLS on the cluster, neither")


def translate(exc: grpc.RpcError, what: str = "") -> PsclusterError:
    """The PsclusterError for a failed call (by status code only)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE and any(m in (details or "") for m in TLS_MISMATCH):
        details = f"{details} ({TLS_HINT})"
    return from_status(code, f"{what}: {details}" if what else (details or ""))


def call(method: Callable[..., T], request: Any, *, timeout: float, what: str = "",
         retry_for: float = 0.0, sleep: Callable[[float], None] = time.sleep) -> T:
    """Call a stub method; map failures onto the error tree and retry retryable ones for retry_for s.

    Raises:
        PsclusterError: the mapped status of the last attempt.
    """
    give_up = time.monotonic() + retry_for
    backoff = 0.02
    while True:
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as exc:
            err = translate(exc, what)
            if not err.retryable or time.monotonic() + backoff > give_up:
                raise err from None  # the status says it all; grpc's own frames only bury it
            sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 1.0)


