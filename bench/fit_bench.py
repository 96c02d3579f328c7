"""B14 (second half) and the fit loop's overhead, on the CNN of B12 (examples/torch_mnist.py), 2 PS + 2 workers.

- `precision(dtype)`: the CNN in float32 or bfloat16 (float32 masters on the PS, Adam 2e-3): steps/s,
  bytes pushed per step (the gradients' bytes each push sends) and held-out accuracy after the same
  minibatches (evaluated with the float32 masters).
- `overhead()`: the same training step scheduled by a hand-written schedule/join loop (one join per
  epoch) and by `pscluster.training.fit` (no callbacks, no validation, verbose=0), alternating on one
  cluster; returns each one's steps/s per pair.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import torch
from torch.nn import functional as F  # noqa: N812

import pscluster as ps
import pscluster.torch as ps_torch
from bench.torch_cnn import BATCH, LR, _data, example
from pscluster.ops.launcher import LocalCluster
from pscluster.torch.fit import make_train_step
from pscluster.training import fit


def _step_with_bytes(model: ps_torch.PSModule) -> Any:
    inner = make_train_step(model, F.cross_entropy, {})

    def step(iterator: Any) -> dict[str, float]:
        logs = inner(iterator)
        grads = [p.grad for p in model.module.parameters() if p.grad is not None]
        logs["pushed_bytes"] = float(sum(g.numel() * g.element_size() for g in grads))
        return logs

    return step


def precision(dtype: str = "float32", steps: int = 1000, warmup: int = 100) -> dict[str, float]:
    """The CNN in `dtype` on 2 PS + 2 workers: steps/s, bytes pushed per step, held-out accuracy."""
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    with tempfile.TemporaryDirectory() as tmp:
        path, xt, yt = _data(tmp)
        with LocalCluster(2, 2, workdir=f"{tmp}/cluster") as local:
            coord = ps.ClusterCoordinator(local.settings())
            try:
                coord.wait_for_workers(2)
                net = example.CNN()
                model = ps_torch.PSModule(coord, example.CNN().to(torch_dtype), ps_torch.Adam(lr=LR))

                def batches(info: Any) -> Any:
                    for x, y in example.batches(path, BATCH, info.worker_index):
                        yield torch.from_numpy(x).to(torch_dtype), torch.from_numpy(y)

                it = iter(coord.create_per_worker_dataset(batches))
                step = _step_with_bytes(model)
                for _ in range(warmup):
                    coord.schedule(step, args=(it,))
                coord.join()
                start = time.perf_counter()
                values = [coord.schedule(step, args=(it,)) for _ in range(steps)]
                coord.join()
                seconds = time.perf_counter() - start
                pushed = sum(v.fetch()["pushed_bytes"] for v in values) / steps
                net.load_state_dict(model.state_dict())
            finally:
                coord.shutdown()
    return {"steps_per_s": steps / seconds, "pushed_bytes_per_step": pushed, "accuracy": example.accuracy(net, xt, yt)}


def overhead(pairs: int = 5, epochs: int = 4, steps_per_epoch: int = 100) -> dict[str, list[float]]:
    """steps/s of a hand-written schedule/join loop and of fit, alternating on one cluster, `pairs` times."""
    out: dict[str, list[float]] = {"loop": [], "fit": []}
    with tempfile.TemporaryDirectory() as tmp:
        path, _, _ = _data(tmp)
        with LocalCluster(2, 2, workdir=f"{tmp}/cluster") as local:
            coord = ps.ClusterCoordinator(local.settings())
            try:
                coord.wait_for_workers(2)
                model = ps_torch.PSModule(coord, example.CNN(), ps_torch.Adam(lr=LR))
                dataset = coord.create_per_worker_dataset(lambda info: example.batches(path, BATCH, info.worker_index))
                step = make_train_step(model, F.cross_entropy, {})
                it = iter(dataset)
                for _ in range(100):  # warm-up: replicas built, connections open
                    coord.schedule(step, args=(it,))
                coord.join()
                for _ in range(pairs):
                    start = time.perf_counter()
                    for _ in range(epochs):
                        values = [coord.schedule(step, args=(it,)) for _ in range(steps_per_epoch)]
                        coord.join()
                        [v.fetch() for v in values]
                    out["loop"].append(epochs * steps_per_epoch / (time.perf_counter() - start))
                    start = time.perf_counter()
                    fit(coord, step, dataset, epochs=epochs, steps_per_epoch=steps_per_epoch, learning_rate=LR,
                        verbose=0)
                    out["fit"].append(epochs * steps_per_epoch / (time.perf_counter() - start))
            finally:
                coord.shutdown()
    return out


def precision_in_process(dtype: str = "float32", seed: int = 0, steps: int = 1100) -> dict[str, float]:
    """What B14MP's cluster does, in one process and in a fixed order (no asynchrony): float32 masters and
    Adam 2e-3; each step casts the masters into a module in `dtype`, takes the gradient of the loss
    (computed in float32, as pscluster.torch.fit does) on a minibatch of 64, and upcasts it for the
    optimizer. The same seed gives float32 and bfloat16 the same minibatches: the accuracy gap is the
    precision's alone."""
    torch.set_num_threads(1)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    with tempfile.TemporaryDirectory() as tmp:
        path, xt, yt = _data(tmp)
        master = example.CNN(seed)
        opt = torch.optim.Adam(master.parameters(), lr=LR)
        work = example.CNN(seed).to(torch_dtype)
        it = example.batches(path, BATCH, seed)
        for _ in range(steps):
            with torch.no_grad():
                for w, m in zip(work.parameters(), master.parameters()):
                    w.copy_(m)
            x, y = next(it)
            work.zero_grad()
            F.cross_entropy(work(torch.from_numpy(x).to(torch_dtype)).float(), torch.from_numpy(y)).backward()
            for w, m in zip(work.parameters(), master.parameters()):
                m.grad = w.grad.float() if w.grad is not None else None
            opt.step()
    return {"accuracy": example.accuracy(master, xt, yt)}
