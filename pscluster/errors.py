"""The pscluster error tree; each class maps one to one onto a gRPC status code.

    PsclusterError
    ├── InvalidArgumentError      INVALID_ARGUMENT     bad shape, dtype, ids, NaN, malformed request
    │   └── NonFiniteGradientError                     a worker's push holding NaN/Inf, refused before sending
    ├── NotFoundError             NOT_FOUND            unknown variable or closure
    ├── AlreadyExistsError        ALREADY_EXISTS       conflicting variable definition
    ├── FailedPreconditionError   FAILED_PRECONDITION  call not valid in the current state
    ├── ResourceExhaustedError    RESOURCE_EXHAUSTED   oversized message, full queue
    ├── UnauthenticatedError      UNAUTHENTICATED      missing or wrong token
    ├── AbortedError              ABORTED              cancelled work (e.g. queued closures after a user error)
    ├── UnavailableError          UNAVAILABLE          peer down; retryable
    ├── DeadlineExceededError     DEADLINE_EXCEEDED    peer too slow; retryable
    └── InternalError             INTERNAL             a bug; never retried

`ClosureError` is separate: it is the user's exception raised inside a closure, re-raised by
`join`/`fetch` with the remote traceback; it never maps to a status code. `ConfigError` is bad
configuration, raised at start before any daemon exists; `StartupError` is a daemon giving up on a
dependency (a PS, the coordinator) that did not come up in time or refused it.

The mapping happens at exactly two places: `rpc.ErrorInterceptor` (server, error -> status) and
`rpc.translate` (client, status -> error). Nothing classifies a failure by its message text.
"""

from __future__ import annotations

import grpc


class PsclusterError(Exception):
    """Base of every error that crosses a pscluster RPC."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    retryable: bool = False


class InvalidArgumentError(PsclusterError):
    """The request is malformed or does not fit the variable (shape, dtype, ids, NaN)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NonFiniteGradientError(InvalidArgumentError):
    """A gradient held NaN or Inf: the worker refused the whole push, so no PS applied any of it."""

    def __init__(self, message: str, variables: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.variables = variables

    def __reduce__(self) -> tuple[type[NonFiniteGradientError], tuple[str, tuple[str, ...]]]:
        return type(self), (str(self), self.variables)  # travels back from a closure with its names


class NotFoundError(PsclusterError):
    """The named variable, shard or closure does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(PsclusterError):
    """A variable exists under this name with a different definition."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPreconditionError(PsclusterError):
    """The call is not valid in the current state of the daemon."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(PsclusterError):
    """A message is too large or a bounded queue is full."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnauthenticatedError(PsclusterError):
    """The caller did not present the cluster's token."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(PsclusterError):
    """The caller is authenticated but its certificate's role may not do this (mutual TLS)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class AbortedError(PsclusterError):
    """The work was cancelled, e.g. queued closures after another closure raised."""

    code = grpc.StatusCode.ABORTED


class UnavailableError(PsclusterError):
    """The peer is down or unreachable; safe to retry."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class DeadlineExceededError(PsclusterError):
    """The peer did not answer in time; safe to retry (every mutating RPC is idempotent)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    retryable = True


class InternalError(PsclusterError):
    """A bug in pscluster; never retried."""

    code = grpc.StatusCode.INTERNAL


class ConfigError(ValueError):
    """Invalid configuration, reported at start with the offending field."""


class StartupError(RuntimeError):
    """A daemon gave up waiting for what it needs; the message names it and why (exit code 3)."""


class ClosureError(Exception):
    """An exception raised inside a closure on a worker, re-raised on the coordinator."""

    def __init__(self, type_name: str, message: str, remote_traceback: str, closure_id: int) -> None:
        super().__init__(f"closure {closure_id} raised {type_name}: {message}\n--- remote traceback ---\n"
                         f"{remote_traceback}")
        self.type_name = type_name
        self.remote_message = message
        self.remote_traceback = remote_traceback
        self.closure_id = closure_id


ERRORS_BY_CODE: dict[grpc.StatusCode, type[PsclusterError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError, NotFoundError, AlreadyExistsError, FailedPreconditionError,
        ResourceExhaustedError, UnauthenticatedError, PermissionDeniedError, AbortedError, UnavailableError,
        DeadlineExceededError, InternalError,
    )
}


TOKEN_HINT = ("this program's token comes from --token-file, PSCLUSTER_TOKEN_FILE, PSCLUSTER_TOKEN or token_file "
              "in the cluster file and must be the one the cluster was started with")


def from_status(code: grpc.StatusCode, details: str) -> PsclusterError:
    """The pscluster error for a gRPC status (CANCELLED and unknown codes become UnavailableError/Internal)."""
    if code == grpc.StatusCode.CANCELLED:
        return UnavailableError(details or "call cancelled")
    if code == grpc.StatusCode.OUT_OF_RANGE:
        return InvalidArgumentError(details)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return UnauthenticatedError(f"{details} ({TOKEN_HINT})")
    return ERRORS_BY_CODE.get(code, InternalError)(details)
