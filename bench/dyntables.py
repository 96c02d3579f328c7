"""B16, in-process: one shard of a hash-keyed dynamic table (server/dynamic_table.py), no sockets.

    python bench/dyntables.py --keys 1000000 --dim 64 --runs 5
    python bench/dyntables.py --ops 1000000             # the randomized dict reference at a million ops
    python bench/dyntables.py --b13 300 --runs 3         # B13 end to end: fixed table, then dynamic table

Prints one JSON line per figure (median of --runs, with every run): inserts/s and the longest single
insert batch while growing from empty; lookups/s of batches of 4,096 live keys; lookup + Adagrad update
of such batches (keys/s, each key pulled once and pushed once; each rate per wall second, and per CPU second of the
thread as cpu_median); resident bytes per key beyond its row
and slot bytes; checkpoint save (snapshot + safetensors file, as server/checkpoint.py writes it: into the
page cache, then made durable by fsync) and restore (map the file, re-shard, load) into 2 shards, s/GiB of
state; an eviction sweep over every live key (keys scanned/s, none evicted). The floors in the same run:
first writes of as many rows, a gather of 4,096 random rows with np.take (the fastest numpy gather;
fancy indexing runs 2-3 x slower), and a plain file of the state's size written (and fsynced) the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from pscluster.server import table_state as ts
from pscluster.server.dynamic_table import DynamicTable
from pscluster.server.tensor_files import TensorFile, write

from pscluster.optimizers import Adagrad, OptimizerConfig
from pscluster.tables import Eviction, TableConfig

BATCH = 4096
GROW_BATCH = 65536


def _rss_bytes() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


FIGURES: dict[str, dict[str, Any]] = {}  # the last bench()'s figures by name (bench/run.py reads them)


def _emit(name: str, runs: list[float], unit: str, **extra: Any) -> None:
    figure = {"figure": name, "median": statistics.median(runs), "unit": unit, "runs": [round(r, 4) for r in runs],
              **extra}
    FIGURES[name] = figure
    print(json.dumps(figure), flush=True)


def _table(n: int, dim: int, optimizer: OptimizerConfig) -> DynamicTable:
    cfg = TableConfig(dim=dim, capacity=n + GROW_BATCH, eviction=Eviction("steps", max_idle=1e15))
    return DynamicTable(cfg, optimizer)


def grow(n: int, dim: int, optimizer: OptimizerConfig, keys: np.ndarray) -> tuple[DynamicTable, float, float, int]:
    """A table filled from empty with `keys` by pulls (admission "always"); (table, keys/s, longest, rss)."""
    before = _rss_bytes()
    table = _table(n, dim, optimizer)
    longest = 0.0
    start = time.perf_counter()
    for i in range(0, n, GROW_BATCH):
        t0 = time.perf_counter()
        table.pull(keys[i:i + GROW_BATCH])
        longest = max(longest, time.perf_counter() - t0)
    seconds = time.perf_counter() - start
    return table, n / seconds, longest, _rss_bytes() - before


def per_second(fn: Callable[[int], int], iters: int) -> tuple[float, float]:
    """Items per second over iters calls of fn(i) (each returns how many items it handled): (per wall
    second, per CPU second of this thread). On a shared machine the CPU rate moves far less with the load."""
    start, cpu = time.perf_counter(), time.thread_time()
    done = sum(fn(i) for i in range(iters))
    return done / (time.perf_counter() - start), done / (time.thread_time() - cpu)


def _rates(fn: Callable[[int], int], iters: int, runs: int, name: str, unit: str, **extra: Any) -> None:
    """Emit runs of per_second(fn, iters): the wall rates, and the CPU rates beside them."""
    pairs = [per_second(fn, iters) for _ in range(runs)]
    cpu = [c for _, c in pairs]
    _emit(name, [w for w, _ in pairs], unit, cpu_median=round(statistics.median(cpu), 1),
          cpu_runs=[round(c, 1) for c in cpu], **extra)


def warm_up(dim: int, optimizer: OptimizerConfig) -> float:
    """Seconds to import and load (or, with no disk cache yet, compile) the index's compiled kernels and
    run each once on a small table: paid once per process, before any figure is timed."""
    start = time.perf_counter()
    table = _table(1000, dim, optimizer)
    keys = np.arange(1000, dtype=np.int64)
    table.pull(keys[:500])
    table.push(keys, np.zeros((keys.size, dim), np.float32))
    table.sweep()
    ts.load(_table(1000, dim, optimizer), ts.snapshot(table))
    return time.perf_counter() - start


def bench(n: int, dim: int, runs: int, checkpoint: bool) -> dict[str, dict[str, Any]]:
    """Every B16 figure at n live keys of dim floats (printed, and returned by name)."""
    FIGURES.clear()
    _emit("kernels_first_call", [warm_up(dim, Adagrad(0.01))], "s")
    rng = np.random.default_rng(0)
    keys = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64, endpoint=True)
    optimizer = Adagrad(0.01)
    slot_bytes = dim * 4 * (1 + len(optimizer.slot_names()))
    ins, longest, over = [], [], []
    table = None
    fills = []
    for _ in range(runs):  # the floor of growing: first writes of as many rows (the OS commits pages)
        start = time.perf_counter()
        fresh = np.zeros((n, dim * (1 + len(optimizer.slot_names()))), np.float32)
        fresh[:] = 1.0
        fills.append(n / (time.perf_counter() - start))
        del fresh
    _emit("numpy_first_write_floor", fills, "rows/s", bytes_per_row=slot_bytes)
    for _ in range(runs):
        table = None  # free the previous table first: RSS growth is measured per table
        table, rate, pause, rss = grow(n, dim, optimizer, keys)
        ins.append(rate)
        longest.append(pause)
        over.append((rss - table.live * slot_bytes) / table.live)
    assert table is not None
    live = table.live  # random int64 keys: a few may repeat
    _emit("insert", ins, "keys/s", live_keys=live, dim=dim)
    _emit("insert_longest_batch", longest, "s", batch=GROW_BATCH)
    _emit("bytes_per_key_beyond_row_and_slots", over, "B", measured="RSS growth", index=table.index.nbytes / live)
    batches = [keys[rng.integers(0, n, BATCH)] for _ in range(64)]
    grads = np.full((BATCH, dim), 0.01, np.float32)

    def lookup(i: int) -> int:
        return table.pull(batches[i % 64])[0].shape[0]

    def update(i: int) -> int:
        b = batches[i % 64]
        table.pull(b)
        table.push(b, grads)
        return b.size

    floor_rows = rng.integers(0, live, (64, BATCH))

    def gather(i: int) -> int:  # the numpy floor in the same run: the fastest gather of as many rows (np.take:
        return np.take(table.values, floor_rows[i % 64], axis=0).shape[0]  # 2-3 x fancy indexing), no hashing

    _rates(gather, 200, runs, "numpy_gather_floor", "rows/s", batch=BATCH)
    _rates(lookup, 200, runs, "lookup", "keys/s", batch=BATCH, live_keys=live)
    _rates(update, 100, runs, "lookup_adagrad_update", "keys/s", batch=BATCH)
    sweeps = []
    for _ in range(runs):
        start = time.perf_counter()
        assert table.sweep().evicted.size == 0
        sweeps.append(live / (time.perf_counter() - start))
    _emit("eviction_sweep", sweeps, "keys scanned/s")
    if checkpoint:
        _checkpoint(table, n, dim, optimizer, runs)
    return dict(FIGURES)


def _durable_write(path: pathlib.Path, tensors: dict[str, np.ndarray]) -> tuple[float, float, float]:
    """(seconds of write(2) into the page cache, CPU seconds of this thread in it, seconds of the fsync that
    makes it durable), to a new file as checkpoint.save writes one (a fresh name: overwriting a file would
    wait for its old pages first)."""
    path.unlink(missing_ok=True)
    start, cpu = time.perf_counter(), time.thread_time()
    write(path, tensors, {})
    mid, cpu = time.perf_counter(), time.thread_time() - cpu
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())
    return mid - start, cpu, time.perf_counter() - mid


def _checkpoint(table: DynamicTable, n: int, dim: int, optimizer: OptimizerConfig, runs: int) -> None:
    """Save (into the page cache, then made durable by fsync) against a plain file of as many bytes written the
    same way in the same run (the floors), and restore into 2 shards from the mapped file, s/GiB."""
    figures: dict[str, list[float]] = {name: [] for name in (
        "checkpoint_save", "checkpoint_save_durable", "file_write_floor", "file_durable_floor",
        "save_snapshot", "save_write_cpu", "file_write_cpu", "restore_into_2_shards", "restore_cpu")}
    with tempfile.TemporaryDirectory() as tmp:
        path, plain_path = pathlib.Path(tmp) / "shard.safetensors", pathlib.Path(tmp) / "plain.safetensors"
        gib = sum(a.nbytes for a in ts.snapshot(table, ordered=False).values()) / 2**30
        plain = np.ones(int(gib * 2**30) // 8, np.float64)  # pages written before the clock starts
        for run in range(runs):
            for which in ("floor", "save") if run % 2 == 0 else ("save", "floor"):  # alternating: neither goes first
                if which == "floor":
                    cached, cpu, synced = _durable_write(plain_path, {"a": plain})
                    figures["file_write_floor"].append(cached / gib)
                    figures["file_write_cpu"].append(cpu / gib)
                    figures["file_durable_floor"].append((cached + synced) / gib)
                    plain_path.unlink()
                    continue
                start = time.perf_counter()
                state = ts.snapshot(table, ordered=False)  # what checkpoint.save writes (for_checkpoint)
                figures["save_snapshot"].append((time.perf_counter() - start) / gib)
                cached, cpu, synced = _durable_write(path, state)
                figures["save_write_cpu"].append(cpu / gib)
                figures["checkpoint_save"].append((time.perf_counter() - start - synced) / gib)
                figures["checkpoint_save_durable"].append((time.perf_counter() - start) / gib)
                del state
            start, cpu = time.perf_counter(), time.thread_time()
            with TensorFile(path) as fh:
                loaded = {k: fh.view(k) for k in fh.keys()}  # mapped, as checkpoint.restore reads tables
            for part, where in ts.split([loaded], 2):  # each shard's rows gathered straight into its table
                ts.load(_table(n, dim, optimizer), part, where)
            figures["restore_into_2_shards"].append((time.perf_counter() - start) / gib)
            figures["restore_cpu"].append((time.thread_time() - cpu) / gib)
            del loaded
        del plain
    for name, values in figures.items():
        _emit(name, values, "s/GiB", **({"state_gib": round(gib, 3)} if name == "checkpoint_save" else {}))


def check(ops: int) -> None:
    """The randomized run against a dict (tests/unit/test_dynamic_table.py) at `ops` key operations."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root: tests/
    from tests.unit.test_dynamic_table import run_against_dict

    start = time.perf_counter()
    run_against_dict(ops, seed=11)
    print(json.dumps({"figure": "dict_reference_check", "ops": ops, "seconds": time.perf_counter() - start,
                      "result": "identical"}), flush=True)


def _steps(table: Any, id_range: int, hashed: bool, batch: int, steps: int, warmup: int) -> dict[str, float]:
    import time as _time

    import numpy as _np

    from pscluster.client import context as _context
    from pscluster.tables import mix64 as _mix64

    client = _context.current_client()
    rng = _np.random.default_rng(0)
    start, moved = 0.0, 0
    for i in range(warmup + steps):
        if i == warmup:
            start = _time.perf_counter()
        ids = rng.integers(0, id_range, batch)
        # hashed: 10 M distinct int64 keys (mix64 is a bijection of the 64-bit integers)
        keys = _np.unique(_mix64(ids).view(_np.int64) if hashed else ids)
        rows = client.pull_rows(table, keys)
        client.push_rows(table, keys, _np.full_like(rows, 0.01))
        if i >= warmup:
            moved += 2 * keys.size
    seconds = _time.perf_counter() - start
    return {"rows_per_s": moved / seconds, "batches_per_s": steps / seconds}


def b13_pair(id_range: int = 10_000_000, dim: int = 64, batch: int = 4096, steps: int = 300,
             warmup: int = 20) -> dict[str, float]:
    """B13's workload on the fixed table (id_range rows, zeros) and then on a dynamic table (empty, keys
    hashed from id_range ids), one worker closure each, on one cluster of 2 PS and 1 worker."""
    import pscluster as ps
    from pscluster.ops.launcher import LocalCluster

    with tempfile.TemporaryDirectory(prefix="pscluster-b13d-") as tmp, \
            LocalCluster(2, 1, workdir=f"{tmp}/cluster") as cluster:
        coord = ps.ClusterCoordinator(cluster.settings())
        try:
            coord.wait_for_workers(1)
            fixed = coord.create_variable("fixed", shape=(id_range, dim), dtype="float32", sparse=True,
                                          partitioner=ps.FixedShardsPartitioner(2), optimizer=ps.SGD(0.1))
            cfg = TableConfig(dim=dim, capacity=id_range // 2 + id_range // 10)
            dyn = coord.create_variable("dyn", shape=(None, dim), sparse=True, optimizer=ps.SGD(0.1), table=cfg)
            out = {}
            for name, table, hashed in (("fixed", fixed, False), ("dynamic", dyn, True)):
                r = coord.schedule(_steps, args=(table, id_range, hashed, batch, steps, warmup)).fetch()
                out[f"{name}_rows_per_s"] = r["rows_per_s"]
            out["ratio"] = out["dynamic_rows_per_s"] / out["fixed_rows_per_s"]
            out["dynamic_live_keys"] = coord.client.table_stats(dyn)["live_keys"]
            return out
        finally:
            coord.shutdown()


def main() -> None:
    """Parse arguments and run."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-checkpoint", action="store_true", help="skip save/restore (needs 2x the table's memory)")
    ap.add_argument("--ops", type=int, default=0, help="run the dict reference check at this many operations")
    ap.add_argument("--b13", type=int, default=0, help="B13's workload end to end for this many batches: the "
                    "fixed table and a dynamic table, one after the other on one cluster")
    args = ap.parse_args()
    if args.b13:
        for _ in range(args.runs):
            print(json.dumps({"figure": "b13_pair", **b13_pair(steps=args.b13)}), flush=True)
        return
    if args.ops:
        check(args.ops)
        return
    bench(args.keys, args.dim, args.runs, not args.no_checkpoint)


if __name__ == "__main__":
    main()
