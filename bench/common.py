"""Helpers shared by the benchmarks: medians, process memory, small subprocess peers."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_of(fn: Callable[[], float], runs: int) -> tuple[float, list[float]]:
    """Median and all values of fn() over runs."""
    values = [fn() for _ in range(runs)]
    return statistics.median(values), values


def timed(fn: Callable[[], object]) -> float:
    """Seconds fn() takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """VmRSS (or VmHWM, the peak) of pid in KiB, from /proc."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found for pid {pid}")


def reset_peak(pid: int) -> None:
    """Reset VmHWM of pid (Linux >= 4.0: write 5 to clear_refs)."""
    with open(f"/proc/{pid}/clear_refs", "w") as fh:
        fh.write("5")
