"""What the worker's gradient check and clipping cost per push (pscluster/gradients.py), on W2's
gradients (784x128, 128, 128x10, 10 float32: 407 KB), next to a copy of the same bytes and to the PS's
own check (isfinite + reduce), measured in alternating rounds of the same run.

    python bench/gradient_checks.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import numpy as np

from pscluster import gradients
from pscluster.client.variables import ShardPlacement, Variable

SHAPES = [(784, 128), (128,), (128, 10), (10,)]


def main() -> None:
    """Print min, quartile and median microseconds of each contender."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    grads = [(Variable(f"v{i}", s, np.dtype(np.float32), (ShardPlacement(0, 0, 0, s[0], i),)),
              rng.normal(size=s).astype(np.float32)) for i, s in enumerate(SHAPES)]
    contenders = {
        "copy of the gradients": lambda: [g.copy() for _, g in grads],
        "PS check (isfinite)": lambda: [np.logical_and.reduce(np.isfinite(g), axis=None) for _, g in grads],
        "screen, allow": lambda: gradients.screen(grads, nonfinite="allow"),
        "screen, reject": lambda: gradients.screen(grads, nonfinite="reject"),
        "screen + clip (none)": lambda: gradients.screen(grads, max_norm=1e9),
        "screen + clip (scaled)": lambda: gradients.screen(grads, max_norm=1.0),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            times[name].append(timeit.timeit(fn, number=20) / 20 * 1e6)
    for name, ts in times.items():
        print(f"{name:24s} min {min(ts):7.1f} us   p25 {np.percentile(ts, 25):7.1f} us   "
              f"median {statistics.median(ts):7.1f} us")


if __name__ == "__main__":
    main()
