"""B16's in-process figures for two revisions of the dynamic table, alternating in one process.

    python bench/ab_dyntables.py --before main --pairs 5 --keys 1000000 --dim 64
    python bench/ab_dyntables.py --files --pairs 5       # checkpoint files alone: safetensors.numpy vs ours

The "before" side is server/hash_index.py, dynamic_table.py and table_state.py as they were at git
revision BEFORE (read with `git show`, loaded under other module names), saving a sorted snapshot and
re-sharding it sorted; the "after" side is this checkout, saving the state checkpoint.save writes (row
order, views where the rows have no holes) and splitting it unordered, each shard's rows gathered straight into its table (ts.split). Both write
and read with server/tensor_files.py and use this checkout's optimizers, rows.py and the same keys. Each pair runs before then after, each on a fresh table: inserts (growing from empty,
batches of 65,536 new keys), lookups and lookup + Adagrad update of batches of 4,096 live keys, then
a checkpoint save and a restore into 2 shards (s/GiB of state, wall and CPU). Figures are per second of the process's CPU time (time.thread_time) as well
as wall time: on a shared machine CPU time moves far less with the load. Prints every pair and the
medians, and the after/before ratio of each median.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from pscluster.server import dynamic_table as after_table  # noqa: E402
from pscluster.server import table_state as after_state  # noqa: E402
from pscluster.server import tensor_files  # noqa: E402

from pscluster.optimizers import Adagrad  # noqa: E402
from pscluster.tables import Eviction, TableConfig  # noqa: E402

BATCH = 4096
GROW_BATCH = 65536


def _load(name: str, path: pathlib.Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def before_module(rev: str, tmp: pathlib.Path) -> types.ModuleType:
    """dynamic_table at `rev`, wired to hash_index at `rev`, with table_state at `rev` as its `state`."""
    for name in ("hash_index", "dynamic_table", "table_state"):
        text = subprocess.run(["git", "show", f"{rev}:server/{name}.py"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        (tmp / f"{name}.py").write_text(text)
    index = _load("ab_before_hash_index", tmp / "hash_index.py")
    table = _load("ab_before_dynamic_table", tmp / "dynamic_table.py")
    table.HashIndex = index.HashIndex  # type: ignore[attr-defined]
    state = _load("ab_before_table_state", tmp / "table_state.py")
    state.DynamicTable, state.TableStats = table.DynamicTable, table.TableStats  # type: ignore[attr-defined]
    table.state = state  # type: ignore[attr-defined]
    return table


def _save_before(path: pathlib.Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path))


def _read_before(path: pathlib.Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as fh:
        return {k: np.array(fh.get_tensor(k), copy=True, order="C") for k in fh.keys()}


def _read_after(path: pathlib.Path) -> dict[str, np.ndarray]:
    with tensor_files.TensorFile(path) as fh:
        return {k: fh.get(k) for k in fh.keys()}


def _timed(fn: Callable[[], int]) -> tuple[float, float]:
    """(items per CPU second, items per wall second) of one call of fn (it returns how many items)."""
    cpu, wall = time.thread_time(), time.perf_counter()
    done = fn()
    return done / (time.thread_time() - cpu), done / (time.perf_counter() - wall)


def measure(module: Any, keys: np.ndarray, dim: int, batches: list[np.ndarray], tmp: pathlib.Path) -> dict[str, float]:
    """Insert, lookup, lookup + update and checkpoint figures of one fresh table."""
    n = keys.size
    cfg = TableConfig(dim=dim, capacity=n + GROW_BATCH, eviction=Eviction("steps", max_idle=1e15))
    table = module.DynamicTable(cfg, Adagrad(0.01))
    grads = np.full((BATCH, dim), 0.01, np.float32)
    longest = 0.0

    def grow() -> int:
        nonlocal longest
        for i in range(0, n, GROW_BATCH):
            t0 = time.perf_counter()
            table.pull(keys[i:i + GROW_BATCH])
            longest = max(longest, time.perf_counter() - t0)
        return n

    def lookup() -> int:
        for b in batches:
            table.pull(b)
        return len(batches) * BATCH

    def update() -> int:
        for b in batches[:len(batches) // 2]:
            table.pull(b)
            table.push(b, grads)
        return len(batches) // 2 * BATCH

    out: dict[str, float] = {}
    for name, fn in (("insert", grow), ("lookup", lookup), ("lookup_update", update)):
        out[f"{name}_per_cpu_s"], out[f"{name}_per_s"] = _timed(fn)
    out["insert_longest_batch_s"] = longest
    before = module is not after_table
    ts = module.state if before else after_state
    path = tmp / "shard.safetensors"
    cpu, wall = time.thread_time(), time.perf_counter()
    # after: the state checkpoint.save writes (row order, views of the table's arrays where it can)
    state = ts.snapshot(table) if before else ts.snapshot(table, ordered=False)
    gib = sum(a.nbytes for a in state.values()) / 2**30
    tensor_files.write(path, state, {})
    out["save_s_per_gib"], out["save_cpu_s_per_gib"] = (time.perf_counter() - wall) / gib, (time.thread_time() - cpu) / gib
    del state
    cpu, wall = time.thread_time(), time.perf_counter()
    loaded = _read_after(path)
    cfg = TableConfig(dim=dim, capacity=n + GROW_BATCH, eviction=Eviction("steps", max_idle=1e15))
    if before:
        parts = [ts.load(module.DynamicTable(cfg, Adagrad(0.01)), part) for part in ts.reshard([loaded], 2)]
    else:  # each shard's rows gathered straight into its table
        parts = [ts.load(module.DynamicTable(cfg, Adagrad(0.01)), part, where) for part, where in ts.split([loaded], 2)]
    out["restore_s_per_gib"], out["restore_cpu_s_per_gib"] = (time.perf_counter() - wall) / gib, (time.thread_time() - cpu) / gib
    assert sum(p.live for p in parts) == n
    path.unlink()
    return out


def files(keys: np.ndarray, dim: int, pairs: int, tmp: pathlib.Path) -> None:
    """One table's snapshot written and read back by safetensors.numpy (+ the writable copy the PS made)
    and by server/tensor_files.py, alternating: s/GiB, wall and CPU."""
    cfg = TableConfig(dim=dim, capacity=keys.size + GROW_BATCH, eviction=Eviction("steps", max_idle=1e15))
    table = after_table.DynamicTable(cfg, Adagrad(0.01))
    for i in range(0, keys.size, GROW_BATCH):
        table.pull(keys[i:i + GROW_BATCH])
    state = after_state.snapshot(table)
    del table
    gib = sum(a.nbytes for a in state.values()) / 2**30
    path = tmp / "file.safetensors"
    runs: dict[str, list[float]] = {}
    for _ in range(pairs):
        for side in ("before", "after"):
            for what, fn in (("write", lambda: _save_before(path, state) if side == "before"
                              else tensor_files.write(path, state, {})),
                             ("read", lambda: _read_before(path) if side == "before" else _read_after(path))):
                cpu, wall = time.thread_time(), time.perf_counter()
                fn()
                runs.setdefault(f"{side}_{what}_s_per_gib", []).append((time.perf_counter() - wall) / gib)
                runs.setdefault(f"{side}_{what}_cpu_s_per_gib", []).append((time.thread_time() - cpu) / gib)
            path.unlink()
    med = {k: round(statistics.median(v), 3) for k, v in runs.items()}
    print(json.dumps({"figure": "checkpoint_files", "state_gib": round(gib, 3), "median": med,
                      "runs": {k: [round(x, 3) for x in v] for k, v in runs.items()}}), flush=True)


def main() -> None:
    """Alternate before and after; print each pair, the medians and the ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="main", help="git revision of the before side")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--files", action="store_true", help="only the checkpoint files: write and read one "
                    "snapshot with safetensors.numpy and with server/tensor_files.py, alternating")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    keys = rng.integers(-(2**63), 2**63 - 1, args.keys, dtype=np.int64, endpoint=True)
    if args.files:
        with tempfile.TemporaryDirectory(prefix="pscluster-ab-") as tmp:
            files(keys, args.dim, args.pairs, pathlib.Path(tmp))
        return
    batches = [keys[rng.integers(0, args.keys, BATCH)] for _ in range(64)]
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="pscluster-ab-") as tmp:
        sides = {"before": before_module(args.before, pathlib.Path(tmp)), "after": after_table}
        for pair in range(args.pairs):
            for side, module in sides.items():
                r = measure(module, keys, args.dim, batches, pathlib.Path(tmp))
                runs[side].append(r)
                print(json.dumps({"pair": pair, "side": side, **{k: round(v, 4) for k, v in r.items()}}), flush=True)
    med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    ratio = {k: med["after"][k] / med["before"][k] for k in med["after"]}
    print(json.dumps({"median": med, "after_over_before": {k: round(v, 3) for k, v in ratio.items()},
                      "before": args.before, "keys": args.keys, "dim": args.dim}), flush=True)


if __name__ == "__main__":
    main()
