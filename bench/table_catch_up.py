"""B15TABLECATCHUP: a dynamic table shard's catch-up to a new backup (replicas: 2), in chunks vs whole.

One process holds a primary and a backup core; the primary sends over the backup's real framed bulk port
(loopback, the daemon's limits: server/main.py), so the time includes encoding, the socket and building the
table on the backup. Chunked: the daemon's chunk size (8 MiB); whole: one message (what a table's catch-up
was before). Alternating in the same run; peak RSS growth during the catch-up (both sides, one process).

    python bench/table_catch_up.py --keys 1000000 --dim 64 --runs 3
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

import numpy as np
from pscluster.server import catch_up, sync_replicas
from pscluster.server import table_state as ts
from pscluster.server.bulk import BulkHandlers
from pscluster.server.ps import ParameterServerCore
from pscluster.server.replica_links import FrameLink
from pscluster.server.replication import Replication, Role
from pscluster.server.store import PushItem, ShardSpec

from pscluster.config import ClusterSpec, Settings
from pscluster.net import frame_server
from pscluster.optimizers import Adagrad
from pscluster.tables import TableConfig

KEY = ("emb", 0)


def _vm(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS (VmHWM) becomes the RSS now


def _no_link(ps: int) -> FrameLink:
    raise RuntimeError("the backup forwards nothing")


def one(keys: int, dim: int, chunked: bool) -> dict[str, float]:
    """One catch-up of a keys x dim Adagrad table shard: seconds, MiB of state, peak RSS growth in MiB."""
    settings = Settings(cluster=ClusterSpec(ps=["127.0.0.1:1", "127.0.0.1:2"]), token="bench")
    chunk = min(catch_up.CHUNK_BYTES, settings.max_tensor_bytes // 2, settings.max_message_bytes // 2)
    backup = ParameterServerCore(1, 2)
    sync_replicas.attach(backup)
    backup.replication = Replication(backup.store, 1, _no_link)
    limits = frame_server.limits(settings)
    frames = BulkHandlers(backup).server("127.0.0.1", "bench", settings.max_message_bytes, **limits).start()
    primary = ParameterServerCore(0, 2)
    sync_replicas.attach(primary)
    primary.replication = Replication(
        primary.store, 0, lambda ps: FrameLink(settings.cluster.ps[ps], settings, port_of=lambda timeout: frames.port),
        timeout=300.0, chunk_bytes=chunk if chunked else 1 << 62)
    try:
        cfg = TableConfig(dim=dim, capacity=keys + keys // 8)
        primary.create(ShardSpec("emb", 0, 1, (0, dim), (0, dim), 0, "<f4", Adagrad(0.05), True, 0, cfg.to_json()),
                       None, "zeros", 0, 0)
        primary.replication.set_roles(1, [Role(KEY, 1, 0)])
        ids = np.random.default_rng(0).permutation(np.arange(keys, dtype=np.int64) * 7 + 3)
        step = 100_000
        for i in range(0, keys, step):
            part = ids[i:i + step]
            primary.push(f"fill{i}", 0, [PushItem(KEY, np.full((part.size, dim), 0.1, np.float32), part)])
        table = primary.store.get(KEY).table
        assert table is not None
        state_mib = (table.live * (8 + 8 + 2 * dim * 4)) / 2**20  # key, last step, row and accumulator
        gc.collect()
        _reset_peak()
        rss = _vm("VmRSS:")
        start = time.perf_counter()
        for core in (backup, primary):
            core.replication.set_roles(2, [Role(KEY, 2, 0, 1)])
        while primary.replication.catching_up():
            time.sleep(0.005)
        seconds = time.perf_counter() - start
        peak = _vm("VmHWM:") - rss
        copy = backup.store.get(KEY).table
        assert copy is not None and copy.live == table.live and np.array_equal(
            ts.snapshot(copy)["values"][:1000], ts.snapshot(table)["values"][:1000])
        return {"seconds": seconds, "state_mib": state_mib, "peak_rss_mib": peak}
    finally:
        primary.replication.stop()
        backup.replication.stop()
        frames.stop()


def run(keys: int = 1_000_000, dim: int = 64, runs: int = 3) -> dict[str, Any]:
    """Alternating chunked and whole catch-ups, `runs` of each (after a small warm-up of both); medians and
    per-pair ratios (chunked / whole)."""
    one(10_000, dim, True)  # the compiled kernels' first calls and imports, paid before any timed run
    one(10_000, dim, False)
    pairs = []
    for i in range(runs):  # the order alternates too: neither mode always runs on a fresh process's heap
        first = one(keys, dim, i % 2 == 0)
        second = one(keys, dim, i % 2 == 1)
        pairs.append((first, second) if i % 2 == 0 else (second, first))
    out: dict[str, Any] = {"keys": keys, "dim": dim, "state_mib": pairs[0][0]["state_mib"]}
    for i, name in enumerate(("chunked", "whole")):
        out[f"{name}_s"] = statistics.median(p[i]["seconds"] for p in pairs)
        out[f"{name}_peak_rss_mib"] = statistics.median(p[i]["peak_rss_mib"] for p in pairs)
        out[f"{name}_runs_s"] = [round(p[i]["seconds"], 2) for p in pairs]
    out["time_ratios"] = [round(c["seconds"] / w["seconds"], 2) for c, w in pairs]
    return out


def main() -> None:
    """Print the medians as JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(run(args.keys, args.dim, args.runs), indent=1))


if __name__ == "__main__":
    main()
