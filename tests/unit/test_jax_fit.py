"""pscluster.jax.fit: Keras's fit for a PSParams pytree, on the real VariableStore through an in-process backend."""

import itertools

import jax.numpy as jnp
import numpy as np

import pscluster.jax as ps_jax
from pscluster.client import context
from pscluster.training import LearningRateScheduler
from tests.unit.test_fit_loop import InPlaceCoordinator
from tests.unit.test_mixed_precision import StoreBackend


def mse(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def test_jax_fit_trains_a_pytree_with_validation_and_a_learning_rate_schedule():
    backend, coord = StoreBackend(), InPlaceCoordinator()
    coord.create_variable = backend.create_variable
    rng = np.random.default_rng(0)
    w_true = rng.standard_normal((3, 1)).astype(np.float32)
    x_val = rng.standard_normal((64, 3)).astype(np.float32)
    batches = ((x, x @ w_true) for x in (rng.standard_normal((16, 3)).astype(np.float32) for _ in itertools.count()))
    model = ps_jax.PSParams(backend, {"w": np.zeros((3, 1), np.float32), "b": np.zeros(1, np.float32)},
                            ps_jax.SGD(0.1))
    with context.ClosureScope(1, client=backend):
        history = ps_jax.fit(coord, model, mse, batches, epochs=3, steps_per_epoch=20,
                             validation_data=(x_val, x_val @ w_true),
                             metrics={"mae": lambda p, x, y: jnp.mean(jnp.abs(x @ p["w"] + p["b"] - y))},
                             callbacks=[LearningRateScheduler(lambda epoch: 0.1 if epoch < 2 else 0.01)], verbose=0)
    assert coord.scheduled == 60 and history.epoch == [0, 1, 2]
    assert history.history["val_loss"][-1] < 0.01 < history.history["loss"][0]
    assert set(history.history) == {"loss", "val_loss", "val_mae", "learning_rate"}
    assert coord.lrs == [(0.01, ["b", "w"])]
