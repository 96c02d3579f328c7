"""The sync token queue and bounded-staleness clocks, fed events; no sockets, no sleeps, no threads."""

import json

import pytest
from pscluster.server import sync_tokens as tok

from pscluster.errors import InvalidArgumentError


def configured(mode, r=1, n=1, staleness=0):
    state = tok.TokenState()
    assert tok.decide(state, tok.Configure(mode, r, n, staleness), 0.0) == [tok.WakeWaiters()]
    return state


def take(state, cid, g=0, worker="", now=0.0):
    [answer] = tok.decide(state, tok.TakeToken(cid, worker, g), now)
    return answer


def retry(state, cid, g=0, worker="", now=0.0, mode=None):
    [answer] = tok.decide(state, tok.RetryToken(cid, worker, g, mode or state.mode), now)
    return answer


def done(state, cid, step, g, worker="", now=0.0):
    return tok.decide(state, tok.StepDone(cid, step, worker, g), now)


def test_async_grants_every_take_at_g_and_every_report_advances_g():
    state = tok.TokenState()
    assert take(state, 1, g=7) == tok.Grant(1, 7, 0)
    assert take(state, 2, g=7) == tok.Grant(2, 7, 0)
    assert done(state, 1, 7, g=7) == [tok.Advance(8)]
    assert state.tokens == {}  # async keeps nothing per closure


def test_sync_hands_out_n_tokens_per_step_then_makes_takers_wait():
    state = configured("sync", 2, 3)
    assert [take(state, c) for c in (1, 2, 3)] == [tok.Grant(1, 0, 0), tok.Grant(2, 0, 1), tok.Grant(3, 0, 2)]
    wait = take(state, 4)
    assert wait == tok.AwaitTokens(4, 0, out=3, reported=0, needed=2)
    assert wait.poll is None  # a report notifies: no polling
    assert wait.refusal(0.5) == "no sync token for step 0 within 0.5 s: all 3 are out and 0 of 2 replicas reported"


def test_sync_advances_g_after_r_reports_and_releases_the_next_steps_tokens():
    state = configured("sync", 2, 3)
    for c in (1, 2, 3):
        take(state, c)
    assert done(state, 1, 0, g=0) == []
    assert take(state, 4) == tok.AwaitTokens(4, 0, 3, 1, 2)
    assert done(state, 2, 0, g=0) == [tok.Advance(1)]
    assert retry(state, 4, g=1) == tok.Grant(4, 1, 0)
    assert state.done == {} and 0 not in state.tokens.values()  # step 0's reports are forgotten


def test_a_backups_late_report_changes_nothing():
    state = configured("sync", 2, 3)
    for c in (1, 2, 3):
        take(state, c)
    done(state, 1, 0, g=0)
    done(state, 2, 0, g=0)
    assert done(state, 3, 0, g=1) == []
    assert state.done == {}


def test_a_repeated_report_of_one_closure_counts_once():
    state = configured("sync", 2, 2)
    take(state, 1)
    take(state, 2)
    assert done(state, 1, 0, g=0) == []
    assert done(state, 1, 0, g=0) == []  # a retried StepDone
    assert done(state, 2, 0, g=0) == [tok.Advance(1)]


def test_a_rescheduled_sync_closure_gets_its_token_back_even_when_all_are_out():
    state = configured("sync", 2, 2)
    assert take(state, 1) == tok.Grant(1, 0, 0)
    assert take(state, 2) == tok.Grant(2, 0, 1)
    assert take(state, 1) == tok.Grant(1, 0, 0)
    assert state.issued == {0: 2}


def test_a_token_of_an_older_step_is_not_handed_back():
    state = configured("sync", 1, 1)
    take(state, 1)
    done(state, 2, 0, g=0)  # another closure made step 0
    assert take(state, 1, g=1) == tok.Grant(1, 1, 0)


def test_reconfiguring_forgets_tokens_and_reports_and_wakes_waiters():
    state = configured("sync", 1, 1)
    take(state, 1)
    assert tok.decide(state, tok.Configure("sync", 1, 1, 0), 0.0) == [tok.WakeWaiters()]
    assert state.issued == {} and state.tokens == {} and state.done == {}
    assert take(state, 2) == tok.Grant(2, 0, 0)


def test_configure_keeps_r_at_least_one_and_n_at_least_r():
    state = configured("bounded", 0, 0, 2)
    assert (state.replicas_to_aggregate, state.total_num_replicas, state.staleness) == (1, 1, 2)


def test_a_waiter_keeps_the_rules_its_wait_began_with():
    state = configured("sync", 1, 1)
    take(state, 1)
    assert take(state, 2) == tok.AwaitTokens(2, 0, 1, 0, 1)
    tok.decide(state, tok.Configure("async", 1, 1, 0), 0.0)
    assert retry(state, 2, mode="sync") == tok.Grant(2, 0, 0)  # a sync grant: issued and recorded
    assert state.tokens == {2: (0, 0)}


def test_bounded_holds_a_worker_more_than_staleness_steps_ahead_of_the_slowest():
    state = configured("bounded", staleness=1)
    assert take(state, 1, worker="slow") == tok.Grant(1, 0, 0)
    for cid in (2, 3):
        assert take(state, cid, worker="fast").step == cid - 2
        done(state, cid, cid - 2, g=0, worker="fast")
    wait = take(state, 4, worker="fast")
    assert wait == tok.AwaitSlowest(4, "fast", ahead=2, staleness=1)
    assert wait.poll == tok.BOUNDED_POLL_S  # leases expire without a notify
    assert wait.refusal(1.0) == "worker fast is 2 steps ahead of the slowest (staleness 1) after waiting 1.0 s"
    done(state, 1, 0, g=0, worker="slow")
    assert retry(state, 4, worker="fast") == tok.Grant(4, 2, 0)
    assert state.max_spread == 1


def test_bounded_counts_steps_begun_so_closures_in_flight_on_one_worker_count():
    state = configured("bounded", staleness=1)
    take(state, 1, worker="slow")
    assert take(state, 2, worker="fast") == tok.Grant(2, 0, 0)
    assert take(state, 3, worker="fast") == tok.Grant(3, 1, 0)
    assert isinstance(take(state, 4, worker="fast"), tok.AwaitSlowest)
    assert take(state, 3, worker="fast") == tok.Grant(3, 1, 0)  # a rescheduled closure gets its token back


def test_a_bounded_newcomer_starts_level_with_the_slowest_live_worker():
    state = configured("bounded", staleness=0)
    state.clocks.update(a=5, b=3)
    state.started.update(a=5, b=3)
    state.last_seen.update(a=0.0, b=0.0)
    assert take(state, 1, worker="new", now=1.0) == tok.Grant(1, 3, 0)
    assert state.clocks["new"] == 3 and state.started["new"] == 4


def test_a_bounded_worker_not_seen_for_a_lease_stops_holding_the_others_back():
    state = configured("bounded", staleness=1)
    take(state, 1, worker="idle")
    done(state, 1, 0, g=0, worker="idle")
    for cid in (2, 3):
        take(state, cid, worker="busy")
        done(state, cid, 0, g=0, worker="busy")
    assert isinstance(take(state, 4, worker="busy", now=0.0), tok.AwaitSlowest)
    later = tok.WORKER_LEASE_S + 0.5  # its wait ran out; the closure comes back and asks afresh
    assert take(state, 4, worker="busy", now=later) == tok.Grant(4, 3, 0)
    assert tok.min_clock(state, later) == 3


def test_a_lone_waiter_whose_lease_ran_out_is_measured_against_its_own_clock():
    # the end of a run: "slow" went idle, "fast" waits for it; both leases run out while it waits
    state = configured("bounded", staleness=1)
    take(state, 1, worker="slow", now=0.0)
    done(state, 1, 0, g=0, worker="slow", now=0.0)
    for cid in (2, 3, 4):
        take(state, cid, worker="fast", now=0.0)
        done(state, cid, cid - 2, g=0, worker="fast", now=0.0)
    assert isinstance(take(state, 5, worker="fast", now=0.0), tok.AwaitSlowest)  # 3 vs slow's 1
    later = tok.WORKER_LEASE_S + 0.5
    # not a wait for a clock of 0 until the take times out (30 s): fast is the one live worker
    assert retry(state, 5, worker="fast", now=later) == tok.Grant(5, 3, 0)


def test_a_retry_does_not_renew_the_waiting_workers_lease():
    state = configured("bounded", staleness=0)
    take(state, 1, worker="slow", now=0.0)
    take(state, 2, worker="fast", now=0.0)
    done(state, 2, 0, g=0, worker="fast", now=0.0)
    take(state, 3, worker="fast", now=0.0)
    assert isinstance(retry(state, 3, worker="fast", now=1.0), tok.AwaitSlowest)
    assert state.last_seen["fast"] == 0.0


def test_bounded_reports_advance_the_reporting_workers_clock_and_release_its_token():
    state = configured("bounded", staleness=3)
    take(state, 1, worker="w")
    assert done(state, 1, 0, g=4, worker="w", now=2.0) == [tok.Advance(5)]
    assert state.clocks["w"] == 1 and state.last_seen["w"] == 2.0 and 1 not in state.tokens
    take(state, 9, worker="")
    assert done(state, 9, 0, g=5, worker="") == [tok.Advance(6)]  # an anonymous report only advances G
    assert state.clocks["w"] == 1


def test_a_bounded_closure_handed_back_and_run_on_another_worker_counts_for_the_worker_it_began_on():
    # w1 took tokens for closures 1 and 2, then handed them back (a PS's connection dropped); w2 ran them
    state = configured("bounded", staleness=1)
    take(state, 1, worker="w1")
    take(state, 2, worker="w1")
    take(state, 3, worker="w2")
    assert take(state, 1, worker="w2") == tok.Grant(1, 0, 0)  # its token back, on the other worker
    done(state, 1, 0, g=0, worker="w2")
    done(state, 2, 1, g=1, worker="w2")
    assert state.clocks == {"w1": 2, "w2": 0} and state.started == {"w1": 2, "w2": 1}
    # so w1 is not left 2 steps begun and never done, holding itself back for good once w2 goes idle
    assert take(state, 4, worker="w1", now=10.0) == tok.Grant(4, 2, 0)


def test_a_bounded_report_retried_after_its_reply_was_lost_counts_once():
    # the first report reached the old primary and its backup; the retry lands on the promoted backup
    state = configured("bounded", staleness=3)
    take(state, 1, worker="w")
    assert done(state, 1, 0, g=0, worker="w") == [tok.Advance(1)]
    assert done(state, 1, 0, g=1, worker="w") == []
    assert state.clocks == {"w": 1}


def test_the_wire_form_carries_the_whole_state_and_g_and_last_seen_as_ages():
    state = configured("sync", 2, 3)
    take(state, 1)
    take(state, 2)
    done(state, 1, 0, g=0)
    state.clocks, state.started, state.last_seen = {"w": 3}, {"w": 4}, {"w": 10.0}
    wire = json.loads(json.dumps(tok.to_wire(state, 7, now=12.5)))
    copy, g = tok.from_wire(wire, now=100.0)
    assert g == 7 and copy.last_seen == {"w": 97.5}
    copy.last_seen = state.last_seen
    assert copy == state
    # the backup, promoted, goes on where the primary was: the third token, then the step completes
    assert take(copy, 3) == tok.Grant(3, 0, 2)
    assert done(copy, 2, 0, g=0) == [tok.Advance(1)]


def test_a_malformed_wire_state_is_refused_by_name():
    for bad in (None, {"mode": "sync"}, {**tok.to_wire(tok.TokenState(), 0, 0.0), "tokens": [[1, 2]]},
                {**tok.to_wire(tok.TokenState(), 0, 0.0), "mode": "eager"}):
        with pytest.raises(InvalidArgumentError, match="replicated sync state is malformed"):
            tok.from_wire(bad, 0.0)


def test_a_backups_own_configure_takes_the_settings_and_keeps_the_forwarded_tokens():
    state = configured("sync", 2, 2)
    take(state, 1)
    tok.reconfigure(state, tok.Configure("sync", 2, 3, 0))
    assert state.tokens == {1: (0, 0)} and state.issued == {0: 1} and state.total_num_replicas == 3


def test_reports_fed_before_a_take_let_it_through_in_the_same_change():
    # the executor's take that carries earlier closures' reports (TokenRequest.reports): StepDone events,
    # then the take, under one lock: the report that completes the step releases the next step's token
    state = configured("sync", 2, 2)
    assert take(state, 1) == tok.Grant(1, 0, 0) and take(state, 2) == tok.Grant(2, 0, 1)
    assert done(state, 1, 0, g=0) == []
    assert isinstance(take(state, 3), tok.AwaitTokens)  # without the second report: all tokens out
    assert done(state, 2, 0, g=0) == [tok.Advance(1)]
    assert take(state, 3, g=1) == tok.Grant(3, 1, 0)
    # a retry of the combined call after a failover: the reports count once, the take gets its token back
    assert done(state, 1, 0, g=1) == [] and done(state, 2, 0, g=1) == []
    assert take(state, 3, g=1) == tok.Grant(3, 1, 0)
    assert state.issued[1] == 1


def test_sync_counts_a_report_only_from_a_closure_holding_a_token_of_its_step():
    state = configured("sync", 2, 2)
    assert take(state, 1) == tok.Grant(1, 0, 0)
    assert done(state, 9, 0, g=0) == []  # no token: a resend of an earlier job's report (ConfigureSync cleared it)
    assert done(state, 1, 0, g=0) == [] and state.done == {0: {1}}
    assert tok.decide(state, tok.Configure("sync", 2, 2, 0), 0.0) == [tok.WakeWaiters()]
    assert done(state, 1, 0, g=0) == [] and state.done == {}  # its token went with the reconfigure
    assert take(state, 2) == tok.Grant(2, 0, 0) and take(state, 3) == tok.Grant(3, 0, 1)
    assert done(state, 2, 0, g=0) == [] and done(state, 3, 0, g=0) == [tok.Advance(1)]
