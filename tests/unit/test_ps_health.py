"""PS down/up detection and lost-update accounting, fed events; no sockets, no sleeps, no threads."""

from pscluster.coordinator import ps_health as h
from pscluster.proto import pscluster_pb2 as pb


def healthy(*incarnations, restored_step=0):
    return tuple(h.Seen(i, restored_step) for i in incarnations)


def versions(incarnation, *vs, variable="w"):
    return h.Reported([pb.ShardVersion(variable=variable, shard_index=0, version=v, incarnation=incarnation)
                       for v in vs])


def test_every_ps_answering_as_before_changes_nothing():
    state = h.HealthState([1, 2])
    assert h.decide(state, h.Polled(healthy(1, 2)), 0.0) == []
    assert state.phase == "watching"


def test_a_wake_with_every_ps_healthy_resumes_dispatch_at_once():
    state = h.HealthState([1, 2])
    assert h.decide(state, h.Polled(healthy(1, 2), woken=True), 0.0) == [h.Resume(None)]


def test_a_ps_that_does_not_answer_pauses_dispatch_and_is_asked_again_until_it_does():
    state = h.HealthState([1, 2])
    assert h.decide(state, h.Polled(None), 10.0) == [h.Pause(), h.PollSoon(h.DOWN_POLL_S)]
    assert h.decide(state, h.Polled(None), 10.1) == [h.PollSoon(h.DOWN_POLL_S)]  # paused once, not again
    assert h.decide(state, h.Polled(healthy(1, 2)), 12.5) == [h.Resume(2.5)]
    assert state.phase == "watching"


def test_a_restart_pauses_accounts_the_restarted_ps_then_resumes():
    state = h.HealthState([1, 2])
    actions = h.decide(state, h.Polled((h.Seen(1, 0), h.Seen(7, 40))), 3.0)
    assert actions == [h.Pause(), h.Account(1, 7, 40), h.Resume(0.0)]
    assert state.incarnations == [1, 2]  # accounted only once its restored versions are known


def test_a_ps_down_then_back_restarted_is_accounted_before_dispatch_resumes():
    state = h.HealthState([1])
    h.decide(state, h.Polled(None), 0.0)
    assert h.decide(state, h.Polled(healthy(9, restored_step=5)), 1.0) == [h.Account(0, 9, 5), h.Resume(1.0)]


def test_lost_updates_are_reported_versions_of_the_old_incarnation_beyond_the_restored_one():
    state = h.HealthState([1])
    h.decide(state, versions(1, *range(1, 9)), 0.0)
    assert h.decide(state, h.Restored(0, 5, {("w", 0): 3}), 0.0) == []
    assert state.incarnations == [5]
    assert h.lost_by_variable(state) == {"w": 5}  # versions 4..8
    h.decide(state, versions(1, 10), 0.0)  # a late report of the old incarnation still counts
    assert h.lost_by_variable(state) == {"w": 6}


def test_versions_applied_by_failed_attempts_are_not_lost():
    state = h.HealthState([1])
    h.decide(state, versions(1, 2), 0.0)  # B completed with v2; A pushed v1 and died unreported
    h.decide(state, h.Restored(0, 2, {("w", 0): 0}), 0.0)
    h.decide(state, versions(2, 1), 0.0)  # A re-ran on the new incarnation
    assert h.lost_by_variable(state) == {"w": 1}


def test_a_restart_keeps_only_the_old_incarnations_versions_above_the_restored_one():
    state = h.HealthState([1])
    h.decide(state, versions(1, *range(1, 1001)), 0.0)
    h.decide(state, h.Restored(0, 2, {("w", 0): 1000}), 0.0)
    assert len(state.seen[("w", 0, 1)]) == 0 and h.lost_by_variable(state) == {"w": 0}


def test_failed_checks_back_off_doubling_then_give_up():
    state = h.HealthState([1], max_failures=3)
    error = RuntimeError("ListShards: cannot parse the reply")
    assert h.decide(state, h.CheckFailed(error), 0.0) == [h.Backoff(0.2, 1)]
    assert h.decide(state, h.CheckFailed(error), 0.0) == [h.Backoff(0.4, 2)]
    assert h.decide(state, h.CheckFailed(error), 0.0) == [h.GiveUp(error, 3)]


def test_a_passed_check_resets_the_failure_count_and_backoff_is_capped():
    state = h.HealthState([1], max_failures=100)
    for _ in range(10):
        h.decide(state, h.CheckFailed(RuntimeError()), 0.0)
    assert h.decide(state, h.CheckFailed(RuntimeError()), 0.0)[0].seconds == h.MAX_BACKOFF_S
    h.decide(state, h.CheckPassed(), 0.0)
    assert state.failures == 0


def test_a_failed_check_mid_pause_finds_the_unaccounted_restart_again():
    state = h.HealthState([1])
    h.decide(state, h.Polled(healthy(2)), 0.0)  # Pause, Account(0) ... and the account fails
    h.decide(state, h.CheckFailed(RuntimeError()), 0.0)
    assert h.decide(state, h.Polled(healthy(2)), 1.0) == [h.Pause(), h.Account(0, 2, 0), h.Resume(0.0)]


def test_replicated_a_ps_that_does_not_answer_pauses_nothing_and_a_restart_is_accounted_when_it_answers():
    state = h.HealthState([1, 2], replicated=True)
    assert h.decide(state, h.Polled((None, h.Seen(2, 0))), 0.0) == []
    assert h.decide(state, h.Polled((None, h.Seen(2, 0)), woken=True), 0.0) == [h.Resume(None)]
    assert h.decide(state, h.Polled((h.Seen(5, 3), h.Seen(2, 0))), 1.0) == [h.Account(0, 5, 3)]
    assert state.phase == "watching"


def test_replicated_only_the_shards_whose_copies_both_died_count_as_lost():
    state = h.HealthState([1], replicated=True)
    h.decide(state, versions(1, *range(1, 9)), 0.0)
    h.decide(state, versions(1, *range(1, 5), variable="v"), 0.0)
    h.decide(state, h.ShardRestored(0, 5, "v", 0), 0.0)  # w's backup took over
    h.decide(state, h.Restored(0, 5, {("w", 0): 3, ("v", 0): 0}), 0.0)
    assert h.lost_by_variable(state) == {"v": 4}


def test_replicated_a_shard_lost_at_one_restart_says_nothing_of_an_earlier_one():
    # restart 1 -> 5: w's backup took over (nothing lost); restart 5 -> 6: both copies of w had died
    state = h.HealthState([1], replicated=True)
    h.decide(state, versions(1, *range(1, 9)), 0.0)
    h.decide(state, h.Restored(0, 5, {("w", 0): 0}), 0.0)
    h.decide(state, versions(5, *range(9, 12)), 0.0)
    h.decide(state, h.ShardRestored(0, 6, "w", 0), 0.0)
    h.decide(state, h.Restored(0, 6, {("w", 0): 10}), 0.0)
    assert h.lost_by_variable(state) == {"w": 1}  # version 11 only


def test_replicated_a_lost_shard_counts_what_its_earlier_primaries_acknowledged_not_only_the_restarted_ps():
    # PS 0 (incarnation 1) acknowledged 1..5, failed over to PS 1 (incarnation 2), which acknowledged 6..9; then
    # both died and the shard came back at version 3 on PS 0's restart (incarnation 7): 4..9 are gone
    state = h.HealthState([1, 2], replicated=True)
    h.decide(state, versions(1, *range(1, 6)), 0.0)
    h.decide(state, versions(2, *range(6, 10)), 0.0)
    h.decide(state, h.ShardRestored(0, 7, "w", 0), 0.0)
    h.decide(state, h.Restored(0, 7, {("w", 0): 3}), 0.0)
    assert h.lost_by_variable(state) == {"w": 6}
    # restored on the PS that never acknowledged a version of it: the same six
    state = h.HealthState([1, 2], replicated=True)
    h.decide(state, versions(1, *range(1, 10)), 0.0)
    h.decide(state, h.Restored(1, 8, {("w", 0): 3}), 0.0)  # accounted before the keeper said which shard
    h.decide(state, h.ShardRestored(1, 8, "w", 0), 0.0)
    assert h.lost_by_variable(state) == {"w": 6}


def test_replicated_versions_acknowledged_after_a_restore_count_only_if_a_later_restore_rolls_them_back():
    state = h.HealthState([1, 2], replicated=True)
    h.decide(state, versions(1, *range(1, 10)), 0.0)
    h.decide(state, h.ShardRestored(0, 7, "w", 0), 0.0)
    h.decide(state, h.Restored(0, 7, {("w", 0): 3}), 0.0)  # 4..9 lost
    h.decide(state, versions(7, *range(4, 8)), 0.0)  # the restored shard's own new 4..7
    h.decide(state, versions(2, 8, 9), 0.0)  # a failover to PS 1, which acknowledged 8 and 9
    assert h.lost_by_variable(state) == {"w": 6}
    h.decide(state, h.ShardRestored(1, 9, "w", 0), 0.0)  # both died again; back at 5 on PS 1
    h.decide(state, h.Restored(1, 9, {("w", 0): 5}), 0.0)
    assert h.lost_by_variable(state) == {"w": 6 + 4}  # 6..9 of the second run


def test_version_ranges_union_merges_overlapping_and_adjacent_ranges():
    a, b = h.VersionRanges(), h.VersionRanges()
    for v in (1, 2, 3, 10, 11):
        a.add(v)
    for v in (3, 4, 7, 12):
        b.add(v)
    a.union(b)
    assert len(a) == 3 and a.count_above(0) == 8  # 1..4, 7, 10..12


def test_a_ps_that_joined_the_list_is_first_seen_not_accounted_as_a_restart():
    state = h.HealthState([1, 2], replicated=True)
    assert h.decide(state, h.Polled(healthy(1, 2) + (None,)), 0.0) == []  # joined, not answering yet
    assert state.incarnations == [1, 2]
    assert h.decide(state, h.Polled(healthy(1, 2, 7)), 0.1) == []
    assert state.incarnations == [1, 2, 7]
    assert h.decide(state, h.Polled(healthy(1, 2)), 0.2) == []  # it left the list
    restarted = h.decide(state, h.Polled(healthy(1, 2, 8)), 0.3)  # a later restart of it is accounted
    assert [type(a) for a in restarted] == [h.Account]
