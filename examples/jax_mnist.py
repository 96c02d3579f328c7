"""Train a JAX MLP on real MNIST digits with a local pscluster: 2 PS, 2 workers.

    python examples/jax_mnist.py --steps 1500            # asynchronous Adam on the PS, cosine-decayed rate
    python examples/jax_mnist.py --mode sync              # sync replicas; or --mode bounded

The parameters are a plain pytree (a dict of jnp arrays); `pscluster.jax.PSParams` puts each leaf on
the PS tasks. Each closure pulls them (one request per PS task), takes `jax.value_and_grad` of the
loss on the worker's batch, and pushes the gradient pytree; the PS applies the optimizer (Adam, its rate
decayed along a cosine over the run's pushes: optax's `cosine_decay_schedule`, run on the PS). Data: the
MNIST digits of examples/mnist.py (4,000 train, 1,000 held out).
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import pscluster as ps
import pscluster.jax as ps_jax
from pscluster.ops.launcher import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from mnist import batches, load_mnist


def init_params(seed: int = 0, hidden: int = 256) -> dict[str, dict[str, jax.Array]]:
    """784 - hidden - 10 MLP, Glorot-uniform weights, zero biases."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))

    def glorot(key: jax.Array, n_in: int, n_out: int) -> jax.Array:
        limit = np.sqrt(6.0 / (n_in + n_out))
        return jax.random.uniform(key, (n_in, n_out), jnp.float32, -limit, limit)

    return {"hidden": {"w": glorot(k1, 784, hidden), "b": jnp.zeros(hidden)},
            "out": {"w": glorot(k2, hidden, 10), "b": jnp.zeros(10)}}


def logits(params: dict, x: jax.Array) -> jax.Array:
    """The MLP's logits."""
    h = jax.nn.relu(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return h @ params["out"]["w"] + params["out"]["b"]


@jax.jit
def loss_and_grads(params: dict, x: jax.Array, y: jax.Array) -> tuple[jax.Array, dict]:
    """Mean cross-entropy and its gradient pytree."""
    def loss(p: dict) -> jax.Array:
        return -jnp.mean(jax.nn.log_softmax(logits(p, x))[jnp.arange(y.shape[0]), y])
    return jax.value_and_grad(loss)(params)


def accuracy(params: dict, x: np.ndarray, y: np.ndarray) -> float:
    """Fraction of correct predictions."""
    return float((np.asarray(logits(params, jnp.asarray(x))).argmax(1) == y).mean())


def make_step(model: ps_jax.PSParams, steps_per_closure: int = 1):
    """A closure body: pull, gradient on this worker's batch, push; returns the mean loss."""

    def train_step(iterator) -> float:
        total = 0.0
        for _ in range(steps_per_closure):
            x, y = next(iterator)
            loss, grads = loss_and_grads(model.pull().params, jnp.asarray(x), jnp.asarray(y))
            model.push(grads)
            total += float(loss)
        return total / steps_per_closure

    return train_step


def main(argv: list[str] | None = None) -> int:
    """Start a local cluster, train the MLP, print held-out accuracy."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500, help="steps summed over all workers")
    parser.add_argument("--steps-per-closure", type=int, default=1)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.002, help="peak rate, decayed to 1/20 of it")
    parser.add_argument("--mode", choices=["async", "sync", "bounded"], default="async")
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--min-accuracy", type=float, default=0.93, help="exit non-zero below this")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    x_train, y_train, x_test, y_test = load_mnist()
    print(f"MNIST: {len(x_train)} training and {len(x_test)} held-out digits; "
          f"cluster: {args.ps} PS, {args.workers} workers on 127.0.0.1, {args.mode} updates")
    with tempfile.TemporaryDirectory(prefix="pscluster-jax-mnist-") as tmp:
        train_path = str(pathlib.Path(tmp, "train.npz"))
        np.savez(train_path, x=x_train, y=y_train)
        with LocalCluster(args.ps, args.workers, workdir=pathlib.Path(tmp, "cluster")) as cluster:
            coord = ps.ClusterCoordinator(cluster.settings())
            try:
                coord.wait_for_workers(args.workers)
                if args.mode != "async":
                    coord.configure_sync(args.mode, replicas_to_aggregate=args.workers, staleness=args.staleness)
                # a constant rate let an async run's last steps jump back up now and then; the decay settles them
                rate = ps_jax.cosine_decay_schedule(args.lr, decay_steps=args.steps, alpha=0.05)
                model = ps_jax.PSParams(coord, init_params(), ps_jax.adam(rate))
                dataset = coord.create_per_worker_dataset(
                    lambda info: batches(train_path, args.batch, seed=info.worker_index))
                iterator = iter(dataset)
                step = make_step(model, args.steps_per_closure)
                start = time.perf_counter()
                values = [coord.schedule(step, args=(iterator,)) for _ in range(args.steps // args.steps_per_closure)]
                coord.join()
                losses = coord.fetch(values)
                seconds = time.perf_counter() - start
                print(f"{args.steps} steps in {seconds:.1f} s ({args.steps / seconds:.0f} steps/s); "
                      f"loss {np.mean(losses[:10]):.3f} -> {np.mean(losses[-10:]):.3f}")
                trained = model.state()
            finally:
                coord.shutdown()
    acc = accuracy(trained, x_test, y_test)
    print(f"held-out test accuracy: {acc:.4f}")
    return 0 if acc >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
