"""B13: the sparse embedding workload of issue 26, pscluster beside TF ParameterServerStrategy in one run.

A 10 M x 64 float32 table (uniform in [-0.05, 0.05), SGD(0.01)) in 2 shards on 2 PS, 2 workers, one
closure per batch: draw 4,096 random ids, pull the unique ones' rows, push the gradient of
sum(rows^2) over the batch (2 x row x its count). Rows/s counts each batch's ids once pulled and once
pushed (2 x 4,096 per batch). The table is created before timing; each repetition runs 20 warm-up
closures (joined) and then `closures` timed ones (joined). Beside it, the single-closure loop: one
closure on one worker runs `closures` batches in a loop (no per-closure cost). TF's version runs in
its own environment (bench/peers.py `tf-sparse`, a separate Python given by --tf-python), alternating
with pscluster repetition by repetition so both see the same machine. With --dynamic, each repetition
also runs the same workload on a hash-keyed dynamic table of the same cluster (empty at the start; the
ids are hashed into 10 M distinct int64 keys with pscluster.tables.mix64, so each first touch inserts).

    python bench/sparse.py --tf-python /work/tfenv/bin/python --reps 5 --dynamic
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pscluster as ps  # noqa: E402
from bench.common import local_cluster, rss_kib  # noqa: E402
from pscluster.tables import TableConfig  # noqa: E402

ROWS, DIM, BATCH, LR, SCALE = 10_000_000, 64, 4096, 0.01, 0.05


def batch_step(table: ps.Variable, seed: int, batch: int = BATCH, hashed_range: int = 0) -> int:
    """One closure of the workload: returns the number of unique ids it moved. hashed_range: a dynamic
    table, random ids below it hashed into int64 keys (rows created on first pull)."""
    rng = np.random.default_rng(seed)
    if hashed_range:
        from pscluster.tables import mix64

        draws = mix64(rng.integers(0, hashed_range, batch)).view(np.int64)
    else:
        draws = rng.integers(0, table.shape[0], batch)
    ids, counts = np.unique(draws, return_counts=True)
    rows = table.pull_rows(ids)
    rows *= (2 * counts).astype(rows.dtype)[:, None]  # d/drow of sum(rows^2) over the batch
    table.push_rows(ids, rows)
    return int(ids.size)


def loop_steps(table: ps.Variable, seed: int, steps: int, batch: int = BATCH) -> dict[str, float]:
    """The single-closure loop: `steps` batches inside one closure; its own timing and peak RSS."""
    start = time.perf_counter()
    for i in range(steps):
        batch_step(table, seed + i, batch)
    seconds = time.perf_counter() - start
    return {"rows_per_s": 2 * batch * steps / seconds,
            "worker_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of pid so far (/proc)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class PsclusterRun:
    """A 2 PS + 2 worker cluster holding the table; each `rep()` times one repetition."""

    def __init__(self, rows: int = ROWS, dim: int = DIM, workers: int = 2, inflight: int | None = None,
                 dynamic: bool = False) -> None:
        self._cluster_cm = local_cluster(2, workers)
        self.cluster = self._cluster_cm.__enter__()
        # no automatic checkpoints: TF's run takes none, and a 2.4 GiB save every 60 s would stall a repetition
        extra = {} if inflight is None else {"max_inflight_per_worker": inflight}
        self.coord = ps.ClusterCoordinator(self.cluster.settings(auto_checkpoint=False, **extra))
        self.coord.wait_for_workers(workers)
        made = time.perf_counter()
        self.table = self.coord.create_variable(
            "emb", shape=(rows, dim), dtype="float32", sparse=True, partitioner=ps.FixedShardsPartitioner(2),
            optimizer=ps.SGD(LR), initializer="uniform", init_scale=SCALE)
        self.create_s = time.perf_counter() - made
        self.rows = rows
        self.dynamic = None
        if dynamic:  # capacity for every key the repetitions can draw: nothing evicted, nothing refused
            self.dynamic = self.coord.create_variable(
                "emb_dyn", shape=(None, dim), sparse=True, optimizer=ps.SGD(LR),
                table=TableConfig(dim=dim, capacity=rows // 2 + rows // 10))
        self._seed = 0
        self.cpu_ms: dict[str, float] = {}

    def _schedule(self, n: int, batch: int, dynamic: bool = False) -> None:
        for _ in range(n):
            self._seed += 1
            args = (self.dynamic, self._seed, batch, self.rows) if dynamic else (self.table, self._seed, batch)
            self.coord.schedule(batch_step, args=args)
        self.coord.join()

    def rep(self, closures: int, warmup: int = 20, batch: int = BATCH, dynamic: bool = False) -> float:
        """Rows/s of `closures` closures after `warmup` joined ones (CPU per batch by role in self.cpu_ms);
        dynamic: on the dynamic table."""
        self._schedule(warmup, batch, dynamic)
        pids = {"driver": os.getpid(), **{f"ps{i}": d.pid for i, d in enumerate(self.cluster.ps)},
                **{f"worker{i}": d.pid for i, d in enumerate(self.cluster.workers)}}
        before = {k: _cpu_s(pid) for k, pid in pids.items()}
        start = time.perf_counter()
        self._schedule(closures, batch, dynamic)
        seconds = time.perf_counter() - start
        self.cpu_ms = {k: (_cpu_s(pid) - before[k]) / closures * 1e3 for k, pid in pids.items()}
        return 2 * batch * closures / seconds

    def loop(self, steps: int, warmup: int = 20, batch: int = BATCH) -> dict[str, float]:
        """The single-closure loop on one worker."""
        self._schedule(warmup, batch)
        self._seed += steps
        out: dict[str, float] = self.coord.schedule(loop_steps, args=(self.table, self._seed, steps, batch)).fetch()
        return out

    def ps_rss_mib(self) -> float:
        """The largest PS resident set."""
        return max(rss_kib(d.pid) for d in self.cluster.ps) / 1024

    def close(self) -> None:
        """Stop the coordinator and the cluster."""
        try:
            self.coord.shutdown()
        finally:
            self._cluster_cm.__exit__(None, None, None)


class TfRun:
    """TF's version in its own environment: bench/peers.py tf-sparse, driven one repetition at a time."""

    def __init__(self, python: str, rows: int = ROWS, dim: int = DIM) -> None:
        cmd = [python, str(ROOT / "bench" / "peers.py"), "tf-sparse", str(rows), str(dim)]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")  # TF's info lines would bury the figures
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        self.create_s = float(self._read()["create_s"])

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                out: dict[str, Any] = json.loads(line)
                return out
        raise RuntimeError(f"TF peer ended (exit {self.proc.wait()})")

    def rep(self, closures: int, warmup: int = 20, batch: int = BATCH) -> float:
        """Rows/s of one repetition."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{closures} {warmup} {batch}\n")
        self.proc.stdin.flush()
        out = self._read()
        self.cpu_ms: dict[str, float] = out["cpu_ms"]
        return float(out["rows_per_s"])

    def close(self) -> None:
        """End the peer (it stops its own servers)."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def b13(reps: int = 5, closures: int = 400, tf_python: str | None = None, rows: int = ROWS,
        dim: int = DIM, dynamic: bool = False) -> dict[str, Any]:
    """Median rows/s of pscluster (closure per batch and single-closure loop), with dynamic the same on a
    dynamic table, and with tf_python, TF."""
    tf = TfRun(tf_python, rows, dim) if tf_python else None
    run = PsclusterRun(rows, dim, dynamic=dynamic)
    per: dict[str, list[float]] = {"pscluster": [], "loop": [], "tf": [], "dynamic": []}
    rss = 0.0
    cpu: dict[str, list[float]] = {}
    tf_cpu: dict[str, list[float]] = {}
    try:
        for _ in range(reps):
            per["pscluster"].append(run.rep(closures))
            for role, ms in run.cpu_ms.items():
                cpu.setdefault(role, []).append(ms)
            if tf is not None:
                per["tf"].append(tf.rep(closures))
                for role, ms in tf.cpu_ms.items():
                    tf_cpu.setdefault(role, []).append(ms)
            if dynamic:
                per["dynamic"].append(run.rep(closures, dynamic=True))
            lp = run.loop(closures)
            per["loop"].append(lp["rows_per_s"])
            rss = max(rss, lp["worker_peak_rss_mib"])
            print(json.dumps({k: round(v[-1]) for k, v in per.items() if v}), file=sys.stderr, flush=True)
        out: dict[str, Any] = {k: statistics.median(v) for k, v in per.items() if v}
        out.update(runs=per, cpu_ms_per_batch={k: statistics.median(v) for k, v in cpu.items()}, create_s=run.create_s,
                   ps_max_rss_mib=run.ps_rss_mib(), worker_peak_rss_mib=rss, table_mib=rows * dim * 4 / 2**20)
        if dynamic:
            out.update(dynamic_live_keys=run.coord.client.table_stats(run.dynamic)["live_keys"])
        if tf is not None and dynamic:
            out.update(dynamic_ratio=out["dynamic"] / out["tf"],
                       dynamic_ratios=[d / t for d, t in zip(per["dynamic"], per["tf"], strict=True)])
        if tf is not None:
            out.update(tf_create_s=tf.create_s, ratio=out["pscluster"] / out["tf"],
                       tf_cpu_ms_per_batch={k: statistics.median(v) for k, v in tf_cpu.items()})
        return out
    finally:
        run.close()
        if tf is not None:
            tf.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tf-python", default=None, help="a Python with tensorflow-cpu 2.21 (optional peer)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--closures", type=int, default=400)
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--dynamic", action="store_true", help="also the workload on a dynamic table, same run")
    a = parser.parse_args()
    print(json.dumps(b13(a.reps, a.closures, a.tf_python, a.rows, dynamic=a.dynamic), indent=1))
