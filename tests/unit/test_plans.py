"""Pull and push plans: which item goes to which PS task, and which view of the caller's array it fills."""

import numpy as np
import pytest

from pscluster.client import plans
from pscluster.client.variables import ShardPlacement, Variable
from pscluster.errors import InvalidArgumentError

W = Variable("w", (6, 2), np.dtype(np.float32), (ShardPlacement(0, 0, 0, 4, 0), ShardPlacement(1, 1, 4, 2, 1)))
B = Variable("b", (3,), np.dtype(np.float32), (ShardPlacement(0, 1, 0, 3, 2),))


def test_a_pull_plan_fills_views_of_the_callers_arrays_one_request_per_ps():
    w, b = np.zeros((6, 2), np.float32), np.zeros(3, np.float32)
    plan, scatter = plans.pull_plan([(W, w), (B, b)])
    assert sorted(plan) == [0, 1] and not scatter
    assert [i.ref.variable for i, _ in plan[1]] == ["w", "b"]
    plan[0][0][1][...] = 7  # the PS's bytes land straight in w's rows 0-3
    plan[1][0][1][...] = 9
    assert (w[:4] == 7).all() and (w[4:] == 9).all()


def test_unsorted_row_ids_pull_into_a_part_scattered_afterwards():
    out = np.zeros((3, 2), np.float32)
    plan, scatter = plans.pull_plan([], rows=[(W, np.array([5, 0, 4]), out)])
    assert sorted(plan) == [0, 1] and len(scatter) == 1  # rows 5 and 4 of shard 1 are not a run of out


def test_a_fused_push_plan_allocates_each_value_once_and_targets_its_shard_rows():
    plan, targets, values = plans.push_plan([(W, np.ones((6, 2))), (B, np.ones(3, np.float32))], with_values=True)
    assert plan[0][0][1].dtype == np.float32  # float64 numpy math cast to the variable's dtype
    assert [len(plan[0]), len(plan[1])] == [len(targets[0]), len(targets[1])] == [1, 2]
    targets[1][0][...] = 3
    assert (values["w"][4:] == 3).all() and set(values) == {"w", "b"}


@pytest.mark.parametrize("bad", [
    lambda: plans.pull_plan([("w", np.zeros((6, 2), np.float32))]),
    lambda: plans.pull_plan([(W, np.zeros((6, 2), np.float64))]),
    lambda: plans.pull_plan([(W, np.zeros((2, 6), np.float32).T)]),
    lambda: plans.push_plan([(W, np.ones((5, 2)))]),
    lambda: plans.push_plan([W]),
    lambda: plans.push_plan([], rows=[(W, np.array([6]), np.ones((1, 2)))]),
    lambda: plans.check_ids(B, np.array([[0]])),
])
def test_bad_input_is_an_invalid_argument(bad):
    with pytest.raises(InvalidArgumentError):
        bad()


def test_push_items_carry_each_part_dtype_and_shape():
    f4 = np.dtype("<f4")
    var = Variable("w", (4, 2), f4, (ShardPlacement(0, 0, 0, 2, 0), ShardPlacement(1, 1, 2, 2, 1)), False)
    plan, _, _ = plans.push_plan([(var, np.ones((4, 2), np.float64))])  # float64 math into a float32 variable
    for ps in (0, 1):
        (item, part), = plan[ps]
        assert (item.grad.dtype, tuple(item.grad.shape), item.grad.data) == ("<f4", (2, 2), b"")
        assert part.dtype == f4
    ints = Variable("n", (3,), np.dtype("<i8"), (ShardPlacement(0, 0, 0, 3, 0),), False)
    plan, _, _ = plans.push_plan([(ints, np.ones(3, np.int32))])  # not converted: the PS names the mismatch
    assert plan[0][0][0].grad.dtype == "<i4"


def test_plain_results_pickle_like_cloudpickle():
    import pickle

    import cloudpickle

    from pscluster.closures import dumps as dumps_result

    for value in (0.25, 3, True, "loss", b"x", None, [1.0, 2.0], {"a": np.float32(1)}):
        assert pickle.loads(dumps_result(value)) == value
    assert dumps_result(0.25) == cloudpickle.dumps(0.25)


def test_payloads_leave_little_endian_and_contiguous_copying_only_when_needed():
    from pscluster.net.bulk import _wire

    ready = np.arange(6, dtype="<f4").reshape(2, 3)
    assert _wire(ready) is ready
    swapped = _wire(np.arange(4, dtype=">i8"))
    assert swapped.dtype.str == "<i8" and swapped.tolist() == [0, 1, 2, 3]
    strided = _wire(np.arange(8, dtype="<f4").reshape(2, 4)[:, :2])
    assert strided.flags.c_contiguous and strided.tolist() == [[0, 1], [4, 5]]
