"""B12: the CNN of examples/torch_mnist.py on 2 PS + 2 workers, next to single-process PyTorch and
PyTorch DDP (gloo, 2 processes on 127.0.0.1), on the same data with the same optimizer (Adam, lr 2e-3).

Each contender takes `warmup` untimed then `steps` timed minibatches of 64 (DDP: each of its 2 ranks
takes half, so every contender sees the same number of examples); steps/s counts minibatches of 64
per second, and accuracy is on the 1,000 held-out digits after all of them. torch runs one intra-op
thread in every process (2 cores are shared by everything).

B14CNN (`recipe="adamw-cosine"`): the same CNN trained with AdamW (lr 2e-3, weight decay 0.01) under a
linear warmup (100 updates from 1% of the rate) then a cosine decay to 0 over the remaining updates,
torch's SequentialLR(LinearLR, CosineAnnealingLR) stepped after every optimizer step in one process,
and the same torch objects translated by `ps_torch.from_torch(opt, scheduler)` for the PS, where the
rate follows each variable's update count.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

import cloudpickle
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pscluster as ps
import pscluster.torch as ps_torch
from pscluster.ops.launcher import LocalCluster, free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("pscluster_torch_mnist_example", ROOT / "examples" / "torch_mnist.py")
example = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["pscluster_torch_mnist_example"] = example
_spec.loader.exec_module(example)  # type: ignore[union-attr]
cloudpickle.register_pickle_by_value(example)  # workers need not import the example
LR, BATCH = 2e-3, 64
WARMUP_UPDATES = 100  # B14CNN's linear warmup


def _data(tmp: str) -> tuple[str, np.ndarray, np.ndarray]:
    x, y, xt, yt = example.load_mnist()
    path = f"{tmp}/train.npz"
    np.savez(path, x=x, y=y)
    return path, xt, yt


def _local_steps(net: torch.nn.Module, opt: torch.optim.Optimizer, it: Any, n: int, sched: Any = None) -> None:
    for _ in range(n):
        x, y = next(it)
        opt.zero_grad()
        example.loss_of(net, x, y).backward()
        opt.step()
        if sched is not None:
            sched.step()


def _recipe(net: torch.nn.Module, recipe: str, updates: int) -> tuple[torch.optim.Optimizer, Any]:
    """The torch optimizer and scheduler of a recipe: "adam" (B12) or "adamw-cosine" (B14CNN) over `updates`."""
    if recipe == "adam":
        return torch.optim.Adam(net.parameters(), lr=LR), None
    if recipe != "adamw-cosine":
        raise ValueError(f"unknown recipe {recipe!r}: use 'adam' or 'adamw-cosine'")
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.01)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=WARMUP_UPDATES)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=updates - WARMUP_UPDATES)
    return opt, torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[WARMUP_UPDATES])


def single(steps: int = 1000, warmup: int = 100, recipe: str = "adam") -> dict[str, float]:
    """Single-process PyTorch: the ceiling without any cluster."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path, xt, yt = _data(tmp)
        net = example.CNN()
        opt, sched = _recipe(net, recipe, warmup + steps)
        it = example.batches(path, BATCH, 0)
        _local_steps(net, opt, it, warmup, sched)
        start = time.perf_counter()
        _local_steps(net, opt, it, steps, sched)
        seconds = time.perf_counter() - start
    return {"steps_per_s": steps / seconds, "accuracy": example.accuracy(net, xt, yt)}


def _ddp_rank(rank: int, port: int, path: str, steps: int, warmup: int, out: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        net = torch.nn.parallel.DistributedDataParallel(example.CNN())
        opt = torch.optim.Adam(net.parameters(), lr=LR)
        it = example.batches(path, BATCH, rank)
        _local_steps(net, opt, it, warmup // 2)
        dist.barrier()
        start = time.perf_counter()
        _local_steps(net, opt, it, steps // 2)
        dist.barrier()
        seconds = time.perf_counter() - start
        if rank == 0:
            _, _, xt, yt = example.load_mnist()
            out.put({"steps_per_s": steps / seconds, "accuracy": example.accuracy(net.module, xt, yt)})
    finally:
        dist.destroy_process_group()


def ddp(steps: int = 1000, warmup: int = 100) -> dict[str, float]:
    """PyTorch DDP, gloo, 2 processes on 127.0.0.1, each taking half the minibatches."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        path, _, _ = _data(tmp)
        mp.start_processes(_ddp_rank, args=(free_port(), path, steps, warmup, out), nprocs=2, join=True,
                           start_method="spawn")
    return out.get()  # type: ignore[no-any-return]


def cluster(steps: int = 1000, warmup: int = 100, recipe: str = "adam") -> dict[str, float]:
    """pscluster.torch: 2 PS + 2 workers, asynchronous Adam (or the recipe's optimizer and schedule, from_torch)
    on the PS, one minibatch per closure."""
    with tempfile.TemporaryDirectory() as tmp:
        path, xt, yt = _data(tmp)
        with LocalCluster(2, 2, workdir=f"{tmp}/cluster") as local:
            coord = ps.ClusterCoordinator(local.settings())
            try:
                coord.wait_for_workers(2)
                net = example.CNN()
                model = ps_torch.PSModule(coord, net, ps_torch.from_torch(*_recipe(net, recipe, warmup + steps)))
                it = iter(coord.create_per_worker_dataset(lambda info: example.batches(path, BATCH, info.worker_index)))
                step = example.make_step(model)
                for _ in range(warmup):
                    coord.schedule(step, args=(it,))
                coord.join()
                start = time.perf_counter()
                for _ in range(steps):
                    coord.schedule(step, args=(it,))
                coord.join()
                seconds = time.perf_counter() - start
                net.load_state_dict(model.state_dict())
            finally:
                coord.shutdown()
    return {"steps_per_s": steps / seconds, "accuracy": example.accuracy(net, xt, yt)}
