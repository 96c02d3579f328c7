"""replicas: 2 for the sync state (server/sync_replicas.py + replication.py): the token queue, the bounded
clocks and G reach the backup before a token call's reply, the backup refuses token calls and older epochs,
and once promoted it goes on where the primary was. Two in-process cores, the framed wire format, no sockets."""

from __future__ import annotations

import json
import threading

import pytest
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server.ps import ParameterServerCore
from pscluster.server.replication import Role

from pscluster.errors import InvalidArgumentError, UnavailableError
from pscluster.placement import SYNC_STATE_KEY
from tests.unit.test_replication import Link, make_core


@pytest.fixture
def pair():
    peers: dict[int, ParameterServerCore] = {}
    links: dict[int, Link] = {}
    a, b = make_core(0, peers, links, timeout=0.5), make_core(1, peers, links, timeout=0.5)
    peers.update({0: a, 1: b})
    yield a, b, links, peers
    for core in peers.values():
        core.replication.stop()


def assign(cores, version: int, epoch: int, primary: int, backup: int = -1) -> None:
    for core in cores:
        core.replication.set_roles(version, [Role(SYNC_STATE_KEY, epoch, primary, backup)])


def configure(cores, mode: str, r: int = 1, n: int = 1, staleness: int = 0) -> None:
    for core in cores:  # as ClusterOperations.configure_sync: every PS
        core.sync.configure(mode, r, n, staleness)


def held(primary, version: int) -> None:
    """Wait (bounded) until the primary's backup confirmed the sync state's `version`: a report's reply does not."""
    primary.replication.wait([(SYNC_STATE_KEY, version)], 5.0)


def test_a_sync_step_on_the_promoted_backup_goes_on_where_the_primary_was(pair):
    a, b, _, _ = pair
    assign((b, a), 1, 1, 0, 1)
    configure((a, b), "sync", 2, 2)
    assert a.sync.take_token(1, "w1", 1.0) == (0, 0)
    assert a.sync.take_token(2, "w2", 1.0) == (0, 1)
    epoch, version = a.sync.step_done(1, 0, "w1")  # counted: the reply says where, without waiting for b
    assert (epoch, version) == (1, a.sync.version)
    held(a, version)  # no take follows: the replication thread sends the report's forward itself
    assert b.sync.version == a.sync.version and b.global_step == 0
    with pytest.raises(UnavailableError, match="not the primary of sync-state"):
        b.sync.take_token(3, "w1", 1.0)  # only the primary hands out tokens: the client re-reads the table
    assign((b,), 2, 2, 1)  # PS 0 died; its backup is promoted
    assert b.sync.take_token(2, "w2", 1.0) == (0, 1)  # a retried take gets its token back
    b.sync.step_done(1, 0, "w1")  # a retried report counts once: the step still waits for replica 1
    assert b.global_step == 0
    b.sync.step_done(2, 0, "w2")
    assert b.global_step == 1
    assert b.sync.take_token(3, "w1", 1.0) == (1, 0)  # the next step's tokens


def test_bounded_clocks_and_g_survive_a_failover_and_a_retried_report_counts_once(pair):
    a, b, _, _ = pair
    assign((b, a), 1, 1, 0, 1)
    configure((a, b), "bounded", staleness=1)
    assert a.sync.take_token(10, "slow", 1.0) == (0, 0)
    for cid in range(1, 3):
        assert a.sync.take_token(cid, "fast", 1.0) == (cid - 1, 0)
        _, version = a.sync.step_done(cid, cid - 1, "fast")
    held(a, version)
    assert b.global_step == a.global_step == 2 and b.sync.clocks == {"fast": 2, "slow": 0}
    assign((b,), 2, 2, 1)
    b.sync.step_done(2, 1, "fast")  # the retry of a report the old primary counted
    assert b.global_step == 2 and b.sync.clocks["fast"] == 2
    with pytest.raises(Exception, match="2 steps ahead of the slowest"):
        b.sync.take_token(3, "fast", 0.1)  # the clocks came along: fast is still held back
    assert b.sync.take_token(10, "slow", 1.0) == (0, 0)  # its token back
    b.sync.step_done(10, 0, "slow")
    assert b.global_step == 3 and b.sync.clocks == {"fast": 2, "slow": 1}
    assert b.sync.take_token(3, "fast", 1.0) == (2, 0)


def test_a_token_reply_waits_for_the_backup_and_is_not_given_without_it(pair):
    a, b, links, _ = pair
    assign((b, a), 1, 1, 0, 1)
    configure((a, b), "sync", 1, 1)
    links[1].cut.set()
    with pytest.raises(UnavailableError, match="did not confirm"):
        a.sync.take_token(1, "w", 1.0)  # granted on the primary, not acknowledged: the client retries
    links[1].cut.clear()
    assert a.sync.take_token(1, "w", 1.0) == (0, 0)  # the retry: the same token, now held twice
    assert json.loads(a.sync._wire())["tokens"] == [[1, 0, 0]]
    assert b.sync._state.tokens == {1: (0, 0)}


def test_a_waiting_take_on_a_deposed_holder_gives_up_at_once(pair):
    a, b, _, _ = pair
    assign((b, a), 1, 1, 0, 1)
    configure((a, b), "sync", 1, 1)
    a.sync.take_token(1, "w", 1.0)
    errors: list[BaseException] = []

    def take() -> None:
        try:
            a.sync.take_token(2, "w", 10.0)  # step 0's one token is out: it waits
        except UnavailableError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=take)
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive()
    assign((a, b), 2, 2, 1)
    waiter.join(timeout=2.0)
    assert not waiter.is_alive() and "no longer holds the sync token queue" in str(errors[0])


def test_a_new_backup_catches_up_the_whole_state_and_older_epochs_are_refused(pair):
    a, b, _, peers = pair
    assign((a,), 1, 1, 0)  # one copy: the backup is down
    configure((a,), "sync", 2, 2)
    a.sync.take_token(1, "w", 1.0)
    fresh = make_core(1, peers, {}, timeout=0.5)  # restarted: it holds nothing
    b.replication.stop()
    peers[1] = fresh
    assign((fresh, a), 2, 2, 0, 1)
    assert SYNC_STATE_KEY in a.replication.catching_up() or fresh.sync._state.tokens
    a.replication.wait([(SYNC_STATE_KEY, a.sync.version)])
    assert a.replication.catching_up() == []
    assert fresh.sync._state.tokens == {1: (0, 0)} and fresh.sync.mode == "sync"
    # a forward of an older epoch (a deposed primary) is refused and changes nothing
    stale = pb.ReplicateRequest(forwards=[pb.ReplicaForward(
        ref=pb.ShardRef(variable=SYNC_STATE_KEY[0], shard_index=SYNC_STATE_KEY[1]), epoch=1, version=99,
        sync_state=json.dumps({"mode": "async"}))])
    assert fresh.replication.receive(stale).outcomes == [pb.REPLICA_STALE]
    assert fresh.sync.mode == "sync"
    stale.forwards[0].epoch = 2
    with pytest.raises(InvalidArgumentError, match="malformed"):
        fresh.replication.receive(stale)
    assert fresh.sync.mode == "sync" and fresh.sync.version == a.sync.version


def test_the_backups_own_configure_keeps_the_tokens_the_primary_forwarded(pair):
    a, b, _, _ = pair
    assign((b, a), 1, 1, 0, 1)
    configure((a,), "sync", 2, 2)
    a.sync.take_token(1, "w", 1.0)  # forwarded before the backup's own ConfigureSync arrives
    b.sync.configure("sync", 2, 2, 0)
    assert b.sync._state.tokens == {1: (0, 0)} and b.sync.accumulates


def test_a_move_of_the_queue_freezes_token_calls_wakes_a_waiting_take_and_the_new_primary_goes_on(pair):
    a, b, _, _ = pair
    assign((b, a), 1, 1, 0, 1)
    configure((a, b), "sync", 1, 1)
    assert a.sync.take_token(1, "w", 1.0) == (0, 0)
    errors: list[BaseException] = []

    def take() -> None:
        try:
            a.sync.take_token(2, "w", 10.0)  # step 0's one token is out: it waits for step 0's report
        except UnavailableError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=take)
    waiter.start()
    for _ in range(1000):  # up to 10 s on a loaded machine: admitted, so the freeze cannot refuse it at the gate
        if a.gate._waiting(SYNC_STATE_KEY) == 1:
            break
        waiter.join(timeout=0.01)
    assert a.gate._waiting(SYNC_STATE_KEY) == 1 and waiter.is_alive()
    # the move (elastic.py): the freeze wakes the waiter instead of waiting 10 s for it, and returns the
    # version its backup holds
    version = a.freeze_shard(SYNC_STATE_KEY, 1, lease_s=2.0)
    waiter.join(timeout=10.0)
    # the waiter's wake-up, not the gate's admission refusal ("... is moving off ps 0")
    assert not waiter.is_alive() and "sync token queue is moving off ps 0" in str(errors[0])
    assert version == a.sync.version == b.sync.version
    with pytest.raises(UnavailableError, match="moving off ps 0"):
        a.sync.step_done(1, 0, "w")  # refused while frozen: nothing changes here
    assert a.sync.version == version
    assign((b, a), 2, 2, 1, 0)  # the switch: PS 1 primary, PS 0 its backup
    a.thaw_shard(SYNC_STATE_KEY)
    b.sync.step_done(1, 0, "w")  # the client's retry, on the new primary
    assert b.global_step == 1 and b.sync.take_token(2, "w", 1.0) == (1, 0)


def test_a_call_that_changes_nothing_forwards_nothing_and_still_waits_for_what_it_saw(pair):
    a, b, links, _ = pair
    assign((b, a), 1, 1, 0, 1)
    configure((a, b), "sync", 1, 1)
    assert a.sync.take_token(1, "w", 1.0) == (0, 0)
    a.sync.step_done(1, 0, "w")
    version, batches = a.sync.version, links[1].batches
    assert a.sync.take_token(2, "w", 1.0) == (1, 0)
    assert (a.sync.version, links[1].batches) == (version + 1, batches + 1)
    a.sync.step_done(1, 0, "w")  # a repeated report of a step that advanced: nothing changes
    assert a.sync.take_token(2, "w", 1.0) == (1, 0)  # a retried take of a held token: nothing changes
    assert (a.sync.version, links[1].batches) == (version + 1, batches + 1)
    links[1].cut.set()
    counted = a.sync.step_done(2, 1, "w")  # G advances here; the reply does not wait for the backup
    assert counted == (1, version + 2) and a.global_step == 2 and b.global_step == 1
    assert a.sync.step_done(2, 1, "w") == counted  # a retry changes nothing: the same place
    links[1].cut.clear()
    held(a, counted[1])  # the replication thread gets it through
    assert b.global_step == 2


def test_a_report_that_releases_a_waiting_take_carries_its_grant_in_its_one_forward(pair):
    a, b, links, _ = pair
    assign((b, a), 1, 1, 0, 1)
    configure((a, b), "sync", 1, 1)
    assert a.sync.take_token(1, "w1", 1.0) == (0, 0)
    got: list[tuple[int, int]] = []
    waiter = threading.Thread(target=lambda: got.append(a.sync.take_token(2, "w2", 5.0)))
    waiter.start()
    for _ in range(1000):  # up to 10 s on a loaded machine
        if 2 in a.sync._waiting:
            break
        waiter.join(timeout=0.01)
    assert 2 in a.sync._waiting  # it waits for step 0's report
    version, batches = a.sync.version, links[1].batches
    assert version == b.sync.version  # the wait forwarded nothing (nothing changed)
    a.sync.step_done(1, 0, "w1")  # advances G and hands the waiter step 1's token in the same change
    waiter.join(timeout=2.0)
    assert got == [(1, 0)]
    assert (a.sync.version, links[1].batches) == (version + 1, batches + 1)
    assert b.sync._state.tokens[2] == (1, 0) and b.global_step == 1  # the grant rode in the report's forward
    assert not a.sync._waiting and not a.sync._pregranted


def test_a_queued_sync_state_is_superseded_by_a_newer_one(pair):
    a, b, links, _ = pair
    assign((b, a), 1, 1, 0, 1)
    configure((a, b), "bounded", staleness=1)
    links[1].cut.set()  # nothing gets through: the forwards stay queued
    for version in range(a.sync.version + 1, a.sync.version + 4):
        a.replication.forward_sync(version, a.sync._wire())
    _, rep = a.replication._replicator_of(SYNC_STATE_KEY)
    assert [item[1] for item in rep._queue if item[0] == SYNC_STATE_KEY] == [version]
    links[1].cut.clear()
    a.replication.wait([(SYNC_STATE_KEY, version - 1)], 2.0)  # the newer version answers the older one's waiter
    assert b.sync.version == version


def test_status_counts_the_sync_state_changes_each_one_forward(pair):
    from pscluster.server.servicer import ParameterServerServicer

    a, b, _, _ = pair
    assign((b, a), 1, 1, 0, 1)
    configure((a, b), "sync", 2, 2)
    status = [ParameterServerServicer(core, 1 << 20).Status(pb.PsStatusRequest(), None) for core in (a, b)]
    start = status[0].sync_version
    assert a.sync.take_token(1, "w1", 1.0) == (0, 0)
    assert a.sync.take_token(1, "w1", 1.0) == (0, 0)  # a retried take changes nothing: nothing forwarded
    _, version = a.sync.step_done(1, 0, "w1")
    held(a, version)
    status = [ParameterServerServicer(core, 1 << 20).Status(pb.PsStatusRequest(), None) for core in (a, b)]
    assert status[0].sync_version == status[1].sync_version == start + 2  # a grant and a report, both held by b
    # the primary says what its backup confirmed (the coordinator forgets reports at or below it); b: not primary
    assert (status[0].sync_confirmed_epoch, status[0].sync_confirmed_version) == (1, start + 2)
    assert (status[1].sync_confirmed_epoch, status[1].sync_confirmed_version) == (0, 0)


def test_a_take_that_carries_reports_is_one_forward_and_its_retry_on_the_promoted_backup_counts_them_once(pair):
    a, b, _, _ = pair
    assign((b, a), 1, 1, 0, 1)
    configure((a, b), "sync", 2, 2)
    assert a.sync.take_token(1, "w1", 1.0) == (0, 0)
    assert a.sync.take_token(2, "w2", 1.0) == (0, 1)
    before = a.sync.version
    # closure 3 on w1 carries the reports of 1 and 2: step 0 is made and 3 gets step 1's first token
    assert a.sync.take_token(3, "w1", 1.0, [(1, 0, "w1"), (2, 0, "w2")]) == (1, 0)
    assert a.sync.version == before + 1 == b.sync.version and b.global_step == 1  # one change, held by b
    assign((b,), 2, 2, 1)  # PS 0 died before the reply reached the worker: it retries on b, same ids
    assert b.sync.take_token(3, "w1", 1.0, [(1, 0, "w1"), (2, 0, "w2")]) == (1, 0)
    assert b.global_step == 1
    assert b.sync.take_token(4, "w2", 1.0, [(3, 1, "w1")]) == (1, 1)  # 3's report alone leaves step 1 open
    assert b.global_step == 1
    b.sync.step_done(4, 1, "w2")  # the old call still works beside the new one
    assert b.global_step == 2


def test_a_waiting_take_that_carried_a_report_is_granted_by_the_report_that_completes_the_step(pair):
    a, b, _, _ = pair
    assign((b, a), 1, 1, 0, 1)
    configure((a, b), "sync", 2, 2)
    assert a.sync.take_token(1, "w1", 1.0) == (0, 0)
    assert a.sync.take_token(2, "w2", 1.0) == (0, 1)
    got: list[tuple[int, int]] = []
    waiter = threading.Thread(target=lambda: got.append(a.sync.take_token(3, "w1", 5.0, [(1, 0, "w1")])))
    waiter.start()
    try:
        seen = threading.Event()
        for _ in range(500):  # its report is counted (and held by b) while its take waits for step 1
            with a.sync._cond:
                if 3 in a.sync._waiting and b.sync._state.done.get(0) == {1}:
                    seen.set()
                    break
            threading.Event().wait(0.01)
        assert seen.is_set() and not got
        # 2's report, carried by 4's take, makes step 0: the waiting 3 is granted first, in the same change
        assert a.sync.take_token(4, "w2", 1.0, [(2, 0, "w2")]) == (1, 1)
    finally:
        waiter.join(5.0)
    assert got == [(1, 0)] and a.global_step == b.global_step == 1 and b.sync.version == a.sync.version


def test_a_report_its_primary_never_forwarded_is_sent_again_to_the_promoted_backup(pair):
    from pscluster.coordinator.sync_reports import ReportResender

    a, b, links, _ = pair
    assign((b, a), 1, 1, 0, 1)
    configure((a, b), "sync", 2, 2)
    assert a.sync.take_token(1, "w1", 1.0) == (0, 0)
    assert a.sync.take_token(2, "w2", 1.0) == (0, 1)
    links[1].cut.set()  # the report's forward never gets through: PS 0 dies with it
    epoch, version = a.sync.step_done(1, 0, "w1")
    e2, v2 = a.sync.step_done(2, 0, "w2")  # step 0 is made on PS 0 alone
    assert a.global_step == 1 and b.global_step == 0 and (epoch, e2) == (1, 1)
    resender = ReportResender(lambda cid, step, worker: b.sync.step_done(cid, step, worker)).start()
    try:
        resender.reported(1, pb.SyncReport(step=0, worker="w1", epoch=epoch, version=version))
        resender.observe(1, (1, version - 1))  # the backup holds neither: both kept, nothing moved yet
        assign((b,), 2, 2, 1)  # PS 0 died; b promoted at epoch 2
        resender.reported(2, pb.SyncReport(step=0, worker="w2", epoch=e2, version=v2))  # held: no round saw the move
        resender.observe(2, (0, 0))  # the round that saw the move: both reports go again
        for _ in range(500):
            if b.global_step == 1 and resender.resent == 2:
                break
            threading.Event().wait(0.01)
        assert b.global_step == 1 and resender.resent == 2  # step 0 made on the new primary too
        assert b.sync.take_token(3, "w1", 1.0) == (1, 0)
        resender.observe(2, (2, b.sync.version))  # one copy now: confirmed as counted, nothing held
        assert resender.held == 0
    finally:
        resender.stop()


def test_a_report_whose_forward_raced_a_failover_is_answered_at_the_forwards_epoch(pair):
    a, b, links, _ = pair
    assign((b, a), 1, 1, 0, 1)
    configure((a, b), "sync", 2, 2)
    assert a.sync.take_token(1, "w1", 1.0) == (0, 0)
    links[1].cut.set()
    forward = a.replication.forward_sync

    def forward_then_failover(*args, **kw):  # the failover's SetRoles lands between the forward and the reply
        epoch = forward(*args, **kw)
        assign((a, b), 2, 2, 1)
        return epoch

    a.replication.forward_sync = forward_then_failover
    epoch, version = a.sync.step_done(1, 0, "w1")
    assert epoch == 1  # the forward's epoch, not what PS 0 holds after the SetRoles: the coordinator resends it


def test_a_report_deposed_before_its_forward_is_refused(pair):
    a, b, _, _ = pair
    assign((b, a), 1, 1, 0, 1)
    configure((a, b), "sync", 2, 2)
    assert a.sync.take_token(1, "w1", 1.0) == (0, 0)
    forward = a.replication.forward_sync

    def failover_then_forward(*args, **kw):  # the SetRoles lands after the role check, before the forward
        assign((a, b), 2, 2, 1)
        return forward(*args, **kw)

    a.replication.forward_sync = failover_then_forward
    with pytest.raises(UnavailableError, match="no longer holds the sync token queue"):
        a.sync.step_done(1, 0, "w1")  # counted on PS 0 only: not acknowledged; the client retries on PS 1


def test_a_resent_report_of_an_earlier_job_does_not_count_after_configure_sync(pair):
    a, b, _, _ = pair
    assign((b, a), 1, 1, 0, 1)
    configure((a, b), "sync", 2, 2)
    assert a.sync.take_token(1, "w1", 1.0) == (0, 0)
    a.sync.step_done(1, 0, "w1")  # the job ends with step 0 one report short; the coordinator holds the report
    configure((a, b), "sync", 2, 3)  # the next job's ConfigureSync clears the tokens
    assign((a, b), 2, 2, 1)  # the row moves before a keeper round saw the report confirmed: it is sent again
    b.sync.step_done(1, 0, "w1")
    assert b.sync.take_token(10, "n1", 1.0) == (0, 0)
    b.sync.step_done(10, 0, "n1")
    assert b.global_step == 0  # one report of the new job: the old closure holds no token, it counts for nothing


def test_a_bounded_report_its_primary_never_forwarded_is_sent_again_and_counts_once(pair):
    from pscluster.coordinator.sync_reports import ReportResender

    a, b, links, _ = pair
    assign((b, a), 1, 1, 0, 1)
    configure((a, b), "bounded", staleness=0)
    assert a.sync.take_token(1, "w1", 1.0) == (0, 0)
    assert a.sync.take_token(2, "w2", 1.0) == (0, 0)
    links[1].cut.set()
    epoch, version = a.sync.step_done(1, 0, "w1")  # PS 0 alone: w1's clock 1, G 1
    assert a.sync.clocks["w1"] == 1 and b.sync.clocks.get("w1", 0) == 0
    assign((b,), 2, 2, 1)  # PS 0 died with it
    resender = ReportResender(lambda cid, step, worker: b.sync.step_done(cid, step, worker)).start()
    try:
        resender.reported(1, pb.SyncReport(step=0, worker="w1", epoch=epoch, version=version))
        resender.observe(2, (0, 0))
        for _ in range(500):
            if resender.resent == 1:
                break
            threading.Event().wait(0.01)
        assert resender.resent == 1 and b.sync.clocks["w1"] == 1 and b.global_step == 1
        b.sync.step_done(1, 0, "w1")  # the worker's own retry as well: its token is gone, it counts once
        assert b.sync.clocks["w1"] == 1 and b.global_step == 1
        with pytest.raises(Exception, match="ahead of the slowest"):
            b.sync.take_token(3, "w1", 0.1)  # staleness 0: w1 waits for w2, whose token came along
        b.sync.step_done(2, 0, "w2")
        assert b.sync.take_token(3, "w1", 1.0) == (1, 0)
    finally:
        resender.stop()
