"""B2 (W2 async), B3 (sync / bounded), B8 (scaling): MNIST MLP steps/s and accuracy on a local cluster."""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable
from typing import ContextManager

import cloudpickle
import numpy as np

import pscluster as ps
from pscluster.ops.launcher import LocalCluster

Probe = Callable[[LocalCluster], ContextManager[object]]
ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("pscluster_mnist_example", ROOT / "examples" / "mnist.py")
mnist = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["pscluster_mnist_example"] = mnist
_spec.loader.exec_module(mnist)  # type: ignore[union-attr]
cloudpickle.register_pickle_by_value(mnist)  # workers need not import the example


def numpy_baseline(steps: int = 2000, hidden: int = 128) -> dict[str, float]:
    """Single-process numpy W2 (`hidden` units; 1280 is B8's 10x model): the ceiling without any cluster."""
    x, y, xt, yt = mnist.load_mnist()
    rng = np.random.default_rng(0)
    params = [mnist.glorot(rng, 784, hidden), np.zeros(hidden, np.float32), mnist.glorot(rng, hidden, 10),
              np.zeros(10, np.float32)]
    with tempfile.TemporaryDirectory() as tmp:
        np.savez(f"{tmp}/t.npz", x=x, y=y)
        it = mnist.batches(f"{tmp}/t.npz", 64, 0)
        start = time.perf_counter()
        for _ in range(steps):
            bx, by = next(it)
            _, grads = mnist.mlp_grads(params, bx, by)
            for p, g in zip(params, grads):
                p -= 0.1 * g
        seconds = time.perf_counter() - start
    return {"steps_per_s": steps / seconds, "accuracy": mnist.accuracy(params, xt, yt)}


def w2(num_ps: int = 2, num_workers: int = 2, steps: int = 2000, warmup: int = 100, mode: str = "async",
       steps_per_closure: int = 1, probe: Probe | None = None, push_pull: bool = False, hidden: int = 128,
       replicas: int = 1, inflight: int | None = None, elastic: bool = False, **sync: int) -> dict[str, float]:
    """W2 on a fresh local cluster: steps/s over `steps` timed steps after `warmup`, and test accuracy
    (inflight: the coordinator's max_inflight_per_worker, default the settings' own; elastic: one copy routed
    by the replica table, docs/elastic.md).

    `probe(cluster)`, if given, is a context manager wrapped around the timed steps (bench/profile.py
    measures each process's CPU inside it).
    """
    x, y, xt, yt = mnist.load_mnist()
    with tempfile.TemporaryDirectory() as tmp:
        train_path = f"{tmp}/train.npz"
        np.savez(train_path, x=x, y=y)
        with LocalCluster(num_ps, num_workers, workdir=f"{tmp}/cluster", replicas=replicas,
                          elastic=elastic) as cluster:
            extra = {} if inflight is None else {"max_inflight_per_worker": inflight}
            coord = ps.ClusterCoordinator(cluster.settings(push_pull=push_pull, **extra))
            try:
                coord.wait_for_workers(num_workers)
                if mode != "async":
                    coord.configure_sync(mode=mode, **sync)
                params = mnist.create_params(coord, hidden=hidden, lr=0.1)
                dataset = mnist.make_dataset(coord, train_path, 64)
                step = mnist.make_step(params, steps_per_closure)
                it = iter(dataset)
                for _ in range(warmup // steps_per_closure):
                    coord.schedule(step, args=(it,))
                coord.join()
                with probe(cluster) if probe is not None else contextlib.nullcontext():
                    start = time.perf_counter()
                    for _ in range(steps // steps_per_closure):
                        coord.schedule(step, args=(it,))
                    coord.join()
                    seconds = time.perf_counter() - start
                acc = mnist.accuracy(ps.pull(params), xt, yt)
                extra = coord.sync_stats() if mode != "async" else {}
            finally:
                coord.shutdown()
    return {"steps_per_s": steps / seconds, "accuracy": acc, **extra}
