"""The B11 chaos schedule for 60 s (bench/chaos.py): exact accounting, every value resolved, no growth."""

import pytest

from bench import chaos

pytestmark = pytest.mark.cluster


def test_sixty_second_chaos_soak():
    r = chaos.soak(duration_s=60.0, seed=0, round_size=100)
    assert r["chaos_error"] is None
    # the schedule landed: 5 worker SIGKILLs (10..50 s), SIGSTOPs at 25 and 55 s, PS SIGKILLs at 18 and 42 s
    assert (r["worker_kills"], r["worker_stops"], r["ps_kills"]) == (5, 2, 2)
    assert r["retried"] >= 1 and r["completed"] > 0
    assert (r["unresolved"], r["errors"]) == (0, 0)
    assert r["counter"] == r["completed"] - r["lost_counter_updates"]
    assert r["accuracy"] >= 0.92
    assert set(r["growth"]) == {"ps", "worker", "coordinator"}
    assert r["flat"], r["growth"]
