"""The scale executor (coordinator/elastic.py) against a replica table that catches up at once and PS stubs
that record freezes: the order of a move's steps, and refusals that change nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from pscluster.coordinator import replicas as rp
from pscluster.coordinator.elastic import Elastic
from pscluster.coordinator.ps_book import PsBook
from pscluster.proto import pscluster_pb2 as pb

from pscluster.errors import AbortedError, FailedPreconditionError, InvalidArgumentError, UnavailableError


class Keeper:
    """replica_keeper.ReplicaKeeper's surface over the pure table; every new backup catches up at once."""

    def __init__(self, num_ps: int, shards: int, log: list[tuple], copies: int = 2) -> None:
        self.state = rp.ReplicaState(num_ps, copies=copies)
        self.book = PsBook.from_file([f"h:{i}" for i in range(num_ps)])
        self.log = log
        for k in range(shards):
            rp.decide(self.state, rp.ShardCreated(k))
            rp.decide(self.state, rp.CaughtUp(k, 1))

    def layout(self) -> dict[int, rp.Copies]:
        return {o: c for o, c in self.state.shards.items() if o != rp.SYNC_ORDINAL}

    def copies(self, ordinal: int) -> rp.Copies:
        return self.state.shards[ordinal]

    def sync_row(self) -> rp.Copies | None:
        return self.state.shards.get(rp.SYNC_ORDINAL)

    def key_of(self, ordinal: int) -> tuple[str, int]:
        return (f"v{ordinal}", 0)

    def set_inactive(self, inactive: set[int]) -> None:
        self.state.inactive = set(inactive)

    def reassign(self, ordinal: int, primary: int, backup: int | None, epoch: int,
                 primary_took: Callable[[], None] | None = None) -> rp.Copies:
        if not rp.decide(self.state, rp.Reassign(ordinal, primary, backup, epoch)):
            raise UnavailableError("a holder is down")
        self.log.append(("table", ordinal, primary, backup))
        if primary_took is not None:
            primary_took()
        c = self.state.shards[ordinal]
        rp.decide(self.state, rp.CaughtUp(ordinal, c.epoch))
        return c


class Stub:
    """A PS's FreezeShard: records freezes and thaws; `fail` refuses them, `hold` blocks one."""

    def __init__(self, ps: int, log: list[tuple]) -> None:
        self.ps = ps
        self.log = log
        self.fail = False
        self.hold: threading.Event | None = None
        self.entered = threading.Event()

    def FreezeShard(self, request: pb.FreezeRequest, timeout: float) -> pb.FreezeReply:  # noqa: N802 - the RPC name
        if request.thaw:
            self.log.append(("drop" if request.drop else "thaw", self.ps, request.ref.variable))
            return pb.FreezeReply(dropped=request.drop)
        if self.fail:
            raise UnavailableError(f"ps {self.ps} is not the primary")
        self.entered.set()
        if self.hold is not None:
            self.hold.wait(5)
        self.log.append(("freeze", self.ps, request.ref.variable, request.successor))
        return pb.FreezeReply(version=1)


def make(num_ps: int = 3, shards: int = 6, copies: int = 2) -> tuple[Elastic, Keeper, list[Stub], list[tuple]]:
    log: list[tuple] = []
    keeper = Keeper(num_ps, shards, log, copies)
    stubs = [Stub(i, log) for i in range(num_ps)]
    return Elastic(keeper, stubs, catch_up_s=1.0), keeper, stubs, log  # type: ignore[arg-type]


def test_draining_a_ps_freezes_each_of_its_primaries_switches_to_the_successor_then_thaws() -> None:
    elastic, keeper, _, log = make()
    start = keeper.layout()
    moved_primaries = {o for o, c in start.items() if c.primary == 2}
    report = elastic.remove(2)
    assert report.active == [0, 1] and len(report.freezes_s) == len(moved_primaries) == 2
    assert all(2 not in (c.primary, c.backup) for c in keeper.layout().values())
    for o in moved_primaries:
        freeze = next(i for i, e in enumerate(log) if e[:3] == ("freeze", 2, f"v{o}"))
        successor = log[freeze][3]
        switch = next(i for i, e in enumerate(log) if e[:3] == ("table", o, successor) and i > freeze)
        thaw = log.index(("thaw", 2, f"v{o}"))
        assert freeze < switch < thaw
        before = [e for e in log[:freeze] if e[0] == "table" and e[1] == o]
        assert not before or before[-1][3] == successor  # the successor was made the backup first
    assert keeper.state.inactive == {2}
    dropped = {(e[1], e[2]) for e in log if e[0] == "drop"}
    assert {(2, f"v{o}") for o, c in start.items() if 2 in (c.primary, c.backup)} <= dropped  # PS 2 keeps nothing
    assert all(ps not in (keeper.layout()[int(v[1:])].primary, keeper.layout()[int(v[1:])].backup)
               for ps, v in dropped)  # and only copies the table no longer names are dropped


def test_adding_the_drained_ps_back_gives_it_its_share() -> None:
    elastic, keeper, _, _ = make()
    elastic.remove(2)
    report = elastic.add(2)
    assert report.active == [0, 1, 2] and len(report.freezes_s) == 2
    assert sum(1 for c in keeper.layout().values() if c.primary == 2) == 2
    assert keeper.state.inactive == set()


@pytest.mark.parametrize("call,error,match", [
    (lambda e: e.remove(5), InvalidArgumentError, "unknown PS task 5: this cluster has PS tasks 0..2"),
    (lambda e: e.add(1), FailedPreconditionError, "ps 1 is active already"),
    (lambda e: e.scale_to(1), InvalidArgumentError, "at least 2 active"),
    (lambda e: e.scale_to(4), InvalidArgumentError,
     r"only 3 PS tasks \(0..2\) are in the list; start another with `pscluster ps --join --port P` first"),
    (lambda e: e.scale([0, 0]), InvalidArgumentError, "names a PS twice"),
])
def test_bad_input_is_refused_and_changes_nothing(call, error, match) -> None:
    elastic, keeper, _, log = make()
    before = keeper.layout()
    with pytest.raises(error, match=match):
        call(elastic)
    assert keeper.layout() == before and log == [] and elastic.active == [0, 1, 2]


def test_removing_a_drained_ps_again_is_refused() -> None:
    elastic, _, _, _ = make()
    elastic.remove(2)
    with pytest.raises(FailedPreconditionError, match="ps 2 is not active"):
        elastic.remove(2)


def test_a_scale_while_one_runs_is_refused() -> None:
    elastic, keeper, stubs, _ = make()
    stubs[2].hold = threading.Event()
    first = threading.Thread(target=elastic.remove, args=(2,))
    first.start()
    assert stubs[2].entered.wait(5)
    with pytest.raises(FailedPreconditionError, match="a scale is under way"):
        elastic.scale_to(3)
    stubs[2].hold.set()
    first.join(5)
    assert elastic.active == [0, 1]


def test_a_shard_that_lost_both_copies_stops_the_scale_before_anything_moves() -> None:
    elastic, keeper, _, log = make()
    keeper.state.shards[0] = rp.Copies(0, 1, 9, lost=True)  # both its holders died: waits for a restore
    with pytest.raises(FailedPreconditionError, match="lost both copies"):
        elastic.remove(2)
    assert log == []


def test_a_refused_freeze_leaves_the_primary_where_it_was() -> None:
    elastic, keeper, stubs, _ = make()
    stubs[2].fail = True
    with pytest.raises(UnavailableError):
        elastic.remove(2)
    assert any(c.primary == 2 for c in keeper.layout().values())


def test_a_successor_that_died_during_the_freeze_is_not_made_primary_and_the_old_one_thaws() -> None:
    elastic, keeper, stubs, log = make()
    real = stubs[2].FreezeShard

    def freeze_then_lose_successor(request: pb.FreezeRequest, timeout: float) -> pb.FreezeReply:
        reply = real(request, timeout)
        if not request.thaw:
            rp.decide(keeper.state, rp.ConnectionLost(request.successor))
        return reply

    stubs[2].FreezeShard = freeze_then_lose_successor  # type: ignore[method-assign]
    with pytest.raises(UnavailableError, match="a holder is down"):
        elastic.remove(2)
    frozen = next(e[2] for e in log if e[0] == "freeze")
    assert log[-1] == ("thaw", 2, frozen) and ("drop", 2, frozen) not in log  # it still holds the shard
    assert all(keeper.state.ps[c.primary].up for c in keeper.layout().values() if not c.lost)


def test_a_failed_move_gives_back_the_drained_ps_its_place_for_new_backups() -> None:
    elastic, keeper, stubs, _ = make()
    stubs[2].fail = True  # its first freeze is refused: the scale stops there
    with pytest.raises(UnavailableError):
        elastic.remove(2)
    assert elastic.active == [0, 1, 2] and keeper.state.inactive == set()


def test_a_switch_is_refused_when_the_shard_changed_during_the_freeze() -> None:
    elastic, keeper, stubs, log = make()
    real = stubs[2].FreezeShard

    def freeze_then_fail_over(request: pb.FreezeRequest, timeout: float) -> pb.FreezeReply:
        reply = real(request, timeout)
        if not request.thaw:  # the frozen primary is lost: its backup (the successor) is promoted, a new epoch
            rp.decide(keeper.state, rp.ConnectionLost(2))
            failed_over.update(keeper.state.shards)
        return reply

    failed_over: dict[int, rp.Copies] = {}
    stubs[2].FreezeShard = freeze_then_fail_over  # type: ignore[method-assign]
    with pytest.raises(UnavailableError):
        elastic.remove(2)
    assert keeper.layout() == failed_over  # the failover's table stands: no switch on top of it
    frozen = next(e[2] for e in log if e[0] == "freeze")
    assert log[-1] == ("thaw", 2, frozen)
    assert keeper.state.inactive == set() and elastic.active == [0, 1, 2]


def test_a_scale_whose_caller_went_away_stops_before_its_next_move() -> None:
    elastic, keeper, _, log = make()
    freezes = []

    def gone() -> bool:
        freezes.extend(e for e in log if e[0] == "freeze" and e not in freezes)
        return len(freezes) >= 1  # the caller left during the first move

    with pytest.raises(AbortedError, match="caller went away"):
        elastic.scale([0, 1], cancelled=gone)
    assert sum(1 for e in log if e[0] == "freeze") == 1  # the first move finished, no other started
    assert elastic.active == [0, 1, 2] and keeper.state.inactive == set()
    assert sum(1 for c in keeper.layout().values() if c.primary == 2) == 1


def test_a_ps_that_joined_the_list_is_not_active_until_added_then_takes_its_share() -> None:
    elastic, keeper, stubs, log = make()
    keeper.state.ps[3] = rp.PsRec()  # what ReplicaKeeper.join does: a new task index, drained until a scale
    keeper.state.num_ps = 4
    keeper.state.inactive = {3}
    stubs.append(Stub(3, log))  # the keeper's stub list, which the executor shares
    assert elastic.active == [0, 1, 2]
    with pytest.raises(FailedPreconditionError, match="ps 3 is not active"):
        elastic.remove(3)
    report = elastic.add(3)
    assert report.active == [0, 1, 2, 3] and elastic.active == [0, 1, 2, 3] and keeper.state.inactive == set()
    primaries = [c.primary for c in keeper.layout().values()]
    assert 1 <= primaries.count(3) <= 2 and all(1 <= primaries.count(p) <= 2 for p in range(4))


def test_scale_ps_stops_when_its_caller_went_away_and_join_ps_answers_with_the_list() -> None:
    from pscluster.coordinator.elastic import ScaleReport
    from pscluster.coordinator.servicer import CoordinatorServicer

    class Context:  # grpc's ServicerContext as ScalePs uses it: the caller cancelled or its deadline passed
        def __init__(self) -> None:
            self.active = True

        def is_active(self) -> bool:
            return self.active

    asked: list[bool] = []

    class Coordinator:
        def remove_ps(self, task: int, cancelled: Callable[[], bool]) -> ScaleReport:
            asked.append(cancelled())
            context.active = False
            asked.append(cancelled())
            return ScaleReport([0, 1], 2, [0.01])

        scale_ps = add_ps = remove_ps

        def join_ps(self, address: str) -> tuple[int, list[str], int]:
            return 2, ["h:1", "h:2", address], 1

    context = Context()
    servicer = CoordinatorServicer(Coordinator())  # type: ignore[arg-type]
    reply = servicer.ScalePs(pb.ScaleRequest(remove=2), context)  # type: ignore[arg-type]
    assert asked == [False, True] and list(reply.active) == [0, 1] and reply.moves == 2
    joined = servicer.JoinPs(pb.JoinPsRequest(address="h:3"), context)  # type: ignore[arg-type]
    assert (joined.index, list(joined.ps_addresses), joined.ps_epoch) == (2, ["h:1", "h:2", "h:3"], 1)


@pytest.mark.parametrize("holder", ["backup", "primary"])
def test_the_sync_states_copy_on_a_drained_ps_moves_a_backup_without_a_freeze_and_a_primary_with_one(holder) -> None:
    elastic, keeper, _, log = make()
    # the token queue's row after failovers: its backup (or its primary) on PS 2
    primary, backup = (0, 2) if holder == "backup" else (2, 0)
    keeper.state.shards[rp.SYNC_ORDINAL] = rp.Copies(primary, backup, 3, in_sync=True)
    without = make()[0].remove(2)  # the same drain without the row
    report = elastic.remove(2)
    row = keeper.sync_row()
    assert row is not None and row.in_sync and 2 not in (row.primary, row.backup)
    freezes = [e for e in log if e[0] == "freeze" and e[2] == "v-1"]
    if holder == "backup":  # token calls are never refused
        assert (row.primary, row.backup) == (0, 1) and ("table", rp.SYNC_ORDINAL, 0, 1) in log and not freezes
        assert report.moved == without.moved + 1 and len(report.freezes_s) == len(without.freezes_s)
    else:  # frozen on PS 2, switched to its in-sync backup PS 0, then thawed; PS 1 the new backup
        assert freezes == [("freeze", 2, "v-1", 0)] and (row.primary, row.backup) == (0, 1)
        switch = log.index(("table", rp.SYNC_ORDINAL, 0, 1))
        assert log.index(freezes[0]) < switch < log.index(("thaw", 2, "v-1"))
        assert report.moved == without.moved + 2 and len(report.freezes_s) == len(without.freezes_s) + 1


# -- one copy (replicas: 1, elastic): the same steps with a temporary backup ---------------------------
def test_one_copy_a_drained_primary_moves_through_a_temporary_backup_and_ends_with_none() -> None:
    elastic, keeper, _, log = make(copies=1)
    assert all(c.backup is None for c in keeper.state.shards.values())
    moved = sorted(o for o, c in keeper.layout().items() if c.primary == 2)
    report = elastic.remove(2)
    assert report.active == [0, 1] and len(report.freezes_s) == len(moved) == 2 and report.moved == 2
    layout = keeper.layout()
    assert all(c.backup is None and c.primary in (0, 1) for c in layout.values())
    assert sorted(sum(1 for c in layout.values() if c.primary == ps) for ps in (0, 1)) == [3, 3]
    for o in moved:
        successor = layout[o].primary
        temporary = log.index(("table", o, 2, successor))  # catch-up: the successor is the backup first
        freeze = log.index(("freeze", 2, f"v{o}", successor))
        switch = log.index(("table", o, successor, None))  # then the primary, with no backup again
        assert temporary < freeze < switch < log.index(("thaw", 2, f"v{o}")) < log.index(("drop", 2, f"v{o}"))
    assert [e for e in log if e[0] == "freeze"] == [("freeze", 2, f"v{o}", layout[o].primary) for o in moved]


def test_one_copy_adding_back_and_scaling_to_one_ps() -> None:
    elastic, keeper, _, _ = make(copies=1)
    elastic.remove(2)
    report = elastic.add(2)
    assert report.active == [0, 1, 2] and len(report.freezes_s) == 2
    assert sorted(c.primary for c in keeper.layout().values()) == [0, 0, 1, 1, 2, 2]
    report = elastic.scale_to(1)  # one copy: a single PS may hold every shard
    assert report.active == [0] and all((c.primary, c.backup) == (0, None) for c in keeper.layout().values())
    with pytest.raises(InvalidArgumentError, match="at least 1 must be active; pass 1..3"):
        elastic.scale_to(0)


def test_one_copy_the_sync_states_row_moves_with_a_freeze_and_keeps_no_backup() -> None:
    elastic, keeper, _, log = make(copies=1)
    keeper.state.shards[rp.SYNC_ORDINAL] = rp.Copies(0, None, 1)
    elastic.remove(0)
    row = keeper.sync_row()
    assert row is not None and row.primary in (1, 2) and row.backup is None
    assert ("freeze", 0, "v-1", row.primary) in log and ("table", rp.SYNC_ORDINAL, row.primary, None) in log


def test_a_scale_down_says_which_joined_ps_left_the_list_and_a_scale_past_the_list_says_to_join_one(caplog) -> None:
    elastic, keeper, stubs, log = make()
    keeper.state.ps[3] = rp.PsRec()  # ps 3 joined (ReplicaKeeper.join) and took its share
    keeper.state.num_ps = 4
    keeper.state.inactive = {3}
    keeper.book.join("h:3")
    stubs.append(Stub(3, log))

    def leave(task: int) -> None:  # ReplicaKeeper.leave: the book and the stub list shrink
        keeper.book.leave(task)
        stubs.pop()
        keeper.state.ps.pop(task)
        keeper.state.num_ps = len(stubs)

    keeper.leave = leave  # type: ignore[attr-defined]
    elastic.add(3)
    with caplog.at_level("WARNING", logger="pscluster.coordinator.elastic"):
        report = elastic.scale_to(3)
    assert report.active == [0, 1, 2] and report.left == (3,)
    assert "ps 3 left the PS list: stop its process" in caplog.text
    with pytest.raises(InvalidArgumentError, match=r"scale --ps 4: only 3 PS tasks \(0..2\) are in the list"):
        elastic.scale_to(4)  # the joined task left: not 'at least 1 must be active'
