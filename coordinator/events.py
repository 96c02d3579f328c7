"""The scheduler's vocabulary: the events `scheduler.decide` consumes and the actions it returns.

Plain frozen dataclasses, no behaviour; `scheduler` re-exports them (`sch.Submit`, `sch.Dispatch`...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pscluster.coordinator.job_queues import MAIN


# -- events ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    cid: int
    job: str = MAIN


@dataclass(frozen=True)
class OpenJob:
    """A client program starts a job (or re-attaches to it)."""

    job: str


@dataclass(frozen=True)
class KeepJob:
    """The job's client is alive (its session keepalive)."""

    job: str


@dataclass(frozen=True)
class EndJob:
    """The job's client disconnected: cancel its queued closures, forget the job."""

    job: str
    reason: str


@dataclass(frozen=True)
class Register:
    wid: str
    address: str
    closure_address: str = ""  # host:port of the worker's framed closure port ("": gRPC RunClosure)


@dataclass(frozen=True)
class Heartbeat:
    wid: str


@dataclass(frozen=True)
class Leave:
    wid: str


@dataclass(frozen=True)
class Finished:
    """An attempt returned: ok, the user's error, or a cluster error (PS unavailable) to retry."""

    cid: int
    wid: str
    outcome: Literal["ok", "user_error", "retry"]


@dataclass(frozen=True)
class TransportFailed:
    """The RunClosure RPC to the worker failed: the worker is dead or unreachable."""

    cid: int
    wid: str
    reason: str


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class PsDown:
    """A PS stopped answering: dispatch nothing until PsUp."""


@dataclass(frozen=True)
class PsUp:
    pass


@dataclass(frozen=True)
class SetConcurrency:
    """Cap the closures running at once (None: no cap beyond max_inflight per worker).

    In sync mode a closure beyond N could only hold a worker slot while it waits for the next step's
    token; if a token holder dies, its rescheduled closure would then find no free slot and the step
    could never complete. Capping at N leaves a slot for it.
    """

    limit: int | None


@dataclass(frozen=True)
class ErrorReported:
    """The job's join() raised its pending user error; scheduling may go on."""

    job: str = MAIN


Event = (Submit | Register | Heartbeat | Leave | Finished | TransportFailed | Tick | PsDown | PsUp
         | SetConcurrency | ErrorReported | OpenJob | KeepJob | EndJob)


# -- actions -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dispatch:
    cid: int
    wid: str
    address: str
    attempt: int
    closure_address: str = ""


@dataclass(frozen=True)
class Resolve:
    """The closure's outcome is final; the executor publishes its stored reply."""

    cid: int


@dataclass(frozen=True)
class Cancel:
    cid: int
    reason: str


@dataclass(frozen=True)
class Abandon:
    """Stop waiting for an attempt (cancel its RPC); another attempt has it or will."""

    cid: int
    wid: str


@dataclass(frozen=True)
class WorkerGone:
    wid: str
    address: str
    reason: str
    rescheduled: tuple[int, ...]


@dataclass(frozen=True)
class Registered:
    wid: str
    index: int
    new: bool = True


@dataclass(frozen=True)
class WatchPs:
    """A closure met an unavailable PS: wait for every PS to answer, then send PsUp."""


@dataclass(frozen=True)
class FailUnscheduled:
    cid: int
    reason: str


@dataclass(frozen=True)
class JobEnded:
    """The job is gone (its Cancel actions come first); the executor drops what it keeps for it."""

    job: str
    reason: str


Action = Dispatch | Resolve | Cancel | Abandon | WorkerGone | Registered | WatchPs | FailUnscheduled | JobEnded
