"""A schedule on the PS plus a driver's ReduceLROnPlateau: linear regression on a local cluster (1 PS, 2 workers).

    python examples/plateau_schedule.py --epochs 8

The weights train with AdamW under a warmup (the rate rises over the first 20 updates, evaluated on
the PS at each update). After each epoch the driver pulls the weights, measures the held-out loss,
and feeds it to ps.ReduceLROnPlateau, which halves the rate through coord.set_learning_rate when the
loss stops improving: every PS applies it from its next update and keeps it in its checkpoints.
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import numpy as np

import pscluster as ps
from pscluster.ops.launcher import LocalCluster

DIM = 32


def make_data(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """y = x @ w_true + noise, the same w_true for every seed."""
    w_true = np.random.default_rng(0).normal(size=(DIM, 1)).astype(np.float32)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    return x, x @ w_true + 0.1 * rng.normal(size=(n, 1)).astype(np.float32)


def batches(seed: int, batch: int = 64):
    """Endless minibatches of this worker's own data."""
    x, y = make_data(100 + seed, 4096)
    rng = np.random.default_rng(seed)
    while True:
        idx = rng.integers(0, len(x), batch)
        yield x[idx], y[idx]


def make_step(w: ps.Variable):
    """A closure: pull, the mean-squared-error gradient on a batch, push; returns the batch loss."""

    def step(iterator) -> float:
        x, y = next(iterator)
        err = x @ ps.pull([w])[0] - y
        ps.push([(w, (2.0 / len(x)) * x.T @ err)])
        return float((err ** 2).mean())

    return step


def main() -> None:
    """Train, evaluate after each epoch, lower the rate on a plateau."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--steps-per-epoch", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    x_eval, y_eval = make_data(1, 2048)
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(1, 2, workdir=tmp) as cluster:
        coord = ps.ClusterCoordinator(cluster.settings())
        try:
            coord.wait_for_workers(2)
            warmup = ps.schedules.LinearWarmup(args.lr, warmup_steps=20)
            w = coord.create_variable("w", shape=(DIM, 1), dtype=np.float32,
                                      optimizer=ps.AdamW(warmup, weight_decay=1e-4))
            data = coord.create_per_worker_dataset(lambda info: batches(info.worker_index))
            iterator = iter(data)
            plateau = ps.ReduceLROnPlateau(coord, args.lr, mode="min", factor=0.5, patience=1, threshold=0.05)
            step = make_step(w)
            for epoch in range(args.epochs):
                for _ in range(args.steps_per_epoch):
                    coord.schedule(step, args=(iterator,))
                coord.join()
                eval_loss = float(((x_eval @ w.pull() - y_eval) ** 2).mean())
                lr = plateau.step(eval_loss)
                print(f"epoch {epoch}: eval loss {eval_loss:.5f}, learning rate now {lr:g}")
        finally:
            coord.shutdown()


if __name__ == "__main__":
    main()
