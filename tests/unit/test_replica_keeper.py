"""The replica keeper (coordinator/replica_keeper.py) over PS stubs that answer from memory: a restarted
coordinator goes on from the table the PS tasks hold; a new cluster starts from the initial placement."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from pscluster.coordinator import replicas as rp
from pscluster.coordinator.ps_book import PsBook
from pscluster.coordinator.replica_keeper import ReplicaKeeper
from pscluster.proto import pscluster_pb2 as pb

from pscluster.errors import FailedPreconditionError, UnavailableError
from pscluster.placement import SYNC_STATE_KEY


class Ps:
    """Status, ListShards, GetRoles and SetRoles of one PS task, as plain calls (rpc.call's shape)."""

    def __init__(self, index: int, shards: list[tuple[str, int]], table: pb.SetRolesRequest) -> None:
        self.index = index
        self.shards = shards
        self.table = table

    def Status(self, request: pb.PsStatusRequest, timeout: float) -> pb.PsStatus:  # noqa: N802 - the RPC name
        return pb.PsStatus(ps_index=self.index, num_shards=len(self.shards), roles_version=self.table.version)

    def ListShards(self, request: pb.ListShardsRequest, timeout: float) -> pb.ListShardsReply:  # noqa: N802
        return pb.ListShardsReply(shards=[pb.ShardInfo(spec=pb.ShardSpec(variable=v, shard_index=0, ordinal=o))
                                          for v, o in self.shards])

    def GetRoles(self, request: pb.GetRolesRequest, timeout: float) -> pb.SetRolesRequest:  # noqa: N802
        return self.table

    def SetRoles(self, request: pb.SetRolesRequest, timeout: float) -> pb.SetRolesReply:  # noqa: N802
        if request.version >= self.table.version:
            self.table = request
        return pb.SetRolesReply()


def role(variable: str, epoch: int, primary: int, backup: int, index: int = 0) -> pb.ShardRole:
    return pb.ShardRole(ref=pb.ShardRef(variable=variable, shard_index=index), epoch=epoch, primary=primary,
                        backup=backup)


def sent(keeper: ReplicaKeeper) -> None:
    """Wait for the round's table sends (they do not hold the round)."""
    deadline = time.monotonic() + 10
    while keeper._sending:
        assert time.monotonic() < deadline, "table sends still in flight"
        time.sleep(0.001)


def test_a_restarted_coordinator_goes_on_from_the_table_the_ps_tasks_hold() -> None:
    # shard a (ordinal 0) moved from ps 0 to ps 2; ps 0 holds nothing now
    # the sync state failed over from ps 0 to ps 1 too
    moved = pb.SetRolesRequest(version=7, roles=[role("a", 3, 2, 1), role("b", 1, 1, 2), role("c", 1, 2, 1),
                                                 role(SYNC_STATE_KEY[0], 2, 1, 2, SYNC_STATE_KEY[1])])
    older = pb.SetRolesRequest(version=5, roles=[role("a", 2, 0, 1)])
    stubs = [Ps(0, [], older), Ps(1, [("a", 0), ("b", 1), ("c", 2)], moved),
             Ps(2, [("a", 0), ("b", 1), ("c", 2)], moved)]
    keeper = ReplicaKeeper(stubs)
    try:
        keeper._round()
        sent(keeper)
        table = keeper.table()
        assert (table[("a", 0)].primary, table[("a", 0)].backup, table[("a", 0)].epoch) == (2, 1, 3)
        assert (table[SYNC_STATE_KEY].primary, table[SYNC_STATE_KEY].epoch) == (1, 2)
        assert all(0 not in (c.primary, c.backup) for c in table.values())
        assert SYNC_STATE_KEY not in {keeper.key_of(o) for o in keeper.layout()}  # elastic moves leave it alone
        assert keeper.state.version >= 7  # PS tasks ignore a table older than theirs
        assert all(p.table.version >= 7 and {r.ref.variable: r.primary for r in p.table.roles}["a"] == 2
                   for p in stubs)  # and every PS got it, ps 0 included
    finally:
        keeper.stop()


def test_a_new_cluster_starts_from_the_initial_striped_placement() -> None:
    empty = pb.SetRolesRequest()
    stubs = [Ps(0, [("a", 0)], empty), Ps(1, [], empty)]
    keeper = ReplicaKeeper(stubs)
    try:
        keeper._round()
        c = keeper.table()[("a", 0)]
        assert (c.primary, c.backup, c.epoch) == (0, 1, 1)
        s = keeper.table()[SYNC_STATE_KEY]  # the sync state's row: PS 0 holds it, PS 1 backs it up
        assert (s.primary, s.backup, s.epoch) == (0, 1, 1)
        assert any(r.ref.shard_index == -1 and r.primary == 0 for r in stubs[1].table.roles)
    finally:
        keeper.stop()


def test_one_copy_places_without_backups_and_waits_longer_before_a_slow_ps_counts_as_down() -> None:
    empty = pb.SetRolesRequest()
    stubs = [Ps(0, [("a", 0)], empty), Ps(1, [("b", 1)], empty)]
    keeper = ReplicaKeeper(stubs, copies=1)
    try:
        keeper._round()
        table = keeper.table()
        assert {key: (c.primary, c.backup) for key, c in table.items()} == \
            {("a", 0): (0, None), ("b", 0): (1, None), SYNC_STATE_KEY: (0, None)}
        assert keeper.state.missed == rp.ONE_COPY_MISSED_HEARTBEATS > ReplicaKeeper(stubs).state.missed
    finally:
        keeper.stop()


class Stopped(Ps):
    """A PS SIGSTOPped right after it answered Status: its SetRoles hangs until released."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.release = threading.Event()
        self.calls = 0

    def SetRoles(self, request: pb.SetRolesRequest, timeout: float) -> pb.SetRolesReply:  # noqa: N802
        self.calls += 1
        self.release.wait(timeout=10)
        return super().SetRoles(request, timeout)


def test_a_table_send_to_a_ps_that_stopped_answering_does_not_hold_the_next_round() -> None:
    empty = pb.SetRolesRequest()
    stopped = Stopped(0, [("a", 0)], empty)
    stubs = [stopped, Ps(1, [], empty)]
    keeper = ReplicaKeeper(stubs)
    try:
        started = time.monotonic()
        keeper._round()
        keeper._round()  # the keeper's next round (it finds failures) comes on time, not after the send's deadline
        assert time.monotonic() - started < 5
        deadline = time.monotonic() + 10
        while stopped.calls < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert stopped.calls == 1  # one send in flight per PS, not one more per round
        stopped.release.set()
        sent(keeper)
        assert stopped.table.version == keeper.state.version
    finally:
        stopped.release.set()
def test_a_ps_joins_the_list_gets_no_copy_before_a_scale_and_leaves_once_it_holds_nothing() -> None:
    empty = pb.SetRolesRequest()
    stubs = [Ps(0, [("a", 0)], empty), Ps(1, [], empty)]
    lists: list[list[str]] = []
    keeper = ReplicaKeeper(stubs, book=PsBook.from_file(["h:1", "h:2"]), on_book=lists.append,
                           connect=lambda address: Ps(2, [], empty))
    try:
        keeper._round()
        assert keeper.join("h:3") == 2 and keeper.join("h:3") == 2  # the same address: the same index
        assert lists == [["h:1", "h:2", "h:3"]] and len(keeper.stubs) == 3 and keeper.state.num_ps == 3
        keeper._round()
        sent(keeper)
        assert all(list(p.table.ps_addresses) == ["h:1", "h:2", "h:3"] and p.table.ps_epoch == 1 for p in keeper.stubs)
        assert keeper.state.inactive == {2} and keeper.table()[("a", 0)].backup == 1  # not active: no copy
        rp.decide(keeper.state, rp.ConnectionLost(1))  # no active PS left for a backup: the joined one, not none
        assert keeper.table()[("a", 0)].backup == 2
        # the sync state's row too: a leave is refused while the PS holds any copy of it (a scale moves the
        # row first: elastic.py)
        assert keeper.table()[SYNC_STATE_KEY].backup == 2
        with pytest.raises(FailedPreconditionError, match="still holds 2 shard copies"):
            keeper.leave(2)
        keeper.state.shards[rp.SYNC_ORDINAL] = rp.Copies(2, 0, 9)
        with pytest.raises(FailedPreconditionError, match="primary of the sync state"):
            keeper.leave(2)
        keeper.state.shards[0] = rp.Copies(0, 1, 10)
        keeper.state.shards[rp.SYNC_ORDINAL] = rp.Copies(0, 1, 10)
        with pytest.raises(FailedPreconditionError, match="listed in the cluster file"):
            keeper.leave(1)
        keeper.leave(2)
        assert lists[-1] == ["h:1", "h:2"] and len(keeper.stubs) == 2 and 2 not in keeper.state.ps
        keeper._round()
        sent(keeper)
        assert all(list(p.table.ps_addresses) == ["h:1", "h:2"] and p.table.ps_epoch == 2 for p in stubs)
    finally:
        keeper.stop()


def test_a_restarted_coordinator_takes_the_ps_list_with_the_table() -> None:
    held = pb.SetRolesRequest(version=4, roles=[role("a", 2, 2, 0)], ps_addresses=["h:1", "h:2", "h:3"], ps_epoch=1)
    joined = Ps(2, [("a", 0)], held)
    stubs = [Ps(0, [("a", 0)], held), Ps(1, [], held)]
    lists: list[list[str]] = []
    keeper = ReplicaKeeper(stubs, book=PsBook.from_file(["h:1", "h:2"]), on_book=lists.append,
                           connect=lambda address: joined)
    try:
        keeper._round()
        assert lists == [["h:1", "h:2", "h:3"]] and keeper.stubs[2] is joined and keeper.state.num_ps == 3
        keeper._round()
        c = keeper.table()[("a", 0)]
        assert (c.primary, c.backup, c.epoch) == (2, 0, 2)
    finally:
        keeper.stop()


def test_a_shard_created_on_a_ps_of_a_grown_list_keeps_its_primary_there() -> None:
    empty = pb.SetRolesRequest()
    stubs = [Ps(0, [], empty), Ps(1, [("a", 0)], empty)]  # a client placed ordinal 0 on ps 1 (P it knew)
    keeper = ReplicaKeeper(stubs)
    try:
        keeper._round()
        c = keeper.table()[("a", 0)]
        assert (c.primary, c.backup) == (1, 0)
    finally:
        keeper.stop()


class Flaky(Ps):
    """A PS that can stop answering (down) and come back as the same process or a restarted one."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.down = False
        self.incarnation = 1

    def Status(self, request: pb.PsStatusRequest, timeout: float) -> pb.PsStatus:  # noqa: N802 - the RPC name
        if self.down:
            raise UnavailableError(f"ps {self.index} is down (the test)")
        status = super().Status(request, timeout)
        status.incarnation = self.incarnation
        return status


@pytest.mark.parametrize("restarted", [False, True])
def test_a_shard_back_on_a_ps_counts_as_lost_only_when_that_ps_restarted(restarted: bool) -> None:
    # both copies of shard a go down: the backup, then the primary. The primary answering again as the same
    # process (it only missed heartbeats, as under load) kept its copy whole; a restarted one read a checkpoint
    empty = pb.SetRolesRequest()
    stubs = [Flaky(0, [("a", 0)], empty), Flaky(1, [], empty)]
    told: list[tuple[int, int, tuple[str, int], bool]] = []  # (ps, incarnation, shard, ps 0 held the new table)
    keeper = ReplicaKeeper(stubs, on_restored=lambda ps, inc, key: told.append(
        (ps, inc, key, stubs[0].table.version >= keeper.state.version)))
    try:
        keeper._round()
        stubs[1].down = True
        keeper._round()
        assert keeper.table()[("a", 0)].backup is None
        stubs[0].down = True
        keeper._round()
        assert keeper.table()[("a", 0)].lost  # both copies gone
        stubs[0].down = False
        stubs[0].incarnation = 2 if restarted else 1
        keeper._round()
        assert keeper.table()[("a", 0)].primary == 0 and not keeper.table()[("a", 0)].lost
        assert keeper.lost_shards(0, stubs[0].incarnation) == ({("a", 0), SYNC_STATE_KEY} if restarted else set())
        assert keeper.lost_shards(0, 1 if restarted else 2) == set()  # another restart says nothing of it
        # the PS monitor hears of it before the restarted PS holds the table that lets it take the shard's pushes
        assert sorted(told) == ([(0, 2, ("a", 0), False), (0, 2, SYNC_STATE_KEY, False)] if restarted else [])
        sent(keeper)
    finally:
        keeper.stop()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Late(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "Deadline Exceeded"


class Slow(Ps):
    """A Status call that ends by its deadline after `takes` seconds of the keeper's clock: `answers` False, it
    times out (a SIGSTOPped PS, or a coordinator too starved to read the answer in time)."""

    def __init__(self, clock: _Clock, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.clock, self.takes, self.answers = clock, 0.0, True

    def Status(self, request: pb.PsStatusRequest, timeout: float) -> pb.PsStatus:  # noqa: N802
        self.clock.now += self.takes
        if not self.answers:
            raise _Late()
        return super().Status(request, timeout)


@pytest.mark.parametrize("starved", [True, False], ids=["starved-coordinator", "stopped-ps"])
def test_a_heartbeat_counts_as_missed_only_past_the_coordinators_own_scheduling_delay(starved: bool) -> None:
    """Under load 10+ on 2 cores a starved coordinator saw a live PS's Status call time out on its own clock (the
    answer came, the keeper thread did not run) and failed the PS's shards over. A round the keeper ran late
    (started late, or its calls came back past their deadline) now judges no PS by time; a PS that does not
    answer while the keeper runs on time (SIGSTOP) is marked down in the same round as before."""
    clock = _Clock()
    empty = pb.SetRolesRequest()
    slow = Slow(clock, 1, [("b", 1)], empty)
    keeper = ReplicaKeeper([Ps(0, [("a", 0)], empty), slow], clock=clock)
    try:
        keeper._round()  # both answer at 100.0
        clock.now += 0.1
        slow.answers = False
        slow.takes = 0.55 if starved else 0.25  # starved: the calls came back 0.3 s past their 0.25 s deadline
        keeper._round()
        assert keeper.state.ps[1].up == starved
        assert keeper.marked_down == (0 if starved else 1)
        if starved:
            slow.takes = 0.25  # the next round runs on time: a PS still silent is down now
            keeper._round()
            assert not keeper.state.ps[1].up and keeper.marked_down == 1
    finally:
        keeper.stop()


def test_each_round_tells_the_sync_rows_epoch_and_what_its_primarys_backup_confirmed() -> None:
    empty = pb.SetRolesRequest()
    stubs = [Flaky(0, [("a", 0)], empty), Flaky(1, [], empty)]
    told: list[tuple[int, tuple[int, int]]] = []
    confirmed = pb.PsStatus(sync_confirmed_epoch=1, sync_confirmed_version=9)
    ps0_status = stubs[0].Status

    def status(request: pb.PsStatusRequest, timeout: float) -> pb.PsStatus:
        answer = ps0_status(request, timeout)
        answer.MergeFrom(confirmed)
        return answer

    stubs[0].Status = status  # type: ignore[method-assign]
    keeper = ReplicaKeeper(stubs, on_sync_row=lambda epoch, pair: told.append((epoch, pair)))
    try:
        keeper._round()
        assert told[-1] == (1, (1, 9))  # PS 0 holds the row at epoch 1; its backup confirmed version 9
        sent(keeper)
        keeper._round()  # PS 0 holds the table: its backup counts as in sync
        stubs[0].down = True
        keeper._round()  # PS 0 is gone: PS 1 is promoted at a new epoch and has confirmed nothing as primary yet
        assert keeper.table()[SYNC_STATE_KEY].primary == 1
        assert told[-1] == (2, (0, 0))
        sent(keeper)
    finally:
        keeper.stop()
