"""Worker-side gradient screening (pscluster/gradients.py): NaN/Inf refused or skipped before any PS
sees them, and global-norm clipping equal to torch.nn.utils.clip_grad_norm_."""

import math
import pickle

import numpy as np
import pytest
import torch

from pscluster import gradients
from pscluster.client.plans import skip_plan
from pscluster.client.variables import ShardPlacement, Variable
from pscluster.errors import InvalidArgumentError, NonFiniteGradientError
from pscluster.placement import split_rows


def var(name, shape, shards=1):
    rows = split_rows(shape, np.dtype(np.float32), None) if shards == 1 else [shape[0] // shards] * shards
    placements, offset = [], 0
    for i, n in enumerate(rows):
        placements.append(ShardPlacement(i, i % 2, offset, n, i))
        offset += n
    return Variable(name, shape, np.dtype(np.float32), tuple(placements))


W, B = var("w", (4, 3)), var("b", (3,))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_reject_names_the_variable_and_counts_its_bad_values(bad):
    g = np.ones((4, 3), np.float32)
    g[1, 2] = bad
    with pytest.raises(NonFiniteGradientError, match=r"'w' \(1 of 12 values\).*nothing was pushed") as info:
        gradients.screen([(B, np.ones(3, np.float32)), (W, g)])
    assert info.value.variables == ("w",)
    assert isinstance(info.value, InvalidArgumentError)  # INVALID_ARGUMENT, as the PS's own refusal


def test_the_error_pickles_with_its_variable_names():
    err = pickle.loads(pickle.dumps(NonFiniteGradientError("m", ("a", "b"))))
    assert str(err) == "m" and err.variables == ("a", "b")


def test_a_bad_row_gradient_of_a_table_is_caught_too():
    rows = np.ones((2, 3), np.float32)
    rows[0, 0] = np.nan
    with pytest.raises(NonFiniteGradientError, match="'w'"):
        gradients.screen([(B, np.ones(3, np.float32))], [(W, np.array([0, 2]), rows)])


def test_skip_returns_none_and_allow_lets_it_through():
    g = np.full(3, np.nan, np.float32)
    assert gradients.screen([(B, g)], nonfinite="skip") is None
    dense, _ = gradients.screen([(B, g)], nonfinite="allow")
    assert dense[0][1] is g


def test_finite_gradients_pass_unchanged_and_uncopied():
    g = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    dense, rows = gradients.screen([(W, g)], nonfinite="reject")
    assert dense[0][1] is g and rows == []


def test_huge_finite_values_whose_squares_overflow_are_not_taken_for_inf():
    g = np.full(3, 3e30, np.float32)  # its sum of squares overflows float32
    dense, _ = gradients.screen([(B, g)], nonfinite="reject")
    assert dense[0][1] is g


def test_float16_and_integer_gradients_are_checked_or_left_alone():
    with pytest.raises(NonFiniteGradientError):
        gradients.screen([(B, np.array([1.0, np.inf, 0.0], np.float16))])
    dense, _ = gradients.screen([(B, np.array([1, 2, 3], np.int64))])
    assert dense[0][1].dtype == np.int64


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_equals_torch_clip_grad_norm(norm_type, max_norm):
    rng = np.random.default_rng(3)
    arrays = [rng.normal(size=s).astype(np.float32) for s in [(4, 3), (3,), (2, 3)]]
    params = [torch.nn.Parameter(torch.zeros(a.shape)) for a in arrays]
    for p, a in zip(params, arrays):
        p.grad = torch.from_numpy(a.copy())
    want_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type))
    table = var("t", (10, 3))
    dense, rows = gradients.screen([(W, arrays[0]), (B, arrays[1])], [(table, np.array([1, 7]), arrays[2])],
                                   max_norm=max_norm, norm_type=norm_type)
    got = [dense[0][1], dense[1][1], rows[0][2]]
    for g, p in zip(got, params):
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-6)
    _, norm = gradients.clip_by_global_norm(arrays, max_norm, norm_type)
    assert norm == pytest.approx(want_norm, rel=1e-6)
    assert all(np.array_equal(a, p) for a, p in zip(arrays, [arrays[0], arrays[1], arrays[2]]))  # inputs intact


def test_unclipped_entries_are_checked_but_not_scaled_nor_counted_in_the_norm():
    buf = np.full(3, 100.0, np.float32)
    g = np.full((4, 3), 1.0, np.float32)
    dense, _ = gradients.screen([(W, g), (B, buf)], max_norm=1.0, unclipped=1)
    np.testing.assert_allclose(np.linalg.norm(dense[0][1]), 1.0, rtol=1e-5)
    assert dense[1][1] is buf
    with pytest.raises(NonFiniteGradientError, match="'b'"):
        gradients.screen([(W, g), (B, np.full(3, np.nan, np.float32))], max_norm=1.0, unclipped=1)


@pytest.mark.parametrize("kwargs, match", [(dict(nonfinite="drop"), "nonfinite='drop'"),
                                           (dict(max_norm=0.0), "max_norm=0.0"),
                                           (dict(max_norm=float("nan")), "max_norm=nan"),
                                           (dict(max_norm=1.0, norm_type=-1.0), "norm_type=-1.0")])
def test_bad_options_are_refused_with_the_value(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        gradients.screen([(B, np.ones(3, np.float32))], **kwargs)


def test_skip_plan_names_every_shard_once_with_empty_gradients():
    t = var("t", (8, 3), shards=2)
    plan = skip_plan([t, B, t])
    refs = sorted((ps, item.ref.variable, item.ref.shard_index, part.size) for ps, items in plan.items()
                  for item, part in items)
    assert refs == [(0, "b", 0, 0), (0, "t", 0, 0), (1, "t", 1, 0)]
