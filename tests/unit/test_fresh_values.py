"""FreshValues: a fused push-pull's values serve one later pull of the same variables, if young enough."""

import time

import numpy as np

from pscluster.client.fresh import FreshValues


def test_values_are_taken_once_all_or_nothing():
    fresh = FreshValues(max_age_s=10)
    a, b = np.ones(3), np.zeros(2)
    fresh.put({"a": a, "b": b})
    got = fresh.take(["a", "b"])
    assert got is not None and got[0] is a and got[1] is b and fresh.served == 1
    assert fresh.take(["a"]) is None  # used once


def test_a_pull_of_a_variable_not_pushed_goes_to_the_ps_and_drops_the_others_it_asked_for():
    fresh = FreshValues(max_age_s=10)
    fresh.put({"a": np.ones(3)})
    assert fresh.take(["a", "c"]) is None
    fresh.put({"c": np.ones(1)})
    assert fresh.take(["a", "c"]) is None  # "a" was dropped: the pull that missed read newer values
    assert fresh.served == 0


def test_values_older_than_max_age_are_not_served():
    fresh = FreshValues(max_age_s=0.05)
    fresh.put({"a": np.ones(3)})
    time.sleep(0.1)
    assert fresh.take(["a"]) is None and fresh.served == 0


def test_a_name_asked_twice_is_not_served_and_clear_forgets_everything():
    fresh = FreshValues(max_age_s=10)
    fresh.put({"a": np.ones(3)})
    assert fresh.take(["a", "a"]) is None
    fresh.put({"a": np.ones(3)})
    fresh.clear()
    assert fresh.take(["a"]) is None
