"""bench/floor.py (the FLOOR benchmark) runs its processes and ends them."""

import multiprocessing

import pytest

from bench import floor


@pytest.mark.parametrize("dispatch", [False, True])
def test_the_floor_trains_steps_and_leaves_no_process_behind(dispatch):
    # with dispatch, a worker steps only on a closure byte: the run ends only if all 40 were sent
    result = floor.w2_floor(steps=40, dispatch=dispatch)
    assert result["steps_per_s"] > 0 and result["worker_cpu_us_per_step"] > 0
    assert multiprocessing.active_children() == []


def test_the_round_trip_floor_times_a_round_trip_and_ends_its_peer():
    result = floor.round_trip_floor(round_trips=200, batches=2)
    assert 0 < result["round_trip_us"] < 1e6 and result["cpu_us"] >= 0
    assert multiprocessing.active_children() == []
