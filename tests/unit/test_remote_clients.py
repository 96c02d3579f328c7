"""What the coordinator daemon keeps for remote clients, and its cap on long polls; no sockets."""

import pytest
from pscluster.coordinator.clients import LongPolls, RetainedValues
from pscluster.coordinator.values import RemoteValue

from pscluster.errors import ResourceExhaustedError, UnavailableError


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def finished(cid):
    value = RemoteValue(cid)
    value._set_error(UnavailableError("done"))
    return value


def test_a_fetched_result_is_dropped_at_once():
    retained = RetainedValues(ttl=60.0, clock=Clock())
    retained.add(finished(1))
    retained.release(1)
    assert len(retained) == 0


def test_an_unfetched_result_expires_ttl_after_it_finished_and_a_running_one_never():
    clock = Clock()
    retained = RetainedValues(ttl=10.0, clock=clock)
    running, done = RemoteValue(1), RemoteValue(2)
    retained.add(running)
    retained.add(done)
    clock.now = 5.0
    done._set_error(UnavailableError("finished at 5 s"))
    retained.touch(2)
    clock.now = 14.0
    retained.add(finished(3))  # every add or touch expires what is due
    assert len(retained) == 3  # 2 finished 9 s ago; 1 still runs
    clock.now = 16.0
    retained.touch(3)
    assert len(retained) == 2  # 2 expired; 1 is kept although scheduled 16 s ago: it has not finished
    running._set_error(UnavailableError("finished at 30 s"))
    clock.now = 30.0
    retained.touch(1)
    clock.now = 45.0
    retained.add(finished(4))
    assert len(retained) == 1  # only 4 is left


def test_retained_values_stay_bounded_when_clients_never_fetch():
    clock = Clock()
    retained = RetainedValues(ttl=10.0, clock=clock)
    for cid in range(10_000):
        clock.now = cid * 0.01  # 100 closures per second, each finished when added
        retained.add(finished(cid))
    assert len(retained) <= 1001


def test_long_polls_beyond_the_cap_are_refused_and_waits_are_sliced():
    polls = LongPolls(limit=2, slice_s=2.0)
    with polls.slot(30.0) as first, polls.slot(1.0) as second:
        assert (first, second) == (2.0, 1.0)
        with pytest.raises(ResourceExhaustedError, match="poll again"):
            with polls.slot(5.0):
                pass
        with polls.slot(0.0) as immediate:  # a non-waiting poll needs no slot
            assert immediate == 0.0
    with polls.slot(5.0) as again:  # slots are given back
        assert again == 2.0


def _public(cls):
    return {name for name in dir(cls) if not name.startswith("_")
            and (callable(getattr(cls, name)) or isinstance(getattr(cls, name), property))}


def test_remote_coordinator_offers_every_public_method_of_cluster_coordinator():
    from pscluster.coordinator.api import CLIENT_SIDE, DAEMON_SIDE
    from pscluster.coordinator.coordinator import ClusterCoordinator
    from pscluster.coordinator.remote import RemoteCoordinator

    embedded, remote = _public(ClusterCoordinator), _public(RemoteCoordinator)
    assert embedded - DAEMON_SIDE == remote - CLIENT_SIDE
    assert DAEMON_SIDE <= embedded and not (CLIENT_SIDE & embedded)
    for name in ("checkpoint", "configure_sync", "sync_stats", "wait_for_workers", "lost_updates", "shutdown",
                 "global_step", "num_workers", "status"):
        assert name in remote
    for cls in (ClusterCoordinator, RemoteCoordinator):
        assert cls.__enter__ is not object.__dict__.get("__enter__") and hasattr(cls, "__exit__")


def test_each_job_joins_its_own_closures_reports_the_real_closure_id_once_and_is_dropped_when_it_ends():
    from pscluster.coordinator.joins import JobJoins

    from pscluster.errors import AbortedError, NotFoundError

    reported = []
    joins = JobJoins(on_error_reported=reported.append)
    joins.open("a")
    joins.open("b")
    joins.get("a").add()
    joins.get("b").add()
    error = ValueError("bad batch")
    joins.settle("a", 1, (42, error))
    joins.settle("b", 1, None)
    assert joins.get("b").poll(0) is None  # b never sees a's error
    assert joins.get("a").poll(0) == (42, error) and reported == ["a"]
    assert joins.get("a").poll(0) is None  # reported once
    waiting = joins.get("a")
    waiting.add()
    joins.end("a", AbortedError("job a ended: no keepalive"))
    assert len(joins) == 1
    with pytest.raises(AbortedError, match="job a ended"):
        waiting.wait(0)
    with pytest.raises(NotFoundError, match="no job 'a'"):
        joins.get("a")
    joins.settle("a", 1, None)  # a late closure of the ended job changes nothing
    assert len(joins) == 1
