"""The coordinator loop's inbox, driven from one thread; no sockets, no sleeps."""

from pscluster.coordinator import scheduler as sch
from pscluster.coordinator.inbox import Inbox, Posted
from pscluster.proto import pscluster_pb2 as pb


def test_take_returns_what_is_queued_in_order_up_to_the_limit():
    inbox = Inbox()
    for cid in (1, 2, 3):
        inbox.post(sch.Submit(cid))
    assert inbox.take(2) == [Posted(sch.Submit(1)), Posted(sch.Submit(2))]
    assert inbox.take(2) == [Posted(sch.Submit(3))]


def test_a_finished_event_carries_the_closure_answer_to_publish():
    inbox = Inbox()
    reply = pb.RunClosureReply(result=b"x")
    inbox.post(sch.Finished(4, "w", "ok"), reply)
    [posted] = inbox.take(8)
    assert posted.event == sch.Finished(4, "w", "ok") and posted.reply is reply and posted.answer is None


def test_ask_hands_the_loop_a_future_for_the_events_actions():
    inbox = Inbox()
    answer = inbox.ask(sch.Register("w", "addr"))
    [posted] = inbox.take(8)
    assert posted.answer is answer and not answer.done()
    posted.answer.set_result([sch.Registered("w", 0)])
    assert answer.result(0) == [sch.Registered("w", 0)]


def test_close_leaves_a_stop_mark_after_what_is_already_queued():
    inbox = Inbox()
    inbox.post(sch.Tick())
    inbox.close()
    inbox.post(sch.Tick())
    assert inbox.take(8) == [Posted(sch.Tick()), None, Posted(sch.Tick())]
