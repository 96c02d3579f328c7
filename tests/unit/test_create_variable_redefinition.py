"""create_variable on a name that exists (pscluster/client/variables.py `refuse_redefinition`): the same
definition finds the variable again; another shape, dtype, sharding or optimizer is refused and names both.

Before: a different optimizer was not compared at all: the call returned the existing variable (trained by
the other optimizer) without a word.
"""

from __future__ import annotations

import numpy as np
import pytest

from pscluster.client.variables import ShardPlacement, Variable, refuse_redefinition
from pscluster.errors import AlreadyExistsError
from pscluster.optimizer_config import OptimizerConfig

F4 = np.dtype("<f4")
W = Variable("w", (4, 2), F4, (ShardPlacement(0, 0, 0, 4, 0),))


def test_the_same_definition_is_found_again_even_after_a_driver_changed_the_rate():
    refuse_redefinition(W, OptimizerConfig("adam", 0.001), (4, 2), F4, "", 1, OptimizerConfig("adam", 0.01))
    refuse_redefinition(W, None, (4, 2), F4, "", 1, OptimizerConfig("sgd", 1.0))  # optimizer not known here


def test_another_optimizer_is_refused_naming_both():
    with pytest.raises(AlreadyExistsError, match="exists with optimizer 'adam'; cannot re-create it with 'sgd'"):
        refuse_redefinition(W, OptimizerConfig("adam", 0.001), (4, 2), F4, "", 1, OptimizerConfig("sgd", 0.001))


def test_another_optimizer_structure_of_the_same_kind_is_refused_naming_the_field():
    with pytest.raises(AlreadyExistsError, match=r"'sgd' \(nesterov=True\)"):
        refuse_redefinition(W, OptimizerConfig("sgd", 0.1, nesterov=False), (4, 2), F4, "", 1,
                            OptimizerConfig("sgd", 0.1, nesterov=True))


@pytest.mark.parametrize("shape, dtype, shards", [((5, 2), F4, 1), ((4, 2), np.dtype("<f8"), 1), ((4, 2), F4, 2)])
def test_another_shape_dtype_or_sharding_is_refused(shape, dtype, shards):
    with pytest.raises(AlreadyExistsError, match="cannot redefine"):
        refuse_redefinition(W, OptimizerConfig(), shape, dtype, "", shards, OptimizerConfig())
