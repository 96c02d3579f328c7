"""The snapshot other threads read, and the per-worker rate meter; fed scheduler states, no sockets."""

import dataclasses

import pytest
from pscluster.coordinator import scheduler as sch
from pscluster.coordinator.snapshot import RateMeter, take


def state_with(*wids):
    state = sch.SchedulerState(max_inflight=2)
    for wid in wids:
        sch.decide(state, sch.Register(wid, f"addr-{wid}"), 0.0)
    return state


def test_a_snapshot_does_not_change_with_the_state_it_was_taken_from():
    state = state_with("a")
    sch.decide(state, sch.Submit(1), 0.0)
    snap = take(state, RateMeter())
    sch.decide(state, sch.Finished(1, "a", "ok"), 0.1)
    sch.decide(state, sch.Register("b", "addr-b"), 0.2)
    assert (snap.running, snap.completed, snap.workers[0].inflight, snap.alive) == (1, 0, (1,), 1)
    assert take(state, RateMeter()).alive == 2
    with pytest.raises(AttributeError):
        snap.completed = 5
    assert not dataclasses.is_dataclass(snap.workers[0]) and isinstance(snap.workers, tuple)


def test_rates_count_completions_in_the_window_and_forget_workers_that_left():
    state = state_with("a", "b")
    meter = RateMeter(window=10.0)
    meter.sample(state, 0.0)
    state.workers["a"].done = 30
    assert meter.rate("a", 30) == 3.0  # 30 closures since the sample at 0 done
    for t in range(1, 13):
        state.workers["a"].done = 30 + t  # one more each second
        meter.sample(state, float(t))
    assert meter.rate("a", state.workers["a"].done) == pytest.approx(1.0)  # window is 2 s .. 12 s
    sch.decide(state, sch.Leave("b"), 12.5)
    meter.sample(state, 13.0)
    assert set(meter._samples) == {"a"}
    assert meter.rate("new", 4) == 0.4  # registered since the last tick, with 0 done then
