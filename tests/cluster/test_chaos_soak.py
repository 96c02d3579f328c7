"""The B11 chaos schedule for 40 s (bench/chaos.py; B11 runs it 10 min): exact accounting, every value resolved,
no growth."""

import pytest

from bench import chaos

pytestmark = pytest.mark.cluster


def test_forty_second_chaos_soak():
    r = chaos.soak(duration_s=40.0, seed=0, round_size=100)
    assert r["chaos_error"] is None
    # the schedule landed: 3 worker SIGKILLs (10, 20, 30 s), a SIGSTOP at 25 s, PS SIGKILLs at 12 and 28 s
    assert (r["worker_kills"], r["worker_stops"], r["ps_kills"]) == (3, 1, 2)
    assert r["retried"] >= 1 and r["completed"] > 0
    assert (r["unresolved"], r["errors"]) == (0, 0)
    assert r["counter"] == r["completed"] - r["lost_counter_updates"]
    assert r["accuracy"] >= 0.92
    assert set(r["growth"]) == {"ps", "worker", "coordinator"}
    assert r["flat"], r["growth"]
