"""RemoteValue: the future `schedule` returns, and the conversion of a closure's reply into a value."""

from __future__ import annotations

import threading
from typing import Any

import cloudpickle
from pscluster.proto import pscluster_pb2 as pb

from pscluster.closures import load_error
from pscluster.errors import ClosureError, DeadlineExceededError


def reply_error(closure_id: int, err: pb.UserError) -> BaseException:
    """The exception to raise for a closure's error: the original type when it unpickles."""
    remote = ClosureError(err.type_name, err.message, err.traceback, closure_id)
    original = load_error(err.pickled)
    if original is None:
        return remote
    original.__cause__ = remote  # shows the remote traceback under the original exception
    return original


class RemoteValue:
    """The eventual result of a scheduled closure (TF's RemoteValue): `fetch()` waits for it."""

    def __init__(self, closure_id: int) -> None:
        self.closure_id = closure_id
        self._ready = threading.Event()
        self._reply: pb.RunClosureReply | None = None
        self._error: BaseException | None = None
        self._value: Any = None
        self._decoded = False

    def _set_reply(self, reply: pb.RunClosureReply) -> None:
        self._reply = reply
        if reply.HasField("error"):
            self._error = reply_error(self.closure_id, reply.error)
        self._ready.set()

    def _set_error(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    def done(self) -> bool:
        """True once the closure has finished, failed or been cancelled."""
        return self._ready.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until done (at most timeout seconds); True if done."""
        return self._ready.wait(timeout)

    def outcome(self) -> tuple[pb.RunClosureReply | None, BaseException | None]:
        """(worker reply, error) once done: a reply for finished closures (its error field set if the
        closure raised), an error alone for cancelled or unschedulable ones."""
        return self._reply, self._error

    def fetch(self, timeout: float | None = None) -> Any:
        """The closure's return value; raises its error (with the remote traceback) if it raised.

        Raises:
            DeadlineExceededError: not ready within timeout.
        """
        if not self._ready.wait(timeout):
            raise DeadlineExceededError(f"closure {self.closure_id} not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        if not self._decoded:
            assert self._reply is not None
            self._value = cloudpickle.loads(self._reply.result)
            self._decoded = True
        return self._value

    def get(self, timeout: float | None = None) -> Any:
        """Alias of fetch()."""
        return self.fetch(timeout)

    def __repr__(self) -> str:
        return f"RemoteValue(closure {self.closure_id}, {'ready' if self.done() else 'pending'})"
