"""Helpers shared by the benchmarks: medians, process memory, small subprocess peers."""

from __future__ import annotations

import contextlib
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pscluster.ops.launcher import LocalCluster


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


@contextlib.contextmanager
def local_cluster(num_ps: int, num_workers: int, tls: bool = False, **settings: Any) -> Iterator[LocalCluster]:
    """A started LocalCluster in a temporary directory removed afterwards; with tls, mutual TLS on every
    channel, certificates in that directory."""
    from pscluster.ops.certs import hosts_of, task_names, write_certs
    from pscluster.ops.launcher import LocalCluster

    with tempfile.TemporaryDirectory(prefix="pscluster-bench-") as tmp:
        workdir = pathlib.Path(tmp)
        extra = dict(settings)
        if tls:
            extra.update(tls_dir=str(workdir / "tls"), require_client_cert=True)
        cluster = LocalCluster(num_ps, num_workers, workdir=workdir / "cluster", extra=extra)
        if tls:
            write_certs(workdir / "tls", task_names(cluster.spec, num_workers), hosts_of(cluster.spec))
        with cluster:
            yield cluster
