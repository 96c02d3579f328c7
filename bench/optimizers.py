"""B14 (first half): the cost of one PS-side update of each optimizer, in process (no sockets).

Dense: one update of a 1 GiB float32 variable (the PS's block loop over its rows), next to numpy
copying 1 GiB in the same run. Sparse: one update of 4,096 random unique rows of a 10 M x 64 float32
table (gather, update, scatter of the rows and their slots). Medians of the CPU time of `runs` updates
after one warm-up (numpy single-threaded here, so CPU time is the update's cost); the table and slots start as untouched zeros (calloc), so only the touched pages are resident.

    python bench/optimizers.py --runs 5          # prints a JSON line per figure
    python bench/run.py --only B14               # the BENCHMARKS.md row
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
from pscluster.server import optimizers as opt

from pscluster import optimizers as ps_opt
from pscluster import schedules
from pscluster.optimizer_config import OptimizerConfig
from pscluster.torch import optim as torch_names

CONFIGS: dict[str, Callable[[], OptimizerConfig]] = {
    "sgd": lambda: ps_opt.SGD(0.01),
    "sgd+cosine": lambda: ps_opt.SGD(schedules.CosineDecay(0.01, 1000)),
    "momentum (torch, wd)": lambda: torch_names.SGD(0.01, momentum=0.9, weight_decay=1e-4),
    "adam (torch)": lambda: torch_names.Adam(1e-3),
    "adamw (torch)": lambda: torch_names.AdamW(1e-3),
    "adam amsgrad": lambda: torch_names.Adam(1e-3, amsgrad=True),
    "adagrad": lambda: torch_names.Adagrad(0.01),
    "rmsprop centered+momentum": lambda: torch_names.RMSprop(0.01, centered=True, momentum=0.9),
    "ftrl": lambda: ps_opt.Ftrl(0.01, l1_regularization_strength=0.001),
    "lion": lambda: ps_opt.Lion(1e-4),
}


def _median_s(fn: Callable[[], None], runs: int) -> float:
    """Median CPU seconds of this process per call (user + system): on a shared, overloaded machine the
    wall clock mostly measures waiting for a core; the CPU time is the update's cost."""
    fn()  # warm-up: first touch of the slots' pages
    times = []
    for _ in range(runs):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def copy_seconds(nbytes: int, runs: int) -> float:
    """Median time of numpy copying nbytes (float32) into another array."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return _median_s(lambda: np.copyto(dst, src), runs)


def dense(nbytes: int = 1 << 30, runs: int = 5) -> dict[str, float]:
    """Seconds per dense update of each optimizer on an nbytes float32 variable (rows of 1,024)."""
    rows = nbytes // 4 // 1024
    value = np.full((rows, 1024), 0.5, np.float32)
    grad = np.full((rows, 1024), 0.01, np.float32)
    out = {}
    for name, make in CONFIGS.items():
        cfg = make()
        slots = opt.init_slots(cfg, value.shape, value.dtype)
        t = [0]

        def update(cfg: OptimizerConfig = cfg, slots: dict[str, np.ndarray] = slots, t: list[int] = t) -> None:
            t[0] += 1
            opt.apply_dense(cfg, value, grad, slots, t[0])

        out[name] = _median_s(update, runs)
        del slots
        gc.collect()
    return out


def sparse(rows: int = 10_000_000, dim: int = 64, batch: int = 4096, runs: int = 20) -> dict[str, float]:
    """Seconds per update of `batch` random unique rows of a rows x dim float32 table, per optimizer."""
    table = np.zeros((rows, dim), np.float32)  # calloc: pages appear as rows are touched
    rng = np.random.default_rng(0)
    out = {}
    for name, make in CONFIGS.items():
        cfg = make()
        slots = {k: np.zeros((rows, dim), np.float32) for k in cfg.slot_names()}
        if "accumulator" in slots:
            slots["accumulator"] += cfg.initial_accumulator_value  # as init_slots: the whole slot, once
        t = [0]

        def update(cfg: OptimizerConfig = cfg, slots: dict[str, np.ndarray] = slots, t: list[int] = t) -> None:
            t[0] += 1
            ids = np.unique(rng.integers(0, rows, batch))
            opt.apply_sparse(cfg, table, ids, np.full((ids.size, dim), 0.01, np.float32), slots, t[0])

        out[name] = _median_s(update, runs)
        del slots
        gc.collect()
    return out


def b14(runs: int = 5, nbytes: int = 1 << 30) -> dict[str, object]:
    """Everything, in one process and one run: copy bandwidth, dense and sparse update times."""
    copy_s = copy_seconds(nbytes, runs)
    return {"copy_gib_per_s": nbytes / copy_s / (1 << 30), "copy_s": copy_s, "dense_s": dense(nbytes, runs),
            "sparse_s": sparse(runs=max(runs, 20))}


def main() -> int:
    """Print the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mib", type=int, default=1024, help="dense variable size")
    args = parser.parse_args()
    print(json.dumps(b14(args.runs, args.mib << 20), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
