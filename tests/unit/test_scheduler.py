"""The scheduling/membership state machine, fed events; no sockets, no sleeps."""

from pscluster.coordinator import scheduler as sch
from pscluster.coordinator.job_queues import MAIN


def kinds(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def fresh(max_inflight=1, **kw):
    state = sch.SchedulerState(max_inflight=max_inflight, heartbeat_timeout=2.0, **kw)
    return state


def with_workers(state, *wids, now=0.0):
    for wid in wids:
        sch.decide(state, sch.Register(wid, f"addr-{wid}"), now)
    return state


def test_closures_wait_without_workers_then_dispatch_when_one_joins():
    state = fresh()
    assert sch.decide(state, sch.Submit(1), 0.0) == []
    actions = sch.decide(state, sch.Register("a", "addr-a"), 0.1)
    assert kinds(actions, sch.Registered) == [sch.Registered("a", 0)]
    assert kinds(actions, sch.Dispatch) == [sch.Dispatch(1, "a", "addr-a", 1)]


def test_dispatch_respects_max_inflight_and_balances_workers():
    state = with_workers(fresh(max_inflight=2), "a", "b")
    dispatched = []
    for cid in range(1, 6):
        dispatched += kinds(sch.decide(state, sch.Submit(cid), 1.0), sch.Dispatch)
    assert [d.wid for d in dispatched] == ["a", "b", "a", "b"]
    assert list(state.queue) == [5]
    more = kinds(sch.decide(state, sch.Finished(1, "a", "ok"), 1.1), sch.Dispatch)
    assert more == [sch.Dispatch(5, "a", "addr-a", 1)]


def test_completion_resolves_once_and_counts():
    state = with_workers(fresh(), "a")
    sch.decide(state, sch.Submit(1), 0.0)
    actions = sch.decide(state, sch.Finished(1, "a", "ok"), 0.1)
    assert kinds(actions, sch.Resolve) == [sch.Resolve(1)]
    assert sch.decide(state, sch.Finished(1, "a", "ok"), 0.2) == []  # a duplicate answer changes nothing
    assert state.completed == 1 and 1 not in state.closures  # a resolved record is dropped


def test_worker_loss_requeues_its_closures_first_on_another_worker():
    state = with_workers(fresh(), "a", "b")
    for cid in (1, 2, 3):
        sch.decide(state, sch.Submit(cid), 0.0)
    actions = sch.decide(state, sch.TransportFailed(1, "a", "connection reset"), 0.5)
    gone = kinds(actions, sch.WorkerGone)
    assert gone and gone[0].rescheduled == (1,) and "connection reset" in gone[0].reason
    assert kinds(actions, sch.Abandon) == [sch.Abandon(1, "a")]
    # closure 1 goes ahead of 3 in the queue; b is busy with 2
    assert list(state.queue) == [1, 3]
    nxt = kinds(sch.decide(state, sch.Finished(2, "b", "ok"), 0.6), sch.Dispatch)
    assert nxt == [sch.Dispatch(1, "b", "addr-b", 2)]
    assert state.retried == 1


def test_missed_heartbeats_mark_a_hung_worker_gone():
    state = with_workers(fresh(), "a", "b")
    sch.decide(state, sch.Submit(1), 0.0)  # goes to a
    sch.decide(state, sch.Heartbeat("b"), 1.9)
    actions = sch.decide(state, sch.Tick(), 2.5)
    gone = kinds(actions, sch.WorkerGone)
    assert [g.wid for g in gone] == ["a"] and "missed heartbeats" in gone[0].reason
    assert kinds(actions, sch.Dispatch) == [sch.Dispatch(1, "b", "addr-b", 2)]


def test_late_answer_from_a_replaced_attempt_is_first_wins():
    state = with_workers(fresh(), "a", "b")
    sch.decide(state, sch.Submit(1), 0.0)
    sch.decide(state, sch.Tick(), 3.0)  # a and b both missed heartbeats
    with_workers(state, "c", now=3.1)  # closure 1 goes to c
    assert state.closures[1].workers == {"c"}
    # a was declared gone, but its late answer is a valid result (pushes are exactly-once): it resolves
    # the closure and the attempt on c is abandoned; c's answer then changes nothing.
    actions = sch.decide(state, sch.Finished(1, "a", "ok"), 3.2)
    assert kinds(actions, sch.Resolve) == [sch.Resolve(1)]
    assert kinds(actions, sch.Abandon) == [sch.Abandon(1, "c")]
    assert sch.decide(state, sch.Finished(1, "c", "ok"), 3.3) == []
    assert state.completed == 1


def test_rejoin_after_being_declared_gone_gets_a_new_index():
    state = with_workers(fresh(), "a")
    sch.decide(state, sch.Tick(), 5.0)
    assert "a" not in state.workers
    actions = sch.decide(state, sch.Register("a", "addr-a"), 5.1)
    assert kinds(actions, sch.Registered) == [sch.Registered("a", 1)]


def test_user_error_fails_the_closure_cancels_the_queue_and_is_not_retried():
    state = with_workers(fresh(), "a")
    for cid in (1, 2, 3):
        sch.decide(state, sch.Submit(cid), 0.0)
    actions = sch.decide(state, sch.Finished(1, "a", "user_error"), 0.1)
    assert kinds(actions, sch.Resolve) == [sch.Resolve(1)]
    assert [c.cid for c in kinds(actions, sch.Cancel)] == [2, 3]
    assert not kinds(actions, sch.Dispatch)
    assert state.queue.jobs[MAIN].error_cid == 1 and state.failed == 1 and not state.closures
    sch.decide(state, sch.ErrorReported(), 0.2)
    assert state.queue.jobs[MAIN].error_cid is None
    assert kinds(sch.decide(state, sch.Submit(4), 0.3), sch.Dispatch)  # scheduling goes on


def test_closure_that_met_an_unavailable_ps_pauses_dispatch_until_ps_up():
    state = with_workers(fresh(), "a", "b")
    for cid in (1, 2, 3):
        sch.decide(state, sch.Submit(cid), 0.0)
    actions = sch.decide(state, sch.Finished(1, "a", "retry"), 0.1)
    assert kinds(actions, sch.WatchPs) == [sch.WatchPs()]
    assert not kinds(actions, sch.Dispatch) and state.paused
    assert list(state.queue) == [1, 3]
    assert not kinds(sch.decide(state, sch.Finished(2, "b", "retry"), 0.2), sch.WatchPs)  # one watcher
    resumed = kinds(sch.decide(state, sch.PsUp(), 1.0), sch.Dispatch)
    assert {d.cid for d in resumed} == {2, 1}


def test_preempted_worker_finishes_its_closures_gets_no_new_ones_then_leaves():
    state = with_workers(fresh(), "a", "b")
    for cid in (1, 2, 3):
        sch.decide(state, sch.Submit(cid), 0.0)
    assert sch.decide(state, sch.Leave("a"), 0.1) == []
    actions = sch.decide(state, sch.Finished(1, "a", "ok"), 0.2)
    assert kinds(actions, sch.Resolve) and kinds(actions, sch.WorkerGone)
    assert not [d for d in kinds(actions, sch.Dispatch) if d.wid == "a"]


def test_no_live_worker_for_too_long_fails_queued_closures_with_a_clear_reason():
    state = fresh(no_worker_timeout=10.0)
    sch.decide(state, sch.Submit(1), 0.0)
    assert sch.decide(state, sch.Tick(), 1.0) == []
    assert sch.decide(state, sch.Tick(), 5.0) == []
    failed = kinds(sch.decide(state, sch.Tick(), 11.5), sch.FailUnscheduled)
    assert [f.cid for f in failed] == [1] and "no live worker" in failed[0].reason
    sch.decide(state, sch.Submit(2), 12.0)  # a later closure gets a full timeout of its own
    assert sch.decide(state, sch.Tick(), 12.5) == []
    assert sch.decide(state, sch.Tick(), 20.0) == []


def test_closure_that_keeps_losing_workers_fails_after_max_attempts():
    state = fresh(max_attempts=2)
    sch.decide(state, sch.Submit(1), 0.0)
    for n, wid in enumerate(["a", "b"]):
        with_workers(state, wid, now=float(n))
        actions = sch.decide(state, sch.TransportFailed(1, wid, "killed"), float(n) + 0.5)
    assert [f.cid for f in kinds(actions, sch.FailUnscheduled)] == [1]
    assert state.failed == 1 and 1 not in state.closures


def test_sync_concurrency_cap_leaves_a_slot_for_a_rescheduled_token_holder():
    state = with_workers(fresh(max_inflight=2), "a", "b", "c")
    sch.decide(state, sch.SetConcurrency(3), 0.0)
    dispatched = []
    for cid in range(1, 10):
        dispatched += kinds(sch.decide(state, sch.Submit(cid), 0.1), sch.Dispatch)
    assert len(dispatched) == 3 and state.running() == 3  # N closures, not 3 workers x 2 slots
    # the token holder on a dies: its closure is requeued first and dispatched at once
    actions = sch.decide(state, sch.TransportFailed(dispatched[0].cid, dispatched[0].wid, "killed"), 0.2)
    assert [d.cid for d in kinds(actions, sch.Dispatch)] == [dispatched[0].cid]
    lifted = kinds(sch.decide(state, sch.SetConcurrency(None), 0.3), sch.Dispatch)
    assert len(lifted) == 1 and state.running() == 4  # no cap: both live workers fill their 2 slots


def check_counts(state):
    """Only queued and running closures have records; the running counter matches them."""
    states = [rec.state for rec in state.closures.values()]
    assert set(states) <= {"queued", "running"}
    assert state.running() == states.count("running")
    assert states.count("queued") == len(state.queue)
    assert sum(len(w.inflight) for w in state.workers.values()) >= state.running()


def test_records_are_dropped_and_the_running_count_holds_through_every_path():
    state = with_workers(fresh(max_inflight=2, max_attempts=2), "a", "b")
    for cid in range(1, 9):
        sch.decide(state, sch.Submit(cid), 0.0)  # 1,3 -> a; 2,4 -> b; 5..8 queued
        check_counts(state)
    assert state.running() == 4
    steps = [
        sch.Finished(1, "a", "ok"),                 # done -> 5 dispatched to a
        sch.Finished(2, "b", "retry"),              # back to the queue, dispatch paused
        sch.PsUp(),                                 # 2 dispatched again
        sch.TransportFailed(3, "a", "killed"),      # a lost: 3 and 5 requeued
        sch.Register("c", "addr-c"),
        sch.Finished(4, "b", "ok"),
        sch.Leave("b"),                             # b finishes what it runs, then goes
        sch.Tick(),
    ]
    for n, event in enumerate(steps):
        sch.decide(state, event, 0.1 + n * 0.01)
        check_counts(state)
    # finish everything that is running, then the queue drains onto c
    while state.closures:
        rec = next(r for r in state.closures.values() if r.state == "running")
        sch.decide(state, sch.Finished(rec.cid, next(iter(rec.workers)), "ok"), 0.5)
        check_counts(state)
    assert state.running() == 0 and not state.queue
    assert state.completed == 8 and state.failed == 0


def test_cancel_fail_and_lost_attempts_drop_records_and_running_count():
    state = with_workers(fresh(max_attempts=1), "a", "b")
    for cid in (1, 2, 3, 4):
        sch.decide(state, sch.Submit(cid), 0.0)
    sch.decide(state, sch.TransportFailed(1, "a", "killed"), 0.1)  # 1 used its only attempt: failed
    check_counts(state)
    assert 1 not in state.closures and state.failed == 1
    actions = sch.decide(state, sch.Finished(2, "b", "user_error"), 0.2)  # 3, 4 cancelled
    check_counts(state)
    assert [c.cid for c in kinds(actions, sch.Cancel)] == [3, 4]
    assert not state.closures and state.running() == 0
    assert sch.decide(state, sch.Finished(2, "b", "ok"), 0.3) == []  # late answer for a dropped record


def test_starved_queue_fails_and_drops_its_records():
    state = fresh(no_worker_timeout=1.0)
    for cid in (1, 2):
        sch.decide(state, sch.Submit(cid), 0.0)
    sch.decide(state, sch.Tick(), 0.5)
    sch.decide(state, sch.Tick(), 2.0)
    assert not state.closures and state.failed == 2 and state.running() == 0


def test_state_stays_bounded_over_many_closures():
    state = with_workers(fresh(max_inflight=2), "a", "b")
    for cid in range(1, 20_001):
        for action in sch.decide(state, sch.Submit(cid), 0.0):
            if isinstance(action, sch.Dispatch):
                sch.decide(state, sch.Finished(action.cid, action.wid, "ok"), 0.0)
    assert state.completed + len(state.closures) == 20_000
    assert len(state.closures) <= 4 and state.running() <= 4


def test_a_long_queue_does_not_starve_a_second_job_round_robin():
    state = with_workers(fresh(max_inflight=1), "a")
    sch.decide(state, sch.OpenJob("big"), 0.0)
    sch.decide(state, sch.OpenJob("small"), 0.0)
    order = []
    for cid in range(1, 101):  # job big queues 100 closures first
        order += [d.cid for d in kinds(sch.decide(state, sch.Submit(cid, "big"), 0.0), sch.Dispatch)]
    for cid in (1001, 1002, 1003):
        sch.decide(state, sch.Submit(cid, "small"), 0.0)
    while state.closures:
        running = next(iter(state.workers["a"].inflight))
        order += [d.cid for d in kinds(sch.decide(state, sch.Finished(running, "a", "ok"), 0.1), sch.Dispatch)]
    # one worker slot: after the closure already running, the jobs alternate until small is empty
    assert order[:7] == [1, 2, 1001, 3, 1002, 4, 1003]
    assert sorted(order) == list(range(1, 101)) + [1001, 1002, 1003]
    assert state.queue.jobs["big"].completed == 100 and state.queue.jobs["small"].completed == 3


def test_a_user_error_cancels_only_its_own_jobs_queue():
    state = with_workers(fresh(max_inflight=1), "a")
    sch.decide(state, sch.OpenJob("x"), 0.0)
    sch.decide(state, sch.OpenJob("y"), 0.0)
    for cid, job in ((1, "x"), (2, "x"), (3, "y"), (4, "x"), (5, "y")):
        sch.decide(state, sch.Submit(cid, job), 0.0)
    actions = sch.decide(state, sch.Finished(1, "a", "user_error"), 0.1)
    assert [c.cid for c in kinds(actions, sch.Cancel)] == [2, 4]
    assert kinds(actions, sch.Dispatch) == [sch.Dispatch(3, "a", "addr-a", 1)]
    assert state.queue.jobs["x"].error_cid == 1 and state.queue.jobs["y"].error_cid is None
    assert list(state.queue) == [5]


def test_an_idle_job_ends_its_queue_is_cancelled_and_its_record_dropped():
    state = fresh(max_inflight=1, job_idle_timeout=5.0)
    with_workers(state, "a")
    sch.decide(state, sch.OpenJob("gone"), 0.0)
    sch.decide(state, sch.OpenJob("alive"), 0.0)
    for cid in (1, 2, 3):
        sch.decide(state, sch.Submit(cid, "gone"), 0.0)
    sch.decide(state, sch.Heartbeat("a"), 4.0)
    sch.decide(state, sch.KeepJob("alive"), 4.0)
    assert kinds(sch.decide(state, sch.Tick(), 4.0), sch.JobEnded) == []
    sch.decide(state, sch.Heartbeat("a"), 5.5)
    actions = sch.decide(state, sch.Tick(), 5.5)
    assert [c.cid for c in kinds(actions, sch.Cancel)] == [2, 3]  # 1 runs on a and may finish
    assert kinds(actions, sch.JobEnded)[0].job == "gone"
    assert set(state.queue.jobs) == {MAIN, "alive"} and len(state.queue) == 0
    late = sch.decide(state, sch.Submit(4, "gone"), 5.6)
    assert [c.cid for c in kinds(late, sch.Cancel)] == [4] and 4 not in state.closures
    sch.decide(state, sch.Finished(1, "a", "ok"), 5.7)  # the running closure still resolves
    assert not state.closures and state.running() == 0


def test_a_closure_of_an_ended_job_that_loses_its_worker_is_cancelled_not_requeued():
    state = with_workers(fresh(max_inflight=1), "a")
    sch.decide(state, sch.OpenJob("j"), 0.0)
    sch.decide(state, sch.Submit(1, "j"), 0.0)
    sch.decide(state, sch.EndJob("j", "client closed"), 0.1)
    actions = sch.decide(state, sch.TransportFailed(1, "a", "connection reset"), 0.2)
    assert [c.cid for c in kinds(actions, sch.Cancel)] == [1]
    assert not state.closures and len(state.queue) == 0 and state.running() == 0


def test_the_main_job_never_idles_out():
    state = fresh(job_idle_timeout=1.0)
    sch.decide(state, sch.Submit(1), 0.0)
    assert kinds(sch.decide(state, sch.Tick(), 100.0), sch.JobEnded) == []
    assert list(state.queue) == [1]


def test_ended_jobs_are_remembered_for_status_up_to_a_bound():
    state = fresh()
    for n in range(sch.ENDED_JOBS_SHOWN + 3):
        sch.decide(state, sch.OpenJob(f"j{n}"), 0.0)
        sch.decide(state, sch.EndJob(f"j{n}", f"reason {n}"), 0.1)
    assert len(state.ended_jobs) == sch.ENDED_JOBS_SHOWN
    assert state.ended_jobs[-1] == sch.EndedJob(f"j{sch.ENDED_JOBS_SHOWN + 2}", 0, 0, f"reason {sch.ENDED_JOBS_SHOWN + 2}")
    assert set(state.queue.jobs) == {MAIN}
