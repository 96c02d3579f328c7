"""Elastic PS: carry out a change of the active PS set, one shard at a time (docs/elastic.md).

The plan is rebalance.py's (pure); this executor moves each shard the plan changes, through the replica
keeper's table (replica_keeper.py) and the PS's freeze (server/handoff.py):

1. The successor becomes the shard's backup at a new epoch, unless it is its in-sync backup already: the
   primary sends it the whole shard and forwards every later update (server/replication.py); wait until
   the primary says the backup confirmed the state.
2. Freeze the shard on its primary: no new push is admitted; those admitted finish and the successor
   confirms the shard's version.
3. Switch: a new epoch with the successor as primary (and the plan's backup, which catches up from it),
   sent to the successor first, then to every PS; then thaw the old primary (it is no longer the primary:
   it refuses pushes, and clients re-read placement and retry with the same push ids).

The freeze (2 to 3) is what a shard's writers wait for, and it is measured per shard. A backup that only
changes PS needs step 1 alone. With one copy (replicas: 1, elastic) the successor is a temporary backup:
the same steps, and the switch leaves the shard with no backup again. Moves run one at a time and a second
scale while one runs is refused.

The sync state's row (the token queue, bounded clocks and G: SYNC_STATE_KEY) is not in the plan: after
the shards, a copy of it on a PS that leaves the active set moves to an active one, a backup by step 1
alone, a primary by the same three steps with its token calls frozen (server/ps.py), so a PS that held
it can be drained and leave.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from pscluster.coordinator import rebalance as rb
from pscluster.coordinator import replicas as rp
from pscluster.coordinator.replica_keeper import ReplicaKeeper
from pscluster.proto import pscluster_pb2 as pb

from pscluster.errors import (
    AbortedError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    PsclusterError,
)
from pscluster.net import rpc

log = logging.getLogger(__name__)

JOIN_GRACE_S = 3.0  # add() of a PS that just joined waits this long for the keeper to see it answer
FREEZE_LEASE_S = 2.0  # a freeze ends by itself after this, should the coordinator die mid-move


def never() -> bool:
    """A scale's `cancelled` when nobody can cancel it (an in-process call)."""
    return False


class ScaleReport(NamedTuple):
    """What a scale did: the active PS tasks after it, how many shard copies it moved, and each moved
    primary's freeze (seconds it refused pushes)."""

    active: list[int]
    moved: int
    freezes_s: list[float]
    left: tuple[int, ...] = ()  # joined PS tasks that left the PS list after the scale: their processes can stop


class Elastic:
    """Owns the active PS set of a cluster with a replica table and carries out scales (one at a time)."""

    def __init__(self, keeper: ReplicaKeeper, stubs: Sequence[object], lease_s: float = FREEZE_LEASE_S,
                 catch_up_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._keeper = keeper
        self._stubs = stubs
        self._lease = lease_s
        self._catch_up = catch_up_s
        self._clock = clock
        self._busy = threading.Lock()  # held for a whole scale: a second one is refused, not queued
        self._active: list[int] | None = None  # None until a scale: every PS of the list not drained

    @property
    def active(self) -> list[int]:
        """The PS tasks that hold shards: a scale's set, or before any scale every PS task of the list that
        is not drained (a PS that just joined is not, until added; after a coordinator restart every PS task
        of the adopted list is)."""
        if self._active is not None:
            return list(self._active)
        return [ps for ps in range(len(self._stubs)) if ps not in self._keeper.state.inactive]

    @active.setter
    def active(self, tasks: list[int]) -> None:
        self._active = list(tasks)

    def scale_to(self, count: int, cancelled: Callable[[], bool] = never) -> ScaleReport:
        """Make PS tasks 0 .. count-1 the active set."""
        least, listed = self._keeper.state.copies, len(self._stubs)
        if count > listed:
            raise InvalidArgumentError(f"scale --ps {count}: only {listed} PS tasks (0..{listed - 1}) are in the list; "
                                       "start another with `pscluster ps --join --port P` first (LocalCluster.scale "
                                       f"does both), or pass {least}..{listed}")
        if count < least:
            need = "replicas: 2 needs at least 2 active" if least > 1 else "at least 1 must be active"
            raise InvalidArgumentError(f"scale --ps {count}: {need}; pass {least}..{listed}")
        return self.scale(list(range(count)), cancelled)

    def add(self, task: int, cancelled: Callable[[], bool] = never) -> ScaleReport:
        """Bring a drained PS task back: it takes its share of the shards."""
        self._check_task(task)
        if task in self.active:
            raise FailedPreconditionError(f"ps {task} is active already (active: {self.active})")
        deadline = self._clock() + JOIN_GRACE_S
        while task not in self._keeper.state.up() and self._clock() < deadline:
            time.sleep(0.02)  # a PS that just joined the list: the keeper's next round sees it answer
        return self.scale(sorted({*self.active, task}), cancelled)

    def remove(self, task: int, cancelled: Callable[[], bool] = never) -> ScaleReport:
        """Drain a PS task: its shard copies move to the other active tasks."""
        self._check_task(task)
        if task not in self.active:
            raise FailedPreconditionError(f"ps {task} is not active (active: {self.active}); nothing to drain")
        return self.scale([ps for ps in self.active if ps != task], cancelled)

    def join(self, address: str) -> tuple[int, list[str], int]:
        """A PS joins the PS list (replica_keeper.join): its task index, the list and its epoch."""
        index = self._keeper.join(address)
        return index, list(self._keeper.book.addresses), self._keeper.book.epoch

    def joined(self, task: int) -> bool:
        """Whether PS task `task` joined the PS list (the cluster file does not list it)."""
        return self._keeper.book.listed <= task < len(self._stubs)

    def _leave_drained(self) -> list[int]:
        """Joined PS tasks at the end of the list that a scale drained leave it (ps_book.py: indices stay dense);
        returns those that left."""
        book = self._keeper.book
        left: list[int] = []
        while len(book.addresses) > book.listed and len(book.addresses) - 1 not in self.active:
            task = len(book.addresses) - 1
            try:
                self._keeper.leave(task)
            except FailedPreconditionError as exc:  # a failover gave it a copy meanwhile: the next scale retries
                log.warning("ps list: %s", exc)
                break
            log.warning("ps %d left the PS list: stop its process", task)
            left.append(task)
        return left

    def scale(self, active: Sequence[int], cancelled: Callable[[], bool] = never) -> ScaleReport:
        """Move shard copies so that only `active` PS tasks hold them (rebalance.py's plan); `cancelled` is
        asked between moves and while a catch-up runs (the RPC's caller went away: stop there).

        Raises:
            InvalidArgumentError: an unknown PS task, or an active set that cannot hold two copies.
            FailedPreconditionError: a scale is under way, a PS of the new set is down, or a shard lost
                both its copies; nothing moved.
            DeadlineExceededError: a catch-up or a freeze did not finish; the moves before it stand.
            UnavailableError: a move's holder went down, or a failover changed the shard mid-move.
            AbortedError: `cancelled` said so; the moves before stand.
        A scale that stops part-way keeps the active set it had (the drained PS may hold backups again).
        """
        for task in active:
            self._check_task(task)
        if not self._busy.acquire(blocking=False):
            raise FailedPreconditionError("a scale is under way; wait for it to finish (pscluster status shows the "
                                          "replica table) and try again")
        try:
            report = self._scale(sorted(active), cancelled)
            return report._replace(left=tuple(self._leave_drained()))
        finally:
            self._busy.release()

    def _check_task(self, task: int) -> None:
        if not 0 <= task < len(self._stubs):
            raise InvalidArgumentError(f"unknown PS task {task}: this cluster has PS tasks 0..{len(self._stubs) - 1}")

    def _scale(self, active: list[int], cancelled: Callable[[], bool]) -> ScaleReport:
        layout = self._keeper.layout()
        lost = sorted(o for o, c in layout.items() if c.lost)
        if lost:
            raise FailedPreconditionError(f"{len(lost)} shards lost both copies and wait for a checkpoint restore "
                                          f"(e.g. {self._keeper.key_of(lost[0])}); scale once they are back")
        down = [ps for ps in active if ps not in self._keeper.state.up()]
        if down:
            raise FailedPreconditionError(f"ps {down} of the new active set is down; scale once it is back")
        before = {o: rb.Place(c.primary, c.backup) for o, c in layout.items()}
        after = rb.rebalance(before, active, self._keeper.state.copies)
        everyone, was = set(range(len(self._stubs))), self.active
        self._keeper.set_inactive(everyone - set(active))
        freezes: list[float] = []
        try:
            for ordinal in sorted(after):
                if after[ordinal] != before[ordinal]:
                    if cancelled():
                        raise AbortedError(f"scale to PS {active} stopped after {len(freezes)} primaries moved: "
                                           "its caller went away; the moves before stand")
                    frozen = self._move(ordinal, after[ordinal], cancelled)
                    if frozen is not None:
                        freezes.append(frozen)
            synced, sync_frozen = self._move_sync_row(active, cancelled)
            if sync_frozen is not None:
                freezes.append(sync_frozen)
        except BaseException:
            # the scale did not happen: the tasks active before may take new backups again (a failover's)
            self._keeper.set_inactive(everyone - set(was))
            raise
        self.active = active
        moved = len(rb.moves(before, after)) + synced
        log.info("scale: active PS %s; %d copies moved; freeze per moved primary max %.1f ms", active, moved,
                 1e3 * max(freezes, default=0.0))
        return ScaleReport(active, moved, freezes)

    def _move(self, ordinal: int, dest: rb.Place, cancelled: Callable[[], bool]) -> float | None:
        """Move one shard to dest, then drop the copies of the PS tasks that no longer hold it; the freeze in
        seconds when its primary moved."""
        c = self._keeper.layout()[ordinal]
        frozen = self._switch(ordinal, c, dest, cancelled)
        for ps in (c.primary, c.backup):
            if ps is not None and ps not in (dest.primary, dest.backup):
                self._drop(ordinal, ps)
        return frozen

    def _move_sync_row(self, active: list[int], cancelled: Callable[[], bool]) -> tuple[int, float | None]:
        """Move the sync state's row off PS tasks outside `active`: a backup there goes to the active PS (not
        the primary) holding the fewest backups, with no freeze (token calls wait for the new backup, as after
        a failover gives the row one); a primary there moves like a shard's, to its in-sync backup if that
        is active, with a freeze of the token calls (server/ps.py: waiting TakeTokens retry on the new
        primary with their closure ids). Returns (copies moved, the freeze if the primary moved)."""
        c = self._keeper.sync_row()
        if c is None or c.lost or (c.primary in active and (c.backup is None or c.backup in active)):
            return 0, None
        backups = {ps: 0 for ps in active}
        for copies in self._keeper.layout().values():
            if copies.backup in backups:
                backups[copies.backup] += 1

        def fewest(but: int | None) -> int | None:
            return min((ps for ps in backups if ps != but), key=lambda ps: (backups[ps], ps), default=None)

        if c.primary in active:
            backup = fewest(c.primary)
            if backup is None:
                return 0, None
            self._keeper.reassign(rp.SYNC_ORDINAL, c.primary, backup, c.epoch)
            self._wait_in_sync(rp.SYNC_ORDINAL, cancelled)
            log.info("scale: the sync state's backup moved from ps %s to ps %d (primary ps %d)", c.backup, backup,
                     c.primary)
            return 1, None
        primary = c.backup if c.backup is not None and c.backup in active else fewest(None)
        if primary is None:
            return 0, None
        place = rb.Place(primary, fewest(primary) if self._keeper.state.copies > 1 else None)
        frozen = self._switch(rp.SYNC_ORDINAL, c, place, cancelled)
        return len(rb.moves({0: rb.Place(c.primary, c.backup)}, {0: place})), frozen

    def _drop(self, ordinal: int, ps: int) -> None:
        key = self._keeper.key_of(ordinal)
        request = pb.FreezeRequest(ref=pb.ShardRef(variable=key[0], shard_index=key[1]), thaw=True, drop=True)
        try:  # memory only: a copy the table gives no role serves nothing, and a retry of the scale drops it
            rpc.call(self._stubs[ps].FreezeShard, request, timeout=1.0)  # type: ignore[attr-defined]
        except PsclusterError as exc:
            log.warning("scale: ps %d did not drop its copy of %s[%d]: %s", ps, key[0], key[1], exc)

    def _switch(self, ordinal: int, c: rp.Copies, dest: rb.Place, cancelled: Callable[[], bool]) -> float | None:
        if dest.primary == c.primary:
            if dest.backup != c.backup:
                self._keeper.reassign(ordinal, c.primary, dest.backup, c.epoch)
                self._wait_in_sync(ordinal, cancelled)
            return None
        successor = dest.primary
        if c.backup != successor or not c.in_sync:
            c = self._keeper.reassign(ordinal, c.primary, successor, c.epoch)
            self._wait_in_sync(ordinal, cancelled)
        key = self._keeper.key_of(ordinal)
        ref = pb.ShardRef(variable=key[0], shard_index=key[1])
        old = self._stubs[c.primary]
        started = time.perf_counter()
        switched: list[float] = []  # when the successor took the table: the shard admits pushes again there
        try:  # the lease restarts with each admitted push that finishes: the drain may outlast one lease
            rpc.call(old.FreezeShard, pb.FreezeRequest(ref=ref, successor=successor,  # type: ignore[attr-defined]
                                                       lease_s=self._lease), timeout=self._catch_up)
        except PsclusterError:
            self._thaw(old, ref, c.primary)  # a freeze that answered late must not wait for its lease
            raise
        drained = time.perf_counter() - started
        try:
            # at the epoch read before the freeze: a failover since then (the table moved on) voids the switch
            self._keeper.reassign(ordinal, successor, dest.backup, c.epoch, lambda: switched.append(time.perf_counter()))
        finally:
            frozen = (switched[0] if switched else time.perf_counter()) - started
            self._thaw(old, ref, c.primary)
        log.info("scale: %s[%d] moved from ps %d to ps %d, frozen %.1f ms (%.1f ms of them draining)", key[0], key[1],
                 c.primary, successor, 1e3 * frozen, 1e3 * drained)
        self._wait_in_sync(ordinal, cancelled)  # its new backup holds it before the next move leans on it
        return frozen

    def _thaw(self, stub: object, ref: pb.ShardRef, ps: int) -> None:
        try:
            rpc.call(stub.FreezeShard, pb.FreezeRequest(ref=ref, thaw=True), timeout=1.0)  # type: ignore[attr-defined]
        except PsclusterError as exc:  # its lease ends the freeze anyway
            log.warning("scale: ps %d did not thaw %s[%d]: %s", ps, ref.variable, ref.shard_index, exc)

    def _wait_in_sync(self, ordinal: int, cancelled: Callable[[], bool]) -> None:
        deadline = self._clock() + self._catch_up
        one_copy = self._keeper.state.copies == 1  # a shard with no backup: nothing catches up
        while not (c := self._keeper.copies(ordinal)).in_sync and not (one_copy and c.backup is None):
            if cancelled():
                key = self._keeper.key_of(ordinal)
                raise AbortedError(f"scale stopped while {key[0]}[{key[1]}]'s new backup caught up: its caller went "
                                   "away; the moves before stand")
            if self._clock() > deadline:
                key = self._keeper.key_of(ordinal)
                raise DeadlineExceededError(f"scale: the new backup of {key[0]}[{key[1]}] did not catch up within "
                                            f"{self._catch_up} s; the moves before it stand")
            time.sleep(0.01)
