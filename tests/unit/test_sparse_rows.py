"""Row gradients made unique before a sparse update (server/rows.py): the same sums as np.add.at."""

from __future__ import annotations

import numpy as np
import pytest
from pscluster.server.rows import HUGE_PAGE, put_rows, take_rows, unique_sum, zeros


def _reference(rows: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    unique, inverse = np.unique(rows, return_inverse=True)
    summed = np.zeros((unique.size,) + grads.shape[1:], grads.dtype)
    np.add.at(summed, inverse, grads)
    return unique, summed


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
@pytest.mark.parametrize("seed", range(4))
def test_duplicate_rows_sum_as_add_at_does(dtype: type, seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 50, 300)
    grads = (rng.standard_normal((300, 3)) * 1e3).astype(dtype)
    got_rows, got = unique_sum(rows, grads)
    want_rows, want = _reference(rows, grads)
    np.testing.assert_array_equal(got_rows, want_rows)
    assert got.dtype == grads.dtype
    # integers exactly; floats to rounding (numpy may add long runs of one row pairwise)
    eps = 0.0 if dtype == np.int64 else float(np.finfo(dtype).eps)
    np.testing.assert_allclose(got, want, rtol=0, atol=20 * eps * float(np.abs(grads).max()))


def test_sorted_unique_rows_pass_through_without_a_copy() -> None:
    rows = np.array([1, 4, 9, 10], np.int64)
    grads = np.arange(8, dtype=np.float32).reshape(4, 2)
    got_rows, got = unique_sum(rows, grads)
    assert got_rows is rows and got is grads


def test_unsorted_unique_rows_come_back_sorted_with_their_gradients() -> None:
    rows = np.array([7, 2, 5], np.int64)
    grads = np.array([[7.0], [2.0], [5.0]], np.float32)
    got_rows, got = unique_sum(rows, grads)
    np.testing.assert_array_equal(got_rows, [2, 5, 7])
    np.testing.assert_array_equal(got[:, 0], [2.0, 5.0, 7.0])


@pytest.mark.parametrize("n", [0, 1])
def test_empty_and_single_row_parts_are_unchanged(n: int) -> None:
    rows = np.arange(n, dtype=np.int64)
    grads = np.ones((n, 4), np.float32)
    got_rows, got = unique_sum(rows, grads)
    assert got_rows.size == n and got.shape == (n, 4)


def test_a_row_repeated_in_a_sorted_batch_is_summed_once() -> None:
    rows = np.array([3, 3, 3, 8], np.int64)
    grads = np.array([[1.0], [2.0], [4.0], [8.0]], np.float32)
    got_rows, got = unique_sum(rows, grads)
    np.testing.assert_array_equal(got_rows, [3, 8])
    np.testing.assert_array_equal(got[:, 0], [7.0, 8.0])


@pytest.mark.parametrize("shape,dtype", [((50, 4), np.float32), ((50, 3, 2), np.float64), ((50,), np.int64),
                                         ((50, 1), np.int8)])
def test_put_and_take_rows_equal_fancy_indexing(shape: tuple[int, ...], dtype: type) -> None:
    rng = np.random.default_rng(7)
    table = (rng.standard_normal(shape) * 100).astype(dtype)
    rows = np.array([0, 3, 17, 49])
    np.testing.assert_array_equal(take_rows(table, rows), table[rows])
    values = (rng.standard_normal((4,) + shape[1:]) * 100).astype(dtype)
    want = table.copy()
    want[rows] = values
    put_rows(table, rows, values)
    np.testing.assert_array_equal(table, want)


def test_put_rows_takes_values_that_are_not_contiguous() -> None:
    table = np.zeros((6, 2), np.float32)
    values = np.arange(8, dtype=np.float32).reshape(2, 4)[:, ::2]  # a strided view
    put_rows(table, np.array([1, 4]), values)
    np.testing.assert_array_equal(table[[1, 4]], [[0, 2], [4, 6]])
    assert not table[[0, 2, 3, 5]].any()


def test_put_rows_of_no_rows_changes_nothing() -> None:
    table = np.ones((3, 2), np.float32)
    put_rows(table, np.array([], np.int64), np.zeros((0, 2), np.float32))
    assert (table == 1).all()


@pytest.mark.parametrize("draw", ["random_int64", "small_ints", "extremes", "clustered_with_outlier", "two", "one"])
def test_argsort_unique_orders_distinct_keys_as_argsort_does(draw: str) -> None:
    """Packed sorting must give np.argsort's order for any distinct int64 keys, including spans that
    need all 64 bits (where keys sharing their high bits are ordered afterwards)."""
    from pscluster.server.rows import argsort_unique

    rng = np.random.default_rng(4)
    keys = {"random_int64": rng.integers(-2**63, 2**63 - 1, 50_000, dtype=np.int64, endpoint=True),
            "small_ints": rng.permutation(70_000)[:50_000] - 10,
            "extremes": np.array([2**63 - 1, -2**63, 0, -1, 1, 2**62, -2**62]),
            "clustered_with_outlier": np.concatenate([rng.permutation(40_000) + 2**40, [-2**63, 2**63 - 1]]),
            "two": np.array([5, -5]), "one": np.array([3])}[draw]
    keys = np.unique(keys.astype(np.int64))[rng.permutation(np.unique(keys).size)]
    np.testing.assert_array_equal(keys[argsort_unique(keys)], np.sort(keys))
    repeated = np.concatenate([keys, keys[::2]])  # repeats come back in their order, as a stable argsort's
    np.testing.assert_array_equal(argsort_unique(repeated), np.argsort(repeated, kind="stable"))


def test_zeros_is_a_zeroed_writable_array_of_either_size() -> None:

    small = zeros((3, 4), np.float32)
    big = zeros((HUGE_PAGE // 8 + 5, 2), np.float64)  # from a mapping advised for huge pages
    for arr, shape, dtype in ((small, (3, 4), np.float32), (big, (HUGE_PAGE // 8 + 5, 2), np.float64)):
        assert arr.shape == shape and arr.dtype == dtype and arr.flags.c_contiguous and arr.flags.writeable
        assert not arr.any()
        arr[-1] = 7.0
        assert arr[-1, -1] == 7.0 and arr.sum() == 7.0 * shape[1]
    assert zeros(0, np.int64).shape == (0,)
