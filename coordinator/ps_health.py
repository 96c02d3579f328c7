"""PS down/up detection and lost-update accounting as one pure state machine (ps_monitor.py executes it).

`decide(state, event, now)` updates `state` in place and returns the actions to perform; it does no
I/O and reads no clock. The executor (`PsMonitor`) polls every PS's status and feeds `Polled`; it
performs `Pause`/`Resume` (the scheduler's PsDown/PsUp), `PollSoon` (look again while a PS is down),
`Account` (ask a restarted PS which version each shard came back with, then feed `Restored`) and
`Backoff`/`GiveUp` after failed checks. Closures' reported versions arrive as `Reported`.

With replicas: 2 (`replicated`) nothing pauses: a PS that does not answer is skipped (its shards'
backups take over), a restart is accounted as soon as it answers, and only the shards the replica
keeper reports lost (both copies died) count as lost updates.

Phases: watching -> down (a PS does not answer, or answers with a new incarnation: a restart) ->
watching, once every PS answers and each restart is accounted. A failed check goes back to watching:
the next check finds the unaccounted restart again. A wake with every PS healthy resumes at once
(a closure was handed back as a cluster failure, e.g. a token wait timed out, but nothing is down).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pscluster.proto import pscluster_pb2 as pb

DOWN_POLL_S = 0.1  # how often a paused monitor asks again while a PS does not answer
BACKOFF_S = 0.1  # first wait after a failed check, doubled per failure in a row
MAX_BACKOFF_S = 2.0


class VersionRanges:
    """A set of integers as sorted disjoint closed ranges; `count_above(v)` counts members > v."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, v: int) -> None:
        """Insert v (idempotent), merging with its neighbours."""
        i = bisect.bisect_right(self._starts, v) - 1
        if i >= 0 and self._starts[i] <= v <= self._ends[i]:
            return
        joins_left = i >= 0 and self._ends[i] == v - 1
        joins_right = i + 1 < len(self._starts) and self._starts[i + 1] == v + 1
        if joins_left and joins_right:
            self._ends[i] = self._ends[i + 1]
            del self._starts[i + 1], self._ends[i + 1]
        elif joins_left:
            self._ends[i] = v
        elif joins_right:
            self._starts[i + 1] = v
        else:
            self._starts.insert(i + 1, v)
            self._ends.insert(i + 1, v)

    def count_above(self, v: int) -> int:
        """How many members are > v."""
        return sum(e - max(s, v + 1) + 1 for s, e in zip(self._starts, self._ends) if e > v)

    def drop_through(self, v: int) -> None:
        """Forget members <= v."""
        i = bisect.bisect_right(self._ends, v)
        del self._starts[:i], self._ends[:i]
        if self._starts and self._starts[0] <= v:
            self._starts[0] = v + 1

    def union(self, other: VersionRanges) -> None:
        """Add every member of `other`."""
        pairs = sorted(zip(self._starts + other._starts, self._ends + other._ends))
        self._starts, self._ends = [], []
        for s, e in pairs:
            if self._ends and s <= self._ends[-1] + 1:
                self._ends[-1] = max(self._ends[-1], e)
            else:
                self._starts.append(s)
                self._ends.append(e)

    def __len__(self) -> int:
        return len(self._starts)


# -- events ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Seen:
    """What one PS's status said."""

    incarnation: int
    restored_step: int


@dataclass(frozen=True)
class Polled:
    """Every PS answered (`statuses`, by PS index) or at least one did not (None; replicated: that PS's entry
    is None); `woken`: asked to look."""

    statuses: tuple[Seen | None, ...] | None
    woken: bool = False


@dataclass(frozen=True)
class Restored:
    """PS `ps` came back as `incarnation`; `versions`: the version each (variable, shard) restored."""

    ps: int
    incarnation: int
    versions: dict[tuple[str, int], int]


@dataclass(frozen=True)
class Reported:
    """A finished closure's pushes produced these shard versions."""

    versions: Sequence[pb.ShardVersion]


@dataclass(frozen=True)
class ShardRestored:
    """Replicated: both copies of (variable, shard_index) had died and it came back from a checkpoint on PS `ps`,
    restarted as `incarnation`. Sent by the replica keeper before the PS may take the shard's pushes: every
    version reported for the shard until then, by whichever PS was its primary, belongs to the copies that died."""

    ps: int
    incarnation: int
    variable: str
    shard_index: int


@dataclass(frozen=True)
class CheckPassed:
    """A check ran to its end."""


@dataclass(frozen=True)
class CheckFailed:
    """A check raised `error` (a PS answering garbage, a restart met again mid-accounting)."""

    error: Exception


Event = Polled | Restored | ShardRestored | Reported | CheckPassed | CheckFailed


# -- actions --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pause:
    """Stop dispatching: a PS is down or restarted."""


@dataclass(frozen=True)
class PollSoon:
    """Ask every PS again after `after` seconds (unless stopping)."""

    after: float


@dataclass(frozen=True)
class Account:
    """Ask PS `ps` (now `incarnation`, restored from `restored_step`) for its restored versions."""

    ps: int
    incarnation: int
    restored_step: int


@dataclass(frozen=True)
class Resume:
    """Dispatch again; `paused_s`: how long it was paused (None: a false alarm, nothing was paused)."""

    paused_s: float | None


@dataclass(frozen=True)
class Backoff:
    """Wait `seconds`, then check again; `failures` checks failed in a row."""

    seconds: float
    failures: int


@dataclass(frozen=True)
class GiveUp:
    """`failures` checks failed in a row: report `error` and end the monitor."""

    error: Exception
    failures: int


Action = Pause | PollSoon | Account | Resume | Backoff | GiveUp


# -- state ----------------------------------------------------------------------------------------
@dataclass
class HealthState:
    """Everything the monitor decides from."""

    incarnations: list[int]  # per PS: the incarnation last accounted
    max_failures: int = 5
    replicated: bool = False  # replicas: 2: never pause; see the module docstring
    phase: Literal["watching", "down"] = "watching"
    paused_at: float = 0.0
    failures: int = 0
    seen: dict[tuple[str, int, int], VersionRanges] = field(default_factory=dict)  # (var, shard, incarnation)
    # per restart: the PS, its old incarnation and the version each of its shards came back with
    # (ps, old incarnation, new incarnation, versions restored): one entry per restart
    restores: list[tuple[int, int, int, dict[tuple[str, int], int]]] = field(default_factory=list)
    # replicated: (ps, new incarnation) -> shard -> every version reported for it before both its copies died
    rolled_back: dict[tuple[int, int], dict[tuple[str, int], VersionRanges]] = field(default_factory=dict)


def decide(state: HealthState, event: Event, now: float) -> list[Action]:
    """Apply one event to the state; return the actions the executor performs, in order."""
    if isinstance(event, Reported):
        for v in event.versions:
            key = (v.variable, v.shard_index, v.incarnation)
            ranges = state.seen.get(key)
            if ranges is None:  # not setdefault: that would build a VersionRanges per report
                ranges = state.seen[key] = VersionRanges()
            ranges.add(v.version)
        return []
    if isinstance(event, Restored):
        old = state.incarnations[event.ps]
        state.restores.append((event.ps, old, event.incarnation, event.versions))
        for (var, shard), version in event.versions.items():
            seen = state.seen.get((var, shard, old))
            if seen is not None:
                seen.drop_through(version)  # only what the restart rolled back can ever count
        state.incarnations[event.ps] = event.incarnation
        return []
    if isinstance(event, ShardRestored):
        restored_shard = (event.variable, event.shard_index)
        merged = VersionRanges()
        for key in [k for k in state.seen if k[:2] == restored_shard]:  # every primary before it, failovers included
            merged.union(state.seen.pop(key))
        state.rolled_back.setdefault((event.ps, event.incarnation), {})[restored_shard] = merged
        return []
    if isinstance(event, CheckPassed):
        state.failures = 0
        return []
    if isinstance(event, CheckFailed):
        state.phase = "watching"
        state.failures += 1
        if state.failures >= state.max_failures:
            return [GiveUp(event.error, state.failures)]
        return [Backoff(min(BACKOFF_S * 2 ** state.failures, MAX_BACKOFF_S), state.failures)]
    return _polled(state, event, now)


def _polled(state: HealthState, event: Polled, now: float) -> list[Action]:
    statuses = event.statuses
    for s in (statuses or ())[len(state.incarnations):]:  # a PS that joined the list: first sight, no restart
        if s is None:
            break
        state.incarnations.append(s.incarnation)
    statuses = None if statuses is None else statuses[:len(state.incarnations)]
    restarted: list[Action] = [] if statuses is None else [
        Account(ps, s.incarnation, s.restored_step) for ps, s in enumerate(statuses)
        if s is not None and s.incarnation != state.incarnations[ps]]
    if state.replicated:
        # a closure that met a dead PS retries on the promoted backup: nothing to wait for
        return restarted + ([Resume(None)] if event.woken else [])
    actions: list[Action] = []
    if state.phase == "watching":
        if statuses is not None and not restarted:
            return [Resume(None)] if event.woken else []
        state.phase, state.paused_at = "down", now
        actions.append(Pause())
    if statuses is None:
        return actions + [PollSoon(DOWN_POLL_S)]
    state.phase = "watching"
    return actions + restarted + [Resume(now - state.paused_at)]


def lost_by_variable(state: HealthState) -> dict[str, int]:
    """Reported versions beyond what a restart restored, per variable.

    replicas: 1: the versions the restarted PS's old incarnation reported. Replicated: only the shards that
    restart brought back from a checkpoint (both copies had died: `ShardRestored`), with the versions every
    primary of the shard reported before then; a shard a backup took over lost nothing. A report that reaches
    the coordinator after the shard's restore (a closure acknowledged by a copy that died, finishing later)
    is not counted: it cannot be told from the restored shard's own new versions.
    """
    out: dict[str, int] = {}
    for ps, old, new, restored in state.restores:
        rolled_back = state.rolled_back.get((ps, new), {}) if state.replicated else None
        for (var, shard), version in restored.items():
            seen = state.seen.get((var, shard, old)) if rolled_back is None else rolled_back.get((var, shard))
            if seen is not None:
                out[var] = out.get(var, 0) + seen.count_above(version)
    return out
