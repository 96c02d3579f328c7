"""The sync token queue and the bounded-staleness clocks as one pure state machine.

`decide(state, event, now)` updates `state` in place and returns the actions to perform; it does no
I/O, takes no lock and reads no clock, so every path (tokens running out, a step advancing, a backup's
late report, a rescheduled closure taking its token back, a fast worker held back, an idle worker's
lease running out) is unit-tested by feeding events. `sync_replicas.SyncReplicas` is the executor: it
owns the condition variable, feeds events under it with the global step G it reads from the PS core,
applies `Advance`, and waits (in real time, bounded by the caller's timeout) while the answer is an
`Await*` action.

sync: N (`total_num_replicas`) tokens per step; a closure's token is (G, replica); R
(`replicas_to_aggregate`) StepDone reports of step G advance G and release the next step's tokens.
bounded: a worker may start its step t only while t is at most `staleness` ahead of the steps
completed by the slowest live worker (ps-lite's bounded delay); a worker not seen for
`WORKER_LEASE_S` no longer counts as live.
async: every take is granted at G and every report advances G.

With replicas: 2 the state has a backup (server/sync_replicas.py forwards it whole after each change):
`to_wire`/`from_wire` carry it, `reconfigure` is a backup's own take of a ConfigureSync (the settings its
shards accumulate by, the token maps left to the primary's stream), and a report is idempotent (a
client retries it on the promoted backup when the reply was lost).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pscluster.errors import InvalidArgumentError

Mode = Literal["async", "sync", "bounded"]
MODES: tuple[Mode, ...] = ("async", "sync", "bounded")
# A bounded-mode worker that took no token for this long (it has no closure to run: the queue drained
# towards the others) no longer holds the others back.
WORKER_LEASE_S = 2.0
# Leases expire without anyone notifying a waiter: a bounded-mode waiter looks again this often.
BOUNDED_POLL_S = 0.05


# -- events ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Configure:
    """Switch mode (already validated); tokens and reports of the old mode are forgotten."""

    mode: Mode
    replicas_to_aggregate: int
    total_num_replicas: int
    staleness: int


@dataclass(frozen=True)
class TakeToken:
    """A closure asks for its token; `global_step` is G when it asks."""

    closure_id: int
    worker: str
    global_step: int


@dataclass(frozen=True)
class RetryToken:
    """A waiting closure looks again (woken, or its poll interval passed); it keeps waiting by the rules of
    the `mode` its wait began in, even if the mode changed meanwhile."""

    closure_id: int
    worker: str
    global_step: int
    mode: Mode


@dataclass(frozen=True)
class StepDone:
    """A closure finished the pushes of its `step`."""

    closure_id: int
    step: int
    worker: str
    global_step: int


Event = Configure | TakeToken | RetryToken | StepDone


# -- actions --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Grant:
    """Hand the closure its token."""

    closure_id: int
    step: int
    replica: int


@dataclass(frozen=True)
class AwaitTokens:
    """sync: all tokens of the step are out; wait for a notify, or fail the closure after its timeout."""

    closure_id: int
    step: int
    out: int
    reported: int
    needed: int
    poll: float | None = None

    def refusal(self, timeout: float) -> str:
        """The error a closure gets when its wait ran out."""
        return (f"no sync token for step {self.step} within {timeout:.1f} s: all {self.out} are out and "
                f"{self.reported} of {self.needed} replicas reported")


@dataclass(frozen=True)
class AwaitSlowest:
    """bounded: the worker is too far ahead; look again every `poll` s, or fail after the timeout."""

    closure_id: int
    worker: str
    ahead: int
    staleness: int
    poll: float | None = BOUNDED_POLL_S

    def refusal(self, timeout: float) -> str:
        """The error a closure gets when its wait ran out."""
        return (f"worker {self.worker} is {self.ahead} steps ahead of the slowest (staleness {self.staleness}) "
                f"after waiting {timeout:.1f} s")


@dataclass(frozen=True)
class Advance:
    """Set G to `global_step` and wake every waiter."""

    global_step: int


@dataclass(frozen=True)
class WakeWaiters:
    """Wake every waiter (the mode changed: what they wait for may be there now)."""


Action = Grant | AwaitTokens | AwaitSlowest | Advance | WakeWaiters


# -- state ----------------------------------------------------------------------------------------
@dataclass
class TokenState:
    """Everything the token queue and the clocks decide from (PS 0 only)."""

    mode: Mode = "async"
    replicas_to_aggregate: int = 1
    total_num_replicas: int = 1
    staleness: int = 0
    max_spread: int = 0  # bounded: the widest spread ever admitted, for inspection
    issued: dict[int, int] = field(default_factory=dict)  # sync: tokens handed out, per step
    tokens: dict[int, tuple[int, int]] = field(default_factory=dict)  # closure -> (step, replica)
    done: dict[int, set[int]] = field(default_factory=dict)  # sync: closures that reported, per step
    clocks: dict[str, int] = field(default_factory=dict)  # bounded: steps completed per worker
    started: dict[str, int] = field(default_factory=dict)  # bounded: steps begun per worker
    last_seen: dict[str, float] = field(default_factory=dict)  # bounded: when each worker last took or reported
    # bounded: the worker each held token was granted to: its clock counts the report, wherever the closure
    # ran in the end (one handed back and run on another worker must not leave a step begun and never done)
    holders: dict[int, str] = field(default_factory=dict)


def decide(state: TokenState, event: Event, now: float) -> list[Action]:
    """Apply one event to the state; return the actions the executor performs (a take gets exactly one)."""
    if isinstance(event, Configure):
        state.mode = event.mode
        state.replicas_to_aggregate = max(1, event.replicas_to_aggregate)
        state.total_num_replicas = max(state.replicas_to_aggregate, event.total_num_replicas)
        state.staleness = event.staleness
        state.issued.clear()
        state.tokens.clear()
        state.done.clear()
        state.holders.clear()
        return [WakeWaiters()]
    if isinstance(event, StepDone):
        return _step_done(state, event, now)
    first = isinstance(event, TakeToken)
    mode = state.mode if isinstance(event, TakeToken) else event.mode
    if mode == "sync":
        return [_sync_token(state, event.closure_id, event.global_step, first)]
    if mode == "bounded":
        return [_bounded_token(state, event.closure_id, event.worker, now, first)]
    return [Grant(event.closure_id, event.global_step, 0)]


def _sync_token(state: TokenState, closure_id: int, g: int, first: bool) -> Grant | AwaitTokens:
    held = state.tokens.get(closure_id)
    if first and held is not None and held[0] == g:
        return Grant(closure_id, *held)  # its closure was rescheduled: the same token again
    replica = state.issued.get(g, 0)
    if replica >= state.total_num_replicas:
        return AwaitTokens(closure_id, g, state.total_num_replicas, len(state.done.get(g, ())),
                           state.replicas_to_aggregate)
    state.issued[g] = replica + 1
    state.tokens[closure_id] = (g, replica)
    return Grant(closure_id, g, replica)


def min_clock(state: TokenState, now: float, asking: str = "") -> int:
    """Steps completed by the slowest live worker (0 with none); `asking`, a worker waiting for its token, counts
    as live whatever its lease says (else a lone waiter whose lease ran out would wait for a clock of 0)."""
    live = [c for w, c in state.clocks.items()
            if w == asking or now - state.last_seen.get(w, now) <= WORKER_LEASE_S]
    return min(live) if live else 0


def _bounded_token(state: TokenState, closure_id: int, worker: str, now: float,
                   first: bool) -> Grant | AwaitSlowest:
    # `started` counts steps begun (closures in flight included), `clocks` steps completed
    if first:
        held = state.tokens.get(closure_id)
        if held is not None:
            return Grant(closure_id, *held)
        if worker not in state.clocks:
            state.clocks[worker] = state.started[worker] = min_clock(state, now)  # a newcomer starts level
        state.last_seen[worker] = now
    slowest = min_clock(state, now, worker)
    step = state.started[worker]
    if step - slowest > state.staleness:
        return AwaitSlowest(closure_id, worker, step - slowest, state.staleness)
    state.started[worker] = step + 1
    state.tokens[closure_id] = (step, 0)
    state.holders[closure_id] = worker
    state.last_seen[worker] = now
    state.max_spread = max(state.max_spread, step - slowest)
    return Grant(closure_id, step, 0)


def _step_done(state: TokenState, event: StepDone, now: float) -> list[Action]:
    if state.mode != "sync":
        if state.mode == "bounded":
            if state.tokens.pop(event.closure_id, None) is None:
                return []  # a repeat (the reply was lost, the report retried): counted once
            owner = state.holders.pop(event.closure_id, event.worker)
            if owner:
                state.clocks[owner] = state.clocks.get(owner, 0) + 1
            if event.worker:
                state.last_seen[event.worker] = now
        return [Advance(event.global_step + 1)]
    step = event.step
    if step != event.global_step:
        return []  # a backup's report for a step that already advanced
    if state.tokens.get(event.closure_id, (-1, 0))[0] != step:
        # not a token of this step (a ConfigureSync cleared the tokens since: the coordinator's resend of an
        # earlier job's report must not count in this one); a closure's token lives until its step is made
        return []
    done = state.done.setdefault(step, set())
    done.add(event.closure_id)
    if len(done) < state.replicas_to_aggregate:
        return []
    # the step is made: forget what no later take or report can ask about
    for old in [s for s in state.done if s <= step]:
        del state.done[old]
    for old in [s for s in state.issued if s < step]:
        del state.issued[old]
    state.tokens = {c: t for c, t in state.tokens.items() if t[0] >= step}
    return [Advance(step + 1)]


# -- replication (replicas: 2) --------------------------------------------------------------------
def reconfigure(state: TokenState, event: Configure) -> None:
    """A ConfigureSync on the state's backup: take the settings (its own shards accumulate by them) and keep
    the token maps, which only the primary's forwards change (a forward of the cleared maps may be here
    already: clearing again would drop a grant made after it)."""
    state.mode = event.mode
    state.replicas_to_aggregate = max(1, event.replicas_to_aggregate)
    state.total_num_replicas = max(state.replicas_to_aggregate, event.total_num_replicas)
    state.staleness = event.staleness


def to_wire(state: TokenState, global_step: int, now: float) -> dict[str, Any]:
    """The whole state and G as JSON-able data for the backup; `last_seen` travels as ages (each process
    reads its own clock)."""
    return {"G": global_step, "mode": state.mode, "R": state.replicas_to_aggregate, "N": state.total_num_replicas,
            "staleness": state.staleness, "max_spread": state.max_spread,
            "issued": sorted(state.issued.items()),
            "tokens": sorted([c, s, r] for c, (s, r) in state.tokens.items()),
            "done": sorted([s, sorted(cs)] for s, cs in state.done.items()),
            "clocks": state.clocks, "started": state.started, "holders": sorted(state.holders.items()),
            "ages": {w: max(0.0, now - t) for w, t in state.last_seen.items()}}


def from_wire(data: object, now: float) -> tuple[TokenState, int]:
    """(state, G) from `to_wire`'s data, checked (it came over the network).

    Raises:
        InvalidArgumentError: not the shape `to_wire` makes.
    """
    try:
        if not isinstance(data, dict) or data["mode"] not in MODES:
            raise ValueError("not a sync state")
        state = TokenState(mode=data["mode"], replicas_to_aggregate=int(data["R"]),
                           total_num_replicas=int(data["N"]), staleness=int(data["staleness"]),
                           max_spread=int(data["max_spread"]),
                           issued={int(s): int(n) for s, n in data["issued"]},
                           tokens={int(c): (int(s), int(r)) for c, s, r in data["tokens"]},
                           done={int(s): {int(c) for c in cs} for s, cs in data["done"]},
                           clocks={str(w): int(c) for w, c in data["clocks"].items()},
                           started={str(w): int(c) for w, c in data["started"].items()},
                           last_seen={str(w): now - float(a) for w, a in data["ages"].items()},
                           holders={int(c): str(w) for c, w in data["holders"]})
        return state, int(data["G"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InvalidArgumentError(f"a replicated sync state is malformed: {exc!r}") from exc
