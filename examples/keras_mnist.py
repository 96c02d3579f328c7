"""The tutorial's Keras 3 model itself (torch backend) trained by pscluster: PSModule + pscluster.torch.fit.

    pip install "pscluster[keras]"
    python examples/keras_mnist.py --epochs 3

With KERAS_BACKEND=torch a Keras 3 model is a torch.nn.Module whose parameters are its variables, so
PSModule holds them on the PS tasks (named by the variables' paths, e.g.
`_functional._torch_params.sequential/dense/kernel`) and pscluster.torch.fit stands in for `model.fit`:
`model.compile` is not called (the optimizer runs on the PS; the loss and metrics are fit's arguments).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported, here and in the daemons

import keras
import numpy as np
import torch
from torch.nn import functional as F  # noqa: N812

import pscluster as ps
import pscluster.torch as ps_torch
from pscluster.training import LearningRateScheduler

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from mnist import batches, load_mnist
from tutorial_mnist import decay


def images(path: str, batch: int, seed: int):
    """The demo's minibatches shaped as Keras's NHWC images."""
    for x, y in batches(path, batch, seed):
        yield x.reshape(-1, 28, 28, 1), y


def main(argv: list[str] | None = None) -> int:
    """Start a local cluster, fit the Keras model, print held-out accuracy."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--steps-per-epoch", type=int, default=62)
    parser.add_argument("--verbose", type=int, default=1, choices=[0, 1, 2])
    parser.add_argument("--min-accuracy", type=float, default=0.9)
    args = parser.parse_args(argv)
    assert keras.backend.backend() == "torch", "pscluster trains Keras 3 models with KERAS_BACKEND=torch"
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_mnist()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    with tempfile.TemporaryDirectory(prefix="pscluster-keras-") as tmp:
        train_path = str(pathlib.Path(tmp, "train.npz"))
        np.savez(train_path, x=x_train, y=y_train)
        with ps.LocalCluster(2, 2, workdir=pathlib.Path(tmp, "cluster")) as cluster:
            coord = ps.ClusterCoordinator(cluster.settings())
            try:
                coord.wait_for_workers(2)
                ps_model = ps_torch.PSModule(coord, model, ps_torch.Adam(lr=1e-3))
                dataset = coord.create_per_worker_dataset(lambda info: images(train_path, 64, info.worker_index))
                history = ps_torch.fit(coord, ps_model, F.cross_entropy, dataset, epochs=args.epochs,
                                       steps_per_epoch=args.steps_per_epoch, metrics=["accuracy"],
                                       validation_data=(x_test.reshape(-1, 28, 28, 1), y_test),
                                       callbacks=[LearningRateScheduler(decay)], verbose=args.verbose)
            finally:
                coord.shutdown()
    acc = history.history["val_accuracy"][-1]
    print(f"held-out test accuracy: {acc:.4f}")
    return 0 if acc >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
