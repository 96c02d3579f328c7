"""B13: sparse embedding throughput: batches of 4,096 ids into a 10 M-row, 64-dim float32 table on 2 PS.

A worker closure pulls the rows a batch touches and pushes a gradient for each (the path
pscluster.torch and pscluster.jax tables ride: PSClient.pull_rows / push_rows), `steps` times; the
figure is rows moved (pulled + pushed) per second, and the worker's peak RSS against the table's size.
"""

from __future__ import annotations

import pathlib
import resource
import tempfile
import time

import pscluster as ps
from pscluster.ops.launcher import LocalCluster


def _table_steps(table: ps.Variable, batch: int, steps: int, warmup: int) -> dict[str, float]:
    import resource as _resource
    import time as _time

    import numpy as _np

    from pscluster import context as _context

    client = _context.current_client()
    rng = _np.random.default_rng(0)
    start = 0.0
    moved = 0
    for i in range(warmup + steps):
        if i == warmup:
            start = _time.perf_counter()
        ids = _np.unique(rng.integers(0, table.shape[0], batch))
        rows = client.pull_rows(table, ids)
        client.push_rows(table, ids, _np.full_like(rows, 0.01))
        if i >= warmup:
            moved += 2 * ids.size
    seconds = _time.perf_counter() - start
    return {"rows_per_s": moved / seconds, "batches_per_s": steps / seconds, "seconds": seconds,
            "worker_peak_rss_mib": _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss / 1024}


def _rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def b13(rows: int = 10_000_000, dim: int = 64, batch: int = 4096, steps: int = 300, warmup: int = 20) -> dict[str, float]:
    """One worker, 2 PS, an SGD table of rows x dim float32 (zeros); see the module docstring."""
    with tempfile.TemporaryDirectory(prefix="pscluster-b13-") as tmp, \
            LocalCluster(2, 1, workdir=f"{tmp}/cluster") as cluster:
        coord = ps.ClusterCoordinator(cluster.settings())
        try:
            coord.wait_for_workers(1)
            made = time.perf_counter()
            table = coord.create_variable("emb", shape=(rows, dim), dtype="float32", sparse=True,
                                          partitioner=ps.FixedShardsPartitioner(2), optimizer=ps.SGD(0.1))
            create_s = time.perf_counter() - made
            r = coord.schedule(_table_steps, args=(table, batch, steps, warmup)).fetch()
            r.update(table_mib=rows * dim * 4 / 2**20, create_s=create_s,
                     ps_max_rss_mib=max(_rss_mib(d.pid) for d in cluster.ps),
                     driver_peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
            return r
        finally:
            coord.shutdown()


if __name__ == "__main__":
    print(b13(rows=1_000_000, steps=50))
