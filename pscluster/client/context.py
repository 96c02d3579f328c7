"""Where a variable handle finds its PS client, and a closure its push ids.

A handle pickled into a closure carries no connection; on the worker it resolves the worker's client
through `current_client()`. Inside a closure, `push_id()` yields deterministic ids derived from the
closure id, so a rescheduled closure re-sends the same ids and no shard applies a push twice.
"""

from __future__ import annotations

import itertools
import math
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from pscluster.client.variables import Backend, set_thread_client
from pscluster.client.variables import current_client as current_client
from pscluster.client.variables import set_default_client as set_default_client
from pscluster.errors import InvalidArgumentError

_local = threading.local()


@dataclass(frozen=True)
class Token:
    """A sync token: the global step the closure computes for, and its replica number in that step."""

    step: int
    replica: int


class ClosureScope:
    """Identity of the closure running on this thread: ids for its pushes, its worker, its datasets."""

    def __init__(self, closure_id: int, client: Backend, worker: Any = None, sync_mode: str = "async",
                 final_below: int = 0, push_pull: bool = False) -> None:
        self.closure_id = closure_id
        self.final_below = final_below  # the coordinator's mark at dispatch, sent with every push
        self.push_pull = push_pull  # fused push-pull (pscluster/client/fresh.py): the job is async and asked for it
        self.client = client
        self.worker = worker
        self.sync_mode = sync_mode or "async"
        self.token: Token | None = None
        self._seq = itertools.count()
        self.versions: dict[tuple[str, int, int], int] = {}  # (variable, shard, PS incarnation) -> version
        self.scalars: dict[str, tuple[float, int]] = {}  # report(): name -> (sum, count)

    def __enter__(self) -> ClosureScope:
        self._saved = (getattr(_local, "scope", None), set_thread_client(self.client))
        _local.scope = self
        return self

    def __exit__(self, *exc: object) -> None:
        _local.scope, client = self._saved
        set_thread_client(client)

    def ensure_token(self) -> Token | None:
        """In sync/bounded mode, take this closure's token (once) before its first pull or push."""
        if self.token is None and self.sync_mode != "async":
            worker = getattr(getattr(self.worker, "info", None), "worker_id", "")
            step, replica = self.client.take_token(self.closure_id, worker)
            self.token = Token(step, replica)
        return self.token

    def next_push_id(self) -> str:
        """The n-th push of this closure: the same across reschedules of the closure."""
        return f"c{self.closure_id}.{next(self._seq)}"


def current_scope() -> ClosureScope | None:
    """The running closure's scope, or None outside closures."""
    return getattr(_local, "scope", None)


def push_id() -> str:
    """Id for the next push: deterministic inside a closure, random (still retry-safe) outside."""
    scope = current_scope()
    return scope.next_push_id() if scope is not None else f"u{uuid.uuid4().hex}"


def sync_token() -> Token | None:
    """The running closure's token (taking it now if needed); None in async mode or outside closures."""
    scope = current_scope()
    return scope.ensure_token() if scope is not None else None


MAX_SCALARS = 64  # names one closure may report: a curve per name, not a log


def report(**scalars: float) -> None:
    """Record training scalars (loss=..., accuracy=...) from inside a closure; the coordinator averages them
    per reporting interval into its training curves (TensorBoard event files under `logdir`).

    Reported several times in one closure, a name's mean travels back. Outside a closure: ignored.

    Raises:
        InvalidArgumentError: a value that is not a finite number, or more than MAX_SCALARS names.
    """
    scope = current_scope()
    if scope is None:
        return
    for name, value in scalars.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"report({name}=...): {value!r} is not a number") from None
        if not math.isfinite(number):
            raise InvalidArgumentError(f"report({name}={number}): not a finite number")
        if name not in scope.scalars and len(scope.scalars) >= MAX_SCALARS:
            raise InvalidArgumentError(f"report(): at most {MAX_SCALARS} names per closure")
        total, count = scope.scalars.get(name, (0.0, 0))
        scope.scalars[name] = (total + number, count + 1)


def worker_info() -> Any:
    """The WorkerInfo (worker_id, worker_index) of the worker running this closure; None outside closures."""
    scope = current_scope()
    return getattr(scope.worker, "info", None) if scope is not None else None
