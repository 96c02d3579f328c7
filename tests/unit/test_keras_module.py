"""A Keras 3 model (torch backend) is a torch module PSModule can hold: parameters found by position, named by
the variables' paths, pulled into the Keras variables in place, pushed, and loaded back into the model."""

import os

os.environ["KERAS_BACKEND"] = "torch"  # read when keras is first imported

import keras
import numpy as np
import pytest
import torch

import pscluster.torch as ps_torch
from pscluster.client import context
from pscluster.optimizers import SGD
from tests.unit.test_mixed_precision import StoreBackend

# keras's torch backend converts tensors with np.array(tensor), which numpy 2 deprecates (keras's, not ours)
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")


def test_a_keras_3_model_trains_through_psmodule_and_loads_its_state_back():
    assert keras.backend.backend() == "torch"
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(3)])
    backend = StoreBackend()
    ps_model = ps_torch.PSModule(backend, model, SGD(0.5))
    assert all(name.endswith(("kernel", "bias")) for name in ps_model.variables)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    with context.ClosureScope(1, client=backend):
        replica = ps_model.pull()
        before = {n: backend.store.get((n, 0)).value.copy() for n in ps_model.variables}
        loss = torch.nn.functional.cross_entropy(replica(x), y)
        ps_model.backward(loss)
        ps_model.push()
        grads = [p.grad.numpy() for p in replica.parameters()]
        state = ps_model.state_dict()
    for (name, value), grad in zip(before.items(), grads):
        np.testing.assert_allclose(backend.store.get((name, 0)).value, value - 0.5 * grad, rtol=1e-6)
    model.load_state_dict(state)
    np.testing.assert_array_equal(model.layers[-1].kernel.value.detach().numpy(), state[list(state)[-1]].numpy())
