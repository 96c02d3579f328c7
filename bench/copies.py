"""COPIES: what a memmove costs by the distance between its buffers, with glibc's default and with `rep movsb`
turned off (GLIBC_TUNABLES below; docs/architecture.md, "Copies and where they land").

    python bench/run.py --only COPIES            # or: python bench/copies.py

Each size is copied (np.copyto, which is one memmove) into a destination 0-4095 bytes past the source modulo
4 KiB, step 4 (and 1-63 one by one), median of 9 copies per distance, in two child processes that differ only
in GLIBC_TUNABLES, alternating. "slow" counts the distances that cost more than 2.5 x the size's median.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

SIZES = (8 << 10, 64 << 10, 200704, 401408, 1 << 20, 4 << 20)  # 200704/401408: W2's 784x128 float32 halved / whole
REPS = 9
# past glibc's rep_movsb_stop_threshold (the L2 size), so no size uses rep movsb: its vector loop instead
NO_REP_MOVSB = "glibc.cpu.x86_rep_movsb_threshold=0x100000000"


def _measure(sizes: tuple[int, ...] = SIZES) -> dict[str, dict[str, float]]:
    """Per size: the median copy time over distances, the worst, and the distances > 2.5 x that median."""
    out: dict[str, dict[str, float]] = {}
    distances = sorted(set(range(0, 64)) | set(range(0, 4096, 4)))
    for n in sizes:
        src_raw, dst_raw = np.ones(n + 8192, np.uint8), np.empty(n + 8192, np.uint8)
        s0, d0 = (-src_raw.ctypes.data) % 4096, (-dst_raw.ctypes.data) % 4096
        src = src_raw[s0:s0 + n]
        cost = {}
        for d in distances:
            dst = dst_raw[d0 + d:d0 + d + n]
            np.copyto(dst, src)
            times = []
            for _ in range(REPS):
                t = time.perf_counter()
                np.copyto(dst, src)
                times.append(time.perf_counter() - t)
            cost[d] = sorted(times)[REPS // 2] * 1e6
        typical = float(np.median(list(cost.values())))
        slow = [d for d, us in cost.items() if us > 2.5 * typical]
        out[str(n)] = {"median_us": typical, "at_16_us": cost[16], "worst_us": max(cost.values()),
                       "slow_distances": len(slow), "slow_within_1_31": sum(1 for d in slow if 1 <= d <= 31)}
    return out


def _child(tunables: str | None) -> dict[str, dict[str, float]]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    done = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    result: dict[str, dict[str, float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def copies(runs: int = 1) -> dict[str, dict[str, dict[str, float]]]:
    """Both settings, alternating, `runs` times each; per setting and size the median of each field."""
    trials: dict[str, list[dict[str, dict[str, float]]]] = {"default": [], "no_rep_movsb": []}
    for _ in range(runs):
        trials["default"].append(_child(None))
        trials["no_rep_movsb"].append(_child(NO_REP_MOVSB))
    return {arm: {size: {k: float(np.median([t[size][k] for t in ts])) for k in ts[0][size]} for size in ts[0]}
            for arm, ts in trials.items()}


if __name__ == "__main__":
    if "--child" in sys.argv:
        print(json.dumps(_measure()))
    else:
        print(json.dumps(copies(), indent=1))
