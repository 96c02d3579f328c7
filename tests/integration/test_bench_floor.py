"""bench/floor.py (the FLOOR benchmark) runs its four processes and ends them."""

import multiprocessing

from bench import floor


def test_the_floor_trains_steps_and_leaves_no_process_behind():
    result = floor.w2_floor(steps=40)
    assert result["steps_per_s"] > 0 and result["worker_cpu_us_per_step"] > 0
    assert multiprocessing.active_children() == []
