"""coordinator/sync_reports.py: which closures' sync reports the coordinator keeps, forgets and sends again."""

from __future__ import annotations

import threading

from pscluster.coordinator.sync_reports import HeldReports, Report, ReportResender
from pscluster.proto import pscluster_pb2 as pb

from pscluster.errors import FailedPreconditionError, UnavailableError


def r(cid: int, epoch: int = 1, version: int = 5, step: int = 0) -> Report:
    return Report(cid, step, f"w{cid}", epoch, version)


def test_a_report_is_kept_until_the_backup_confirms_its_version_at_its_epoch():
    held = HeldReports()
    assert held.add(r(1, version=5)) == [] and held.add(r(2, version=7)) == []
    assert held.round(1, (1, 6)) == [] and len(held) == 1  # 1's version confirmed; 2's not yet
    assert held.round(1, (2, 9)) == [] and len(held) == 1  # a confirmation of another epoch says nothing of it
    assert held.round(1, (1, 7)) == [] and len(held) == 0


def test_a_report_of_one_copy_is_not_kept():
    held = HeldReports()
    assert held.add(r(1, epoch=0, version=0)) == [] and len(held) == 0


def test_the_rows_move_sends_every_report_of_an_older_epoch_again_once():
    held = HeldReports()
    held.add(r(1, epoch=1))
    held.add(r(2, epoch=2))
    assert held.round(2, (0, 0)) == [r(1, epoch=1)]  # counted before the move: the new primary may lack it
    assert held.round(2, (0, 0)) == []  # already on its way
    assert held.sent(1, 2, 9) == [] and held.resent == 1  # counted again, at the new epoch
    assert held.round(2, (2, 9)) == [] and len(held) == 0


def test_a_reply_that_arrives_after_the_move_is_sent_again_at_once():
    held = HeldReports()
    held.round(3, (0, 0))
    assert held.add(r(1, epoch=2)) == [r(1, epoch=2)]  # counted by the deposed primary
    assert held.add(r(2, epoch=3)) == []


def test_a_resend_counted_at_an_epoch_that_moved_again_goes_again():
    held = HeldReports()
    held.add(r(1, epoch=1))
    assert held.round(2, (0, 0)) == [r(1, epoch=1)]
    held.round(3, (0, 0))  # moved again while the resend was in flight: not queued twice
    assert held.sent(1, 2, 4) == [Report(1, 0, "w1", 2, 4)]


def test_a_failed_resend_goes_again_at_the_next_round_unless_it_cannot_succeed():
    held = HeldReports()
    held.add(r(1))
    held.add(r(2))
    assert len(held.round(2, (0, 0))) == 2
    held.failed(1, retryable=True)
    held.failed(2, retryable=False)
    assert held.round(2, (0, 0)) == [r(1)] and len(held) == 1


def test_the_held_reports_are_bounded():
    held = HeldReports(limit=3)
    for cid in range(5):
        held.add(r(cid))
    assert len(held) == 3
    assert [x.closure_id for x in held.round(2, (0, 0))] == [2, 3, 4]  # the oldest went


def test_the_resender_thread_sends_what_is_due_and_survives_a_failed_send():
    calls: list[tuple[int, int, str]] = []
    answers = [UnavailableError("moving"), FailedPreconditionError("no sync"), (2, 8)]
    sent = threading.Event()

    def step_done(cid: int, step: int, worker: str) -> tuple[int, int]:
        calls.append((cid, step, worker))
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        sent.set()
        return answer

    resender = ReportResender(step_done).start()
    try:
        resender.observe(2, (0, 0))
        resender.reported(7, pb.SyncReport(step=3, worker="w", epoch=1, version=4))  # sent at once: fails, retryable
        resender.reported(8, pb.SyncReport(step=3, worker="v", epoch=1, version=5))  # fails for good: forgotten
        for _ in range(500):
            if len(calls) == 2 and resender.held == 1:
                break
            threading.Event().wait(0.01)
        assert len(calls) == 2 and resender.held == 1
        resender.observe(2, (0, 0))  # the next round: 7's goes again and is counted at epoch 2
        assert sent.wait(5.0)
        for _ in range(500):
            if resender.resent == 1:
                break
            threading.Event().wait(0.01)
        assert calls == [(7, 3, "w"), (8, 3, "v"), (7, 3, "w")] and resender.resent == 1
        resender.observe(2, (2, 8))
        assert resender.held == 0
    finally:
        resender.stop()


def test_a_closures_reply_carries_its_report_and_the_coordinator_keeps_it():
    import types

    from pscluster.coordinator import coordinator
    from pscluster.coordinator import events as ev
    from pscluster.worker.runner import Outcome
    from pscluster.worker.servicer import outcome_to_pb

    reply = outcome_to_pb(Outcome(result=b"r", report=(4, "w0", 3, 17)))
    assert (reply.report.step, reply.report.worker, reply.report.epoch, reply.report.version) == (4, "w0", 3, 17)
    assert not outcome_to_pb(Outcome(result=b"r")).HasField("report")  # async: no token, no report
    kept: list[tuple[int, pb.SyncReport]] = []
    finished: list[int] = []
    coord = types.SimpleNamespace(_values={}, _curves=None, _finish=lambda cid, error: finished.append(cid),
                                  _watch=types.SimpleNamespace(reports=types.SimpleNamespace(
                                      reported=lambda cid, report: kept.append((cid, report)))))
    coordinator.ClusterCoordinator._resolved(coord, ev.Resolve(9), reply)  # type: ignore[arg-type]
    assert kept == [(9, reply.report)] and finished == [9]


def test_a_stopped_resender_drops_what_is_queued():
    calls: list[int] = []
    gate = threading.Event()

    def step_done(cid: int, step: int, worker: str) -> tuple[int, int]:
        calls.append(cid)
        gate.wait(5.0)  # the first resend is in flight when stop() comes
        return 2, 1

    resender = ReportResender(step_done).start()
    resender.observe(2, (0, 0))
    for cid in (1, 2):
        resender.reported(cid, pb.SyncReport(step=0, worker="w", epoch=1, version=cid))
    for _ in range(500):
        if calls:
            break
        threading.Event().wait(0.01)
    stopper = threading.Thread(target=resender.stop)
    stopper.start()
    for _ in range(500):
        if resender._stop.is_set():
            break
        threading.Event().wait(0.01)
    gate.set()
    stopper.join(10.0)
    assert not stopper.is_alive() and calls == [1]  # the in-flight one finished, the queued one was dropped
