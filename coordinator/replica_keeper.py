"""Runs the replica table (replicas.py) against the live PS tasks: the executor of `replicas.decide`.

The `replica-keeper` thread asks every PS for its status each HEARTBEAT_INTERVAL_S (100 ms), in parallel:
an answer is a heartbeat (or, from a PS marked down, a rejoin: it restarted from the newest checkpoint),
a refused connection marks it down at once, a slow answer counts as a missed heartbeat. It learns new
shards from the PS listings (when a PS's shard count changes), sees a new backup's catch-up finish in its
primary's status, and sends the whole table to every PS that answers after each change (and to any PS
whose table is older, such as one that just restarted). Clients find a shard's primary with GetRoles on
any live PS (pscluster/client/routes.py).

What `lost_updates()` must count with replicas: 2 is only what a shard lost when both its copies died and
it came back from a checkpoint: `lost_shards(ps)` names those shards for the PS monitor's accounting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pscluster.coordinator import replicas as rp
from pscluster.coordinator.ps_book import PsBook
from pscluster.proto import pscluster_pb2 as pb

from pscluster.errors import FailedPreconditionError, PsclusterError, UnavailableError
from pscluster.net import rpc
from pscluster.placement import SYNC_STATE_KEY

log = logging.getLogger(__name__)

Key = tuple[str, int]


class ReplicaKeeper:
    """Owns the replica table and the `replica-keeper` thread; `stop()` ends and joins it."""

    def __init__(self, stubs: list[object], interval: float = rp.HEARTBEAT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, book: PsBook | None = None,
                 connect: Callable[[str], object] | None = None,
                 on_book: Callable[[list[str]], None] | None = None, copies: int = 2,
                 on_restored: Callable[[int, int, Key], None] | None = None,
                 on_sync_row: Callable[[int, tuple[int, int]], None] | None = None) -> None:
        """book: the PS list (ps_book.py; None: unnamed PS tasks, no joins); connect: a stub for a joining PS's
        address; on_book: told the new list after a PS joined or left (outside the lock); copies: 1 gives no
        shard a backup but for a move (replicas: 1, elastic); on_restored(ps, incarnation, shard): a shard whose copies
        both died came back from a checkpoint on that restart of ps (called outside the lock, before the table that
        lets ps take the shard's pushes is sent); on_sync_row(epoch, confirmed): after each round, the sync state's row
        epoch and the (epoch, version) of the state its primary's backup confirmed (coordinator/sync_reports.py)."""
        self._stubs = stubs  # grows and shrinks with the book: elastic.py holds the same list
        self.book = book or PsBook.from_file([""] * len(stubs))
        self._connect = connect
        self._on_book = on_book
        self._on_restored = on_restored
        self._on_sync_row = on_sync_row
        self._clock = clock
        self._interval = interval
        missed = rp.MISSED_HEARTBEATS if copies > 1 else rp.ONE_COPY_MISSED_HEARTBEATS  # see replicas.py
        self.state = rp.ReplicaState(len(stubs), now=clock(), interval=interval, missed=missed, copies=copies)
        self._keys: dict[int, Key] = {rp.SYNC_ORDINAL: SYNC_STATE_KEY}  # ordinal -> shard key (and the sync state)
        self._shard_counts: dict[int, int] = {}
        self._sent: dict[int, int] = {}  # the table version each PS acknowledged
        # (ps, incarnation) -> shards that restart of the PS brought back from a checkpoint
        self._lost: dict[tuple[int, int], set[Key]] = {}
        self._incarnations: dict[int, int] = {}  # the incarnation each PS answered with last
        self.marked_down = 0  # PS tasks marked down so far (each one logged with why: B15FALSEDOWN counts them)
        # the table the PS tasks hold when this keeper starts (a restarted coordinator goes on from it, not
        # from the initial placement: failovers and elastic moves changed it); None until asked
        self._adopted: dict[Key, pb.ShardRole] | None = None
        self._lock = threading.Lock()  # state, for readers on other threads (never held across an RPC)
        # a round's Status calls, plus one table send per PS in flight (it may take its whole deadline)
        self._pool = ThreadPoolExecutor(max(4, 2 * len(stubs)), thread_name_prefix="replica-keeper-rpc")
        self._sending: set[int] = set()  # PS tasks a round's table send is in flight to
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="replica-keeper", daemon=True)

    def start(self) -> ReplicaKeeper:
        """Start watching (the first round sends the table at once)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and join it."""
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=True)

    @property
    def stubs(self) -> list[object]:
        """The stub of every PS task of the list (the same list object as it grows: elastic.py shares it)."""
        return self._stubs

    def lost_shards(self, ps: int, incarnation: int) -> set[Key]:
        """Shards that PS ps, restarted as `incarnation`, brought back from a checkpoint (both copies had died)."""
        with self._lock:
            return set(self._lost.get((ps, incarnation), set()))

    def table(self) -> dict[Key, rp.Copies]:
        """Shard key -> where it lives now."""
        with self._lock:
            return {self._keys[o]: c for o, c in self.state.shards.items() if o in self._keys}

    def layout(self) -> dict[int, rp.Copies]:
        """Shard ordinal -> where it lives now (the shards whose key the keeper learned; not the sync state,
        which elastic moves leave where failovers put it)."""
        with self._lock:
            return {o: c for o, c in self.state.shards.items() if o in self._keys and o != rp.SYNC_ORDINAL}

    def copies(self, ordinal: int) -> rp.Copies:
        """Where shard `ordinal` (or the sync state's row, SYNC_ORDINAL) lives now."""
        with self._lock:
            return self.state.shards[ordinal]

    def sync_row(self) -> rp.Copies | None:
        """Where the sync state's row lives now (None before the keeper placed it)."""
        with self._lock:
            return self.state.shards.get(rp.SYNC_ORDINAL)

    def key_of(self, ordinal: int) -> Key:
        """The (variable, shard index) of a shard ordinal."""
        with self._lock:
            return self._keys[ordinal]

    def set_inactive(self, inactive: set[int]) -> None:
        """PS tasks that get no new copies (a scale drained them: coordinator/elastic.py)."""
        with self._lock:
            self.state.inactive = set(inactive)

    def reassign(self, ordinal: int, primary: int, backup: int | None, epoch: int,
                 primary_took: Callable[[], None] | None = None) -> rp.Copies:
        """An elastic move's step: give the shard, read at `epoch`, new holders at a new epoch and send the
        table to every PS now, `primary` first (it starts admitting pushes when it has it: then `primary_took`
        is called).

        Raises:
            UnavailableError: the table refused the change (a holder is down, the shard lost both copies, its
                epoch moved on, or a new primary is not its in-sync backup).
            PsclusterError: the new primary did not take the table (the keeper's rounds send it again).
        """
        with self._lock:
            actions = rp.decide(self.state, rp.Reassign(ordinal, primary, backup, epoch))
            if not actions:
                raise UnavailableError(f"shard {self._keys.get(ordinal, ordinal)} cannot move to primary ps {primary}, "
                                       f"backup {backup} from epoch {epoch}: a holder is down, the shard lost both "
                                       f"copies, its epoch moved on, or ps {primary} is not its in-sync backup")
            for action in actions:
                self._note(action)
            copies = self.state.shards[ordinal]
            version = self.state.version
            request = self._table_request()
        rpc.call(self._stubs[primary].SetRoles, request, timeout=1.0)  # type: ignore[attr-defined]
        if primary_took is not None:
            primary_took()
        with self._lock:
            self._sent[primary] = max(self._sent.get(primary, -1), version)
            others = [ps for ps in self.state.up() if ps != primary]
        self._send(others, request, version)
        return copies

    def join(self, address: str) -> int:
        """A PS the cluster file does not list joins the PS list (JoinPs); its task index. It holds nothing
        until a scale adds it (elastic.py); the next rounds send it, and every PS, the table.

        Raises:
            InvalidArgumentError: not a host:port address.
            FailedPreconditionError: this keeper cannot open channels (no connect).
        """
        if self._connect is None:
            raise FailedPreconditionError("this coordinator cannot add PS tasks (no channel factory)")
        with self._lock:
            index, added = self.book.join(address)
            if added:
                self._stubs.append(self._connect(address))
                self.state.ps[index] = rp.PsRec(last_seen=self._clock())  # counts as seen: it is starting
                self.state.inactive.add(index)  # no copy (not even a failover's backup) before a scale adds it
                self.state.num_ps = len(self._stubs)
                self.state.version += 1
            addresses = list(self.book.addresses)
        if added:
            log.info("ps list epoch %d: ps %d joined at %s", self.book.epoch, index, address)
            if self._on_book is not None:
                self._on_book(addresses)
        return index

    def leave(self, index: int) -> None:
        """The last PS task, which joined and was drained, leaves the PS list (ps_book.py's rules).

        Raises:
            InvalidArgumentError, FailedPreconditionError: see PsBook.check_leave; or it still holds a copy.
        """
        with self._lock:
            self.book.check_leave(index)
            held = sorted(self._keys.get(o, o) for o, c in self.state.shards.items()
                          if index in (c.primary, c.backup) and not c.lost)
            row = self.state.shards.get(rp.SYNC_ORDINAL)
            if row is not None and row.primary == index and not row.lost:
                raise FailedPreconditionError(f"ps {index} is the primary of the sync state (the token queue, "
                                              f"{SYNC_STATE_KEY}): drain it first (remove_ps moves the queue)")
            if held:
                raise FailedPreconditionError(f"ps {index} still holds {len(held)} shard copies (e.g. {held[0]}): "
                                              "drain it first (remove_ps)")
            self.book.leave(index)
            self._stubs.pop()
            self.state.ps.pop(index, None)
            self.state.inactive.discard(index)
            self.state.num_ps = len(self._stubs)
            self.state.version += 1
            for book in (self._sent, self._shard_counts, self._incarnations):
                book.pop(index, None)
            for restart in [r for r in self._lost if r[0] == index]:
                del self._lost[restart]
            addresses = list(self.book.addresses)
        log.info("ps list epoch %d: ps %d left", self.book.epoch, index)
        if self._on_book is not None:
            self._on_book(addresses)

    def _table_request(self) -> pb.SetRolesRequest:
        """The whole table as SetRoles sends it, with the PS list when it is known (under self._lock)."""
        named = all(self.book.addresses)
        return pb.SetRolesRequest(version=self.state.version, ps_addresses=self.book.addresses if named else [],
                                  ps_epoch=self.book.epoch, drained=sorted(self.state.inactive), roles=[
            pb.ShardRole(ref=pb.ShardRef(variable=self._keys[o][0], shard_index=self._keys[o][1]), epoch=c.epoch,
                         primary=c.primary, backup=-1 if c.backup is None else c.backup)
            for o, c in sorted(self.state.shards.items()) if o in self._keys and not c.lost])

    def _loop(self) -> None:
        planned = self._clock()  # when this round should start: its lateness is the coordinator's own delay
        while not self._stop.is_set():
            started = self._clock()
            try:
                self._round(max(0.0, started - planned))
            except Exception as exc:
                log.warning("replica-keeper: round failed: %s", exc, exc_info=True)
            ended = self._clock()
            planned = max(started + self._interval, ended)
            self._stop.wait(max(0.0, planned - ended))

    @property
    def _status_timeout(self) -> float:
        return max(0.25, 2.5 * self._interval)

    def _status(self, ps: int) -> pb.PsStatus | PsclusterError:
        try:
            status: pb.PsStatus = rpc.call(self._stubs[ps].Status, pb.PsStatusRequest(),  # type: ignore[attr-defined]
                                           timeout=self._status_timeout)
            return status
        except PsclusterError as exc:
            return exc

    def _round(self, late: float = 0.0) -> None:
        """One round of heartbeats; late: how far past its planned start the keeper thread ran it."""
        asked = self._clock()
        answers = list(self._pool.map(self._status, range(len(self._stubs))))
        now = self._clock()
        actions: list[rp.ReplicaAction] = []
        rejoined: dict[int, int | None] = {}  # PS back up this round -> its new incarnation (None: no restart)
        with self._lock:
            state = self.state
            seen = {ps: (rec.up, rec.last_seen) for ps, rec in state.ps.items()}
            for ps, answer in enumerate(answers):
                rec = state.ps.get(ps)  # None: it left the PS list since the round asked
                if isinstance(answer, pb.PsStatus):
                    before = self._incarnations.get(ps)
                    self._incarnations[ps] = answer.incarnation
                if rec is not None and isinstance(answer, pb.PsStatus):
                    if not rec.up:
                        self._sent.pop(ps, None)
                        # marked down without a restart (missed heartbeats under load): its copies are whole
                        rejoined[ps] = None if before == answer.incarnation else answer.incarnation
                        actions += rp.decide(state, rp.Rejoined(ps, now, restarted=rejoined[ps] is not None))
                    else:
                        rp.decide(state, rp.Heartbeat(ps, now))
                elif rec is not None and isinstance(answer, UnavailableError):
                    actions += rp.decide(state, rp.ConnectionLost(ps))
            # a round the keeper itself ran late judges no PS by time (a starved keeper saw live PS tasks'
            # Status calls time out on its own clock, and failed their shards over)
            slack = rp.own_delay(late, asked, now, self._status_timeout)
            actions += rp.decide(state, rp.Tick(now, slack))
            down = [ps for ps, (up, _) in seen.items() if up and ps in state.ps and not state.ps[ps].up]
            self.marked_down += len(down)
        for ps in down:
            why = answers[ps] if ps < len(answers) and isinstance(answers[ps], PsclusterError) else "no answer"
            log.warning("replica-keeper: ps %d marked down: %s; last answer %.0f ms before this round's end, whose "
                        "Status calls took %.0f ms", ps, why, 1000 * (now - seen[ps][1]), 1000 * (now - asked))
        if self._adopted is None:
            self._adopt(answers)
        if self._adopted is not None:  # a shard's placement comes from the PS tasks' table first
            self._learn_shards(answers)
        with self._lock:
            for ps, answer in enumerate(answers):
                if not isinstance(answer, pb.PsStatus) or answer.roles_version < self.state.version:
                    continue
                pending = {(r.variable, r.shard_index) for r in answer.catching_up}
                for ordinal, c in list(self.state.shards.items()):
                    key = self._keys.get(ordinal)
                    if c.primary == ps and c.backup is not None and not c.in_sync and key not in pending:
                        actions += rp.decide(self.state, rp.CaughtUp(ordinal, c.epoch))
            restored = [r for r in (self._note(action, rejoined) for action in actions) if r is not None]
        if self._on_restored is not None:
            for ps, incarnation, key in restored:
                self._on_restored(ps, incarnation, key)
        self._send_table(answers)
        if self._on_sync_row is not None:
            self._tell_sync_row(answers)

    def _tell_sync_row(self, answers: list[pb.PsStatus | PsclusterError]) -> None:
        assert self._on_sync_row is not None
        with self._lock:
            row = self.state.shards.get(rp.SYNC_ORDINAL)
        if row is None:
            return
        answer = answers[row.primary] if row.primary < len(answers) else None
        confirmed = (answer.sync_confirmed_epoch, answer.sync_confirmed_version) \
            if isinstance(answer, pb.PsStatus) else (0, 0)
        self._on_sync_row(row.epoch, confirmed)

    def _note(self, action: rp.ReplicaAction,
              rejoined: dict[int, int | None] | None = None) -> tuple[int, int, Key] | None:
        """Log an action; rejoined: the round's PS tasks back up, with their new incarnation (None: no restart).
        Returns (ps, incarnation, shard) for a shard that came back from a checkpoint."""
        key = self._keys.get(action.ordinal) if not isinstance(action, rp.Publish) else None
        if isinstance(action, rp.Lost):
            log.warning("replica table: both copies of %s are gone; it waits for a checkpoint restore", key)
        elif isinstance(action, rp.Restored) and key is not None:
            incarnation = (rejoined or {}).get(action.ps)
            if incarnation is None:
                log.warning("replica table: %s is back on ps %d (epoch %d), which did not restart: its copy is whole",
                            key, action.ps, action.epoch)
            else:
                self._lost.setdefault((action.ps, incarnation), set()).add(key)
                log.warning("replica table: %s came back from a checkpoint on ps %d (epoch %d)", key, action.ps,
                            action.epoch)
                return action.ps, incarnation, key
        elif isinstance(action, rp.Assign) and key is not None:
            c = action.copies
            log.info("replica table: %s primary ps %d, backup %s, epoch %d", key, c.primary,
                     "none" if c.backup is None else f"ps {c.backup}", c.epoch)
        return None

    def _adopt(self, answers: list[pb.PsStatus | PsclusterError]) -> None:
        """Take the newest table a PS holds (a coordinator restart); nothing to take on a new cluster."""
        held = [(a.roles_version, ps) for ps, a in enumerate(answers) if isinstance(a, pb.PsStatus) and a.roles_version]
        if not held:
            self._adopted = {}
            return
        _, ps = max(held)
        try:
            table = rpc.call(self._stubs[ps].GetRoles, pb.GetRolesRequest(), timeout=1.0)  # type: ignore[attr-defined]
        except PsclusterError:
            return  # the next round asks again
        with self._lock:
            self.state.version = max(self.state.version, table.version)  # PS tasks ignore older tables
            self._adopted = {(r.ref.variable, r.ref.shard_index): r for r in table.roles}
            grown = self._connect is not None and self.book.adopt(table.ps_addresses, table.ps_epoch)
            if grown:  # PS tasks joined before this coordinator started
                assert self._connect is not None
                del self._stubs[len(self.book.addresses):]
                self._stubs.extend(self._connect(a) for a in self.book.addresses[len(self._stubs):])
                for index in range(len(self._stubs)):
                    self.state.ps.setdefault(index, rp.PsRec(last_seen=self._clock()))
                self.state.num_ps = len(self._stubs)
            addresses = list(self.book.addresses)
        if grown and self._on_book is not None:
            self._on_book(addresses)
        log.info("replica table: went on from version %d held by ps %d (%d shards)", table.version, ps,
                 len(table.roles))

    def _learn_shards(self, answers: list[pb.PsStatus | PsclusterError]) -> None:
        with self._lock:
            if rp.SYNC_ORDINAL not in self.state.shards:  # the sync state's row: as the PS tasks hold it, or new
                self._place(rp.SYNC_ORDINAL, None)
        changed = [ps for ps, a in enumerate(answers)
                   if isinstance(a, pb.PsStatus) and self._shard_counts.get(ps) != a.num_shards]
        for ps in changed:
            try:
                reply = rpc.call(self._stubs[ps].ListShards, pb.ListShardsRequest(),  # type: ignore[attr-defined]
                                 timeout=1.0)
            except PsclusterError:
                continue
            answer = answers[ps]
            assert isinstance(answer, pb.PsStatus)
            self._shard_counts[ps] = answer.num_shards
            with self._lock:
                for info in reply.shards:
                    ordinal = info.spec.ordinal
                    if ordinal not in self._keys:
                        self._keys[ordinal] = (info.spec.variable, info.spec.shard_index)
                    if ordinal not in self.state.shards:  # on the PS its client placed it (k mod its P)
                        self._place(ordinal, ps)

    def _place(self, ordinal: int, ps: int | None) -> None:
        """A shard new to this keeper (under self._lock): where the PS tasks' table has it, or its first place
        (on PS ps; None: the rule's, for the sync state's row)."""
        role = (self._adopted or {}).get(self._keys[ordinal])
        if role is not None:
            # in sync once its primary says so (the next round), as after any assignment
            self.state.shards[ordinal] = rp.Copies(role.primary, role.backup if role.backup >= 0 else None, role.epoch)
        else:
            for action in rp.decide(self.state, rp.ShardCreated(ordinal, ps)):
                self._note(action)

    def _send_table(self, answers: list[pb.PsStatus | PsclusterError]) -> None:
        """Send the table to the PS tasks that lack it, without waiting: a PS SIGSTOPped after its Status
        answer would hold the next round (and the promotion it finds) for the send's whole deadline."""
        with self._lock:
            version = self.state.version
            request = self._table_request()
            targets = [ps for ps, a in enumerate(answers) if isinstance(a, pb.PsStatus) and ps in self.state.ps
                       and self.state.ps[ps].up and (a.roles_version < version or self._sent.get(ps, -1) < version)
                       and ps not in self._sending]  # one send per PS at a time; the next round sends the newest
            self._sending.update(targets)
        for ps in targets:
            self._pool.submit(self._send_one, ps, request, version)

    def _send_one(self, ps: int, request: pb.SetRolesRequest, version: int) -> None:
        try:
            stub = self._stubs[ps]
        except IndexError:  # it left the PS list since the round chose it
            with self._lock:
                self._sending.discard(ps)
            return
        try:
            rpc.call(stub.SetRoles, request, timeout=1.0)  # type: ignore[attr-defined]
        except PsclusterError as exc:
            log.warning("replica table: ps %d did not take version %d: %s", ps, version, exc)
            return
        else:
            with self._lock:
                self._sent[ps] = max(self._sent.get(ps, -1), version)
        finally:
            with self._lock:
                self._sending.discard(ps)

    def _send(self, targets: list[int], request: pb.SetRolesRequest, version: int) -> None:
        """Send the table to targets and wait (an elastic move's step)."""
        list(self._pool.map(lambda ps: self._send_one(ps, request, version), targets))
