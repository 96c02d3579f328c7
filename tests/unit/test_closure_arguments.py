"""Closure arguments: a step's plain arguments take the standard pickler, anything else cloudpickle."""

import pickle

import cloudpickle
import numpy as np

from pscluster.client.datasets import PerWorkerIterator
from pscluster.client.variables import ShardPlacement, Variable
from pscluster.closures import dumps_arguments


def test_plain_arguments_round_trip_and_match_cloudpickle():
    var = Variable("w", (3,), np.dtype("<f4"), (ShardPlacement(0, 0, 0, 3, 0),), False)
    it = PerWorkerIterator("ds-1", b"fn")
    args, kwargs = (it, [var, var], 3, 0.5, "x", None), {"lr": np.ones(2, np.float32)}
    blob = dumps_arguments(args, kwargs)
    (got_it, got_vars, *rest), got_kwargs = pickle.loads(blob)
    assert (got_it.iterator_id, got_it.fn_bytes) == ("ds-1", b"fn")
    assert got_vars == [var, var] and rest == [3, 0.5, "x", None]
    np.testing.assert_array_equal(got_kwargs["lr"], np.ones(2, np.float32))
    assert blob == pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)


def test_other_arguments_are_pickled_by_value():
    class Local:  # not importable by name: only cloudpickle can carry it
        def __init__(self) -> None:
            self.k = 7

    scale = 3
    blob = dumps_arguments((Local(), lambda v: v * scale), {})
    (obj, fn), _ = cloudpickle.loads(blob)
    assert obj.k == 7 and fn(2) == 6
