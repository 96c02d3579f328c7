"""Who holds each shard: shard -> (primary, backup, epoch), as one pure state machine (`replicas: 2`, or one
copy that can move: `elastic`).

`decide(state, event)` updates `state` in place and returns the actions to perform; it does no I/O and
reads no clock (events carry `now`), as scheduler.py. The coordinator feeds PS heartbeats, dropped
connections, restarts and finished catch-ups, and performs the actions (tell a PS its roles, start a
catch-up, account a checkpoint restore, publish the table to clients). docs/ps_failures.md has the
guarantees.

Rules:
- A PS is down after a dropped connection, or when `missed` heartbeats in a row did not come
  (`now - last_seen > missed * interval`), judged only in a round the coordinator ran on time: one whose own
  scheduling delay (`Tick.slack`, `own_delay`) passed `interval` says nothing about the PS tasks (a starved
  coordinator sees its own Status calls time out); the next round on time judges them.
- Every change of a shard's (primary, backup) bumps its epoch: a backup refuses forwards of an older
  epoch and a PS refuses pushes for a shard it is not primary of at the current epoch, so a deposed
  primary that wakes up (SIGSTOP) cannot change anything.
- Primary down, backup up and in sync (it confirmed everything: acknowledgements wait for it): the
  backup is promoted. Otherwise both copies are gone: the shard is `lost` until one of its two holders
  comes back with the newest checkpoint (the restore that `lost_updates()` accounts for).
- Backup down: the shard keeps its primary and gets a new backup.
- Any shard without a backup gets one on the up PS (not its primary) holding the fewest backups, ties
  broken by the striped order, and it counts as in sync only after its catch-up finished.
- An elastic move (`Reassign`, planned by rebalance.py, carried out by elastic.py) gives a shard new
  holders at a new epoch, only if the shard is still at the epoch the executor read (a failover in between
  voids it) and a new primary is the shard's in-sync backup; a PS outside the active set (`inactive`,
  drained by a scale) gets no new backup.
- Initial backups are striped: shard k on primary p = k mod P goes to (p + 1 + (k // P) mod (P - 1)) mod P,
  so the shards of one PS are backed up by all the others and a dead PS spreads its load.
- The sync state (token queue, bounded clocks, global step) is one more row, ordinal SYNC_ORDINAL: primary
  PS 0 and backup PS 1 at first, then the same rules as a shard.
- With one copy (`copies` 1: replicas: 1 with `elastic`) no shard is given a backup: a shard has one only
  while an elastic move catches its new primary up (the same Reassign steps), and a primary that dies
  loses the shard to the checkpoint, as a replicas: 2 shard that lost both copies. With nothing to
  promote, the keeper counts a PS down after ONE_COPY_MISSED_HEARTBEATS (replica_keeper.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pscluster.errors import InvalidArgumentError

HEARTBEAT_INTERVAL_S = 0.1
MISSED_HEARTBEATS = 3
# one copy: nothing to promote, so a PS slow under load is not marked down (its shards lost) before this
# many; a dropped connection still marks it down at once
ONE_COPY_MISSED_HEARTBEATS = 20
SYNC_ORDINAL = -1  # the sync state's row (real shards' ordinals start at 0)


@dataclass(frozen=True)
class Copies:
    """Where one shard lives: primary, backup (None while it has none), epoch, and whether the backup
    finished catching up; `lost`: both copies died and the shard waits for a checkpoint restore."""

    primary: int
    backup: int | None
    epoch: int
    in_sync: bool = False
    lost: bool = False


@dataclass
class PsRec:
    """Liveness of one PS task."""

    up: bool = True
    last_seen: float = 0.0


@dataclass
class ReplicaState:
    """The table the coordinator owns, and the PS liveness it is decided from."""

    num_ps: int
    now: float = 0.0  # when watching started: every PS counts as seen then
    interval: float = HEARTBEAT_INTERVAL_S
    missed: int = MISSED_HEARTBEATS
    shards: dict[int, Copies] = field(default_factory=dict)  # ordinal -> copies
    ps: dict[int, PsRec] = field(default_factory=dict)
    version: int = 0  # bumped whenever the table changes; clients re-read placement on a newer one
    inactive: set[int] = field(default_factory=set)  # PS tasks a scale drained: they get no new copies
    copies: int = 2  # 1: no backups but a move's temporary one (see the module docstring)

    def __post_init__(self) -> None:
        if self.copies not in (1, 2):
            raise InvalidArgumentError(f"copies must be 1 or 2, got {self.copies}")
        if self.num_ps < self.copies:
            raise InvalidArgumentError(f"replicas: 2 needs at least 2 PS tasks, the cluster has {self.num_ps}")
        for i in range(self.num_ps):
            self.ps.setdefault(i, PsRec(last_seen=self.now))

    def up(self) -> list[int]:
        """The PS tasks up now, in index order."""
        return [i for i, rec in sorted(self.ps.items()) if rec.up]


# -- events -----------------------------------------------------------------------------------------
class ShardCreated(NamedTuple):
    """A shard with this ordinal was created on `primary` (None: ordinal mod P, the placement of a list
    that did not change; a PS list that grew leaves clients placing by the P they knew)."""

    ordinal: int
    primary: int | None = None


class Heartbeat(NamedTuple):
    """PS `ps` answered at `now`."""

    ps: int
    now: float


class ConnectionLost(NamedTuple):
    """The coordinator's connection to PS `ps` dropped."""

    ps: int


class Tick(NamedTuple):
    """Time passed: look for missed heartbeats; slack: how late the coordinator itself ran (`own_delay`): past
    `interval` the round judges nothing."""

    now: float
    slack: float = 0.0


def own_delay(late: float, asked: float, now: float, timeout: float) -> float:
    """The keeper's own scheduling delay in a round: its start `late` past the planned one, plus its Status
    calls' return past their deadline (asked at `asked`, all back at `now`; each call ends by `timeout` when the
    coordinator runs on time)."""
    return max(0.0, late) + max(0.0, now - asked - timeout)


class Rejoined(NamedTuple):
    """PS `ps` answers again after it was down: `restarted` (it loaded the newest checkpoint), or not (it was
    marked down for missed heartbeats: it holds what it held)."""

    ps: int
    now: float
    restarted: bool = True


class CaughtUp(NamedTuple):
    """The backup of shard `ordinal` holds everything its primary acknowledged at `epoch`."""

    ordinal: int
    epoch: int


class Reassign(NamedTuple):
    """An elastic move: shard `ordinal`, read at `epoch` by the executor, gets `primary` and `backup` at a new
    epoch (the backup catches up; a new primary must be the in-sync backup, frozen on the old primary at
    `epoch`: elastic.py)."""

    ordinal: int
    primary: int
    backup: int | None
    epoch: int


ReplicaEvent = ShardCreated | Heartbeat | ConnectionLost | Tick | Rejoined | CaughtUp | Reassign


# -- actions ----------------------------------------------------------------------------------------
class Assign(NamedTuple):
    """Tell both holders of shard `ordinal` their roles at `epoch`; a new backup catches up from the
    primary first (`catch_up`)."""

    ordinal: int
    copies: Copies
    catch_up: bool


class Lost(NamedTuple):
    """Both copies of shard `ordinal` are gone: it waits for a checkpoint restore."""

    ordinal: int
    epoch: int


class Restored(NamedTuple):
    """Shard `ordinal` came back from a checkpoint on PS `ps` (lost_updates() accounts for it)."""

    ordinal: int
    ps: int
    epoch: int


class Publish(NamedTuple):
    """The table changed: publish `version` so clients re-read placement."""

    version: int


ReplicaAction = Assign | Lost | Restored | Publish


def striped_backup(ordinal: int, num_ps: int) -> int:
    """The initial backup of the shard created `ordinal`-th (its primary is ordinal mod num_ps)."""
    if num_ps < 2:
        raise InvalidArgumentError(f"replicas: 2 needs at least 2 PS tasks, the cluster has {num_ps}")
    if ordinal == SYNC_ORDINAL:
        return 1
    primary = ordinal % num_ps
    return (primary + 1 + (ordinal // num_ps) % (num_ps - 1)) % num_ps


def decide(state: ReplicaState, event: ReplicaEvent) -> list[ReplicaAction]:
    """Apply one event to the table; returns what to do (see the module docstring)."""
    actions: list[ReplicaAction] = []
    if isinstance(event, ShardCreated):
        if event.ordinal in state.shards:
            return []
        primary = event.primary if event.primary is not None else 0 if event.ordinal == SYNC_ORDINAL else \
            event.ordinal % state.num_ps
        backup = striped_backup(event.ordinal, state.num_ps) if state.copies > 1 else None
        # the backup gets the shard's state from its primary: in sync once the primary says it confirmed it
        copies = Copies(primary, backup, 1)
        if backup is None or backup == primary or not state.ps[backup].up or backup in state.inactive:
            copies = Copies(primary, None, 1)  # a backup is chosen below, as for any shard without one
        state.shards[event.ordinal] = copies
        actions.append(Assign(event.ordinal, copies, copies.backup is not None))
    elif isinstance(event, Heartbeat):
        rec = state.ps.get(event.ps)
        if rec is not None and rec.up:
            rec.last_seen = max(rec.last_seen, event.now)
        return []
    elif isinstance(event, ConnectionLost):
        _mark_down(state, event.ps, actions)
    elif isinstance(event, Tick):
        limit = state.missed * state.interval
        for ps, rec in sorted(state.ps.items()):
            if rec.up and event.now - rec.last_seen > limit and event.slack <= state.interval:
                _mark_down(state, ps, actions)
    elif isinstance(event, Rejoined):
        rec = state.ps.get(event.ps)
        if rec is None or rec.up:
            return []
        rec.up, rec.last_seen = True, event.now
        for ordinal, c in sorted(state.shards.items()):
            # a lost shard comes back on its last primary (a whole copy, or the checkpoint after a restart), or on
            # its backup if that one restarted (the checkpoint) or was in sync; a backup that never finished
            # catching up and did not restart holds a part of the shard, or none of it
            if c.lost and (event.ps == c.primary or
                           (event.ps == c.backup and (event.restarted or c.in_sync))):
                copies = state.shards[ordinal] = Copies(event.ps, None, c.epoch + 1)
                actions.append(Restored(ordinal, event.ps, copies.epoch))
    elif isinstance(event, Reassign):
        found = state.shards.get(event.ordinal)
        holders = [ps for ps in (event.primary, event.backup) if ps is not None]
        if found is None or found.lost or event.primary == event.backup or found.epoch != event.epoch or \
                not all(ps in state.ps and state.ps[ps].up for ps in holders):
            return []  # nothing to move, onto a PS that is down, or the table moved on (a failover got there first)
        if event.primary != found.primary and (event.primary != found.backup or not found.in_sync):
            return []  # only the in-sync backup holds everything the frozen primary acknowledged
        copies = state.shards[event.ordinal] = Copies(event.primary, event.backup, found.epoch + 1)
        actions.append(Assign(event.ordinal, copies, event.backup is not None))
    elif isinstance(event, CaughtUp):
        found = state.shards.get(event.ordinal)
        if found is None or found.epoch != event.epoch or found.backup is None or found.in_sync:
            return []  # a catch-up of an older configuration: the table moved on
        c = found
        state.shards[event.ordinal] = Copies(c.primary, c.backup, c.epoch, in_sync=True)
        state.version += 1
        return [Publish(state.version)]
    _assign_missing_backups(state, actions)
    if actions:
        state.version += 1
        actions.append(Publish(state.version))
    return actions


def _mark_down(state: ReplicaState, ps: int, actions: list[ReplicaAction]) -> None:
    rec = state.ps.get(ps)
    if rec is None or not rec.up:
        return
    rec.up = False
    for ordinal, c in sorted(state.shards.items()):
        if c.lost:
            continue
        if c.primary == ps:
            if c.backup is not None and c.in_sync and state.ps[c.backup].up:
                copies = state.shards[ordinal] = Copies(c.backup, None, c.epoch + 1)
                actions.append(Assign(ordinal, copies, False))
            else:
                # no backup, or one that never finished catching up: the primary's copy was the only one;
                # the shard comes back from the checkpoint when one of its holders restarts
                state.shards[ordinal] = Copies(ps, c.backup, c.epoch + 1, in_sync=c.in_sync, lost=True)
                actions.append(Lost(ordinal, c.epoch + 1))
        elif c.backup == ps:
            copies = state.shards[ordinal] = Copies(c.primary, None, c.epoch + 1)
            actions.append(Assign(ordinal, copies, False))


def _assign_missing_backups(state: ReplicaState, actions: list[ReplicaAction]) -> None:
    if state.copies < 2:
        return  # one copy: a shard gets a backup only for a move (Reassign)
    up = state.up()
    load = {ps: 0 for ps in up}
    for c in state.shards.values():
        if c.backup is not None and c.backup in load:
            load[c.backup] += 1
    for ordinal, c in sorted(state.shards.items()):
        if c.lost or c.backup is not None or not state.ps[c.primary].up:
            continue
        candidates = [ps for ps in up if ps != c.primary and ps not in state.inactive] or \
            [ps for ps in up if ps != c.primary]  # a drained PS rather than one copy
        if not candidates:
            continue  # a lone PS: the shard runs on one copy until another comes back
        striped = striped_backup(ordinal, state.num_ps)
        # fewest backups first; among equals, the striped one, then the next ones after it
        best = min(candidates, key=lambda ps: (load[ps], (ps - striped) % state.num_ps))
        load[best] += 1
        copies = state.shards[ordinal] = Copies(c.primary, best, c.epoch + 1)
        actions.append(Assign(ordinal, copies, True))
