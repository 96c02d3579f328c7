"""TensorFlow's Keras tutorial program on pscluster: model.fit with its callbacks, 2 PS + 2 workers.

    python examples/tutorial_mnist.py                          # 12 epochs of 200 steps: held out 0.968-0.972
    python examples/tutorial_mnist.py --backup-dir backup      # kill -9 it mid-run, run it again: it resumes
                                                               # at the epoch and step of the newest checkpoint
    python examples/tutorial_mnist.py --logdir logs            # then: tensorboard --logdir logs

The tutorial's model (Conv2D 32 3x3 relu, Flatten, Dense 128 relu, Dense 10) written in torch, Adam with
the tutorial's `decay` schedule through LearningRateScheduler, its PrintLR callback, TensorBoard,
ModelCheckpoint (one safetensors file per epoch) and BackupAndRestore. The mapping of each tutorial
line to this program's is in docs/from_keras.md. Data: the MNIST digits of examples/mnist.py (4,000
train, 1,000 held out) where the tutorial has 60,000. As under ParameterServerStrategy, steps_per_epoch
is the program's choice over a repeated dataset: 200 minibatches of 64 (the tutorial's epoch is 938).
The 2.8 M-parameter model memorizes 4,000 digits within 3 epochs (training accuracy 1.000) and then holds
0.95 out; moving each training digit by up to 2 pixels (--shift 2, the default; --shift 0 is the
tutorial's plain pipeline) stands in for the missing digits: single-process torch with this model,
schedule and data reaches 0.970 at epoch 4 and 0.972-0.974 from epoch 6 on; this program (asynchronous
Adam on 2 PS + 2 workers) 0.965-0.970 from epoch 5 on and 0.968, 0.970 at the end of two runs (7-8.5 min
at load 7-9 on 2 shared cores, about 400 s of CPU), 0.972 in 4 min 17 s on 2 quiet cores.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
import tempfile

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

import pscluster as ps
import pscluster.torch as ps_torch
from pscluster.ops.launcher import LocalCluster
from pscluster.training import BackupAndRestore, Callback, LearningRateScheduler, ModelCheckpoint, TensorBoard

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from mnist import batches, load_mnist


class TutorialCNN(nn.Module):
    """Conv2D(32, 3, relu) - Flatten - Dense(128, relu) - Dense(10): the tutorial's model, 2.8 M parameters."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(1, 32, 3)
        self.dense = nn.Linear(26 * 26 * 32, 128)
        self.out = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv(x.view(-1, 1, 28, 28)))
        return self.out(F.relu(self.dense(x.flatten(1))))


def decay(epoch: int) -> float:
    """The tutorial's learning-rate schedule."""
    if epoch < 3:
        return 1e-3
    elif epoch >= 3 and epoch < 7:
        return 1e-4
    else:
        return 1e-5


class PrintLR(Callback):
    """The tutorial's callback: print the learning rate at the end of each epoch."""

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        print(f"\nLearning rate for epoch {epoch + 1} is {self.model.learning_rate}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Start a local cluster (restoring backup-dir's checkpoints), fit, print held-out accuracy."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--steps-per-epoch", type=int, default=200, help="closures per epoch, summed over workers")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--shift", type=int, default=2, help="move each training digit by up to this many pixels "
                                                            "(0: the tutorial's plain pipeline, held out ~0.95)")
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--backup-dir", help="PS checkpoints, the callbacks' state and the weights files go here; "
                                             "a rerun with the same directory resumes (default: a temporary one)")
    parser.add_argument("--checkpoint-every-steps", type=int, default=20, help="automatic PS checkpoints")
    parser.add_argument("--logdir", help="TensorBoard event files (default: <backup-dir>/logs)")
    parser.add_argument("--verbose", type=int, default=1, choices=[0, 1, 2])
    parser.add_argument("--min-accuracy", type=float, default=0.96, help="exit non-zero below this")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)

    x_train, y_train, x_test, y_test = load_mnist()
    print(f"MNIST: {len(x_train)} training and {len(x_test)} held-out digits; "
          f"cluster: {args.ps} PS, {args.workers} workers on 127.0.0.1", flush=True)
    with tempfile.TemporaryDirectory(prefix="pscluster-tutorial-") as tmp:
        backup = pathlib.Path(args.backup_dir or pathlib.Path(tmp, "backup")).resolve()
        train_path = str(pathlib.Path(tmp, "train.npz"))
        np.savez(train_path, x=x_train, y=y_train)
        with LocalCluster(args.ps, args.workers, workdir=pathlib.Path(tmp, "cluster"), checkpoint_dir=backup / "ps",
                          restore=True) as cluster:
            print("daemons:", " ".join(str(d.pid) for d in cluster.ps + cluster.workers), flush=True)
            coord = ps.ClusterCoordinator(cluster.settings(checkpoint_every_steps=args.checkpoint_every_steps,
                                                           checkpoint_every_s=None))
            try:
                coord.wait_for_workers(args.workers)
                model = ps_torch.PSModule(coord, TutorialCNN(), ps_torch.Adam(lr=1e-3))
                dataset = coord.create_per_worker_dataset(
                    lambda info: batches(train_path, args.batch, seed=info.worker_index, shift=args.shift))
                callbacks = [
                    TensorBoard(log_dir=args.logdir or backup / "logs"),
                    ModelCheckpoint(filepath=backup / "weights" / "ckpt_{epoch}.safetensors"),
                    LearningRateScheduler(decay),
                    PrintLR(),
                    BackupAndRestore(backup / "callbacks"),
                ]
                history = ps_torch.fit(coord, model, F.cross_entropy, dataset, epochs=args.epochs,
                                       steps_per_epoch=args.steps_per_epoch, metrics=["accuracy"],
                                       validation_data=(x_test, y_test), callbacks=callbacks, verbose=args.verbose)
            finally:
                coord.shutdown()
    acc = history.history["val_accuracy"][-1]
    print(f"held-out test accuracy: {acc:.4f}")
    return 0 if acc >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
