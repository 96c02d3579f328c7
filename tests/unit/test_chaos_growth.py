"""The soak's growth check: a resource that stays raises the late figure, a momentary one does not."""

from bench.chaos import growth


def _samples(role: str, threads: list[tuple[float, int]]) -> list[tuple[float, str, tuple[int, int, int]]]:
    return [(t, role, (n, 20, 100 * 1024)) for t, n in threads]


def test_a_thread_alive_for_one_sample_is_not_growth():
    g = growth(_samples("coordinator", [(0.2, 24), (0.25, 24), (0.93, 25), (0.96, 24)]))
    assert g["coordinator"]["threads_late"] <= g["coordinator"]["threads_early"]


def test_a_thread_that_stays_is_growth():
    g = growth(_samples("coordinator", [(0.2, 24), (0.25, 24), (0.93, 26), (0.96, 25)]))
    assert g["coordinator"]["threads_late"] > g["coordinator"]["threads_early"]


def test_a_role_without_early_or_late_samples_is_left_out():
    assert growth(_samples("ps", [(0.5, 18), (0.95, 18)])) == {}
