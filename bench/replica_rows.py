"""The B15 family's rows (replicated PS shards, elastic PS): each bench_* runs its measurement (bench/replicas.py,
bench/elastic.py, bench/table_catch_up.py) and returns (its figures, its BENCHMARKS.md rows); bench/run.py runs
them by id (`python bench/run.py --only B15COST`)."""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from bench import elastic, heartbeats, replica_floor, replicas, table_catch_up

Row = tuple[str, str, str, str]  # id, what, measured, target and verdict


def bench_b15(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    f = replicas.failover(kills=args.kills)
    st = replicas.failover(kills=args.stops, sigstop=True)
    c = replicas.cost(runs=args.runs)
    return {"failover": f, "stop": st, "cost": c}, [
        ("B15", f"replicas: 2, 2 PS, SIGKILL of a counter's primary x {f['kills']} while a driver pushes back to back",
         f"kill -> first acknowledged push on the new primary p50 {f['p50_ms']:.0f} ms, p99 {f['p99_ms']:.0f} ms "
         f"(max {f['max_ms']:.0f}); {f['acknowledged']} pushes acknowledged, counter {f['counter']}, "
         f"lost_updates {f['lost_updates']}",
         f"p99 <= 1 s, p50 <= 300 ms, exact: "
         f"{'met' if f['p99_ms'] <= 1000 and f['p50_ms'] <= 300 and f['exact'] else 'NOT met'}"),
        ("B15", f"replicas: 2, 2 PS, SIGSTOP of a counter's primary x {st['kills']} while a driver pushes back to "
         "back (SIGCONT after the first push the new primary acknowledged)",
         f"stop -> first acknowledged push on the new primary p50 {st['p50_ms']:.0f} ms, p99 {st['p99_ms']:.0f} ms "
         f"(max {st['max_ms']:.0f}; socket_timeout_s is 30 s); counter {st['counter']} = "
         f"{st['acknowledged']} acknowledged, lost_updates {st['lost_updates']}",
         f"p99 <= 1 s, exact: {'met' if st['p99_ms'] <= 1000 and st['exact'] else 'NOT met'}"),
    ] + _cost_rows("B15", c)


def _cost_rows(rid: str, c: dict[str, Any]) -> list[Row]:
    """The rows of replicas.cost: the goals' figures (B2 async, B3 sync), then where each one's CPU went."""
    a, s = c["async"], c["sync"]
    load = f"load {c['load_before']:.1f} -> {c['load_after']:.1f}"
    rows: list[Row] = [
        (rid, "replication's cost on W2 (B2 async, B3 sync R = N = 2), replicas: 2 vs 1 alternating in the same run",
         f"async {a['replicas_2']:.0f} vs {a['replicas_1']:.0f} steps/s ({100 * a['cost']:.0f} % cost); sync "
         f"{s['replicas_2']:.0f} vs {s['replicas_1']:.0f} ({100 * s['cost']:.0f} %); accuracy with 2: async "
         f"{a['accuracy_2']:.4f}, sync {s['accuracy_2']:.4f} ({load})",
         f"<= 15 % async, <= 5 % sync: {'met' if a['cost'] <= 0.15 and s['cost'] <= 0.05 else 'NOT met'}")]
    for mode, label in (("async", "async, 2 workers"), ("sync", "sync R = N = 2"),
                        ("async_1w", "async, 1 worker (one closure at a time: spare cores unless cores busy nears 2)")):
        m = c.get(mode)
        if m is None:
            continue
        rows.append((rid, f"where replication's cost goes, W2 {label}: CPU ms per step per process (/proc user + "
                     "system) and voluntary context switches per step per PS, replicas: 1 -> 2 (medians)",
                     f"{m['replicas_2']:.0f} vs {m['replicas_1']:.0f} steps/s ({100 * m['cost']:.0f} % cost); PS CPU "
                     f"{m['ps_cpu_ms_1']:.2f} -> {m['ps_cpu_ms_2']:.2f} ms per step; all processes "
                     f"{m['total_cpu_ms_1']:.2f} -> {m['total_cpu_ms_2']:.2f} ms (CPU-bound prediction "
                     f"{100 * m['cpu_bound_cost']:.0f} %); cores busy {m['cores_busy_1']:.2f} -> "
                     f"{m['cores_busy_2']:.2f}; PS wake-ups "
                     f"{statistics.mean(v for k, v in m['wakeups_1'].items() if k.startswith('ps')):.1f} -> "
                     f"{statistics.mean(v for k, v in m['wakeups_2'].items() if k.startswith('ps')):.1f}; " +
                     (f"sync-state forwards {m['sync_changes_2']:.2f} per step; " if mode == "sync" and
                      "sync_changes_2" in m else "") +
                     ", ".join(f"{k} {m['cpu_ms_1'][k]:.2f} -> {m['cpu_ms_2'][k]:.2f}" for k in sorted(m["cpu_ms_1"]))
                     + f" ({load})", "measure (issue 24)"))
    return rows


def bench_b15cost(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    c = replicas.cost(runs=args.runs)
    return {"cost": c}, _cost_rows("B15COST", c)


def bench_b15table1(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    c = replicas.table_cost(runs=args.runs)
    return {"table_cost": c}, [
        ("B15TABLE1", "replicas: 1 routed by the replica table (elastic: true, no backups) vs placed by k mod P "
         "(elastic: false), W2 async (B2), alternating in the same run",
         f"{c['table']:.0f} vs {c['plain']:.0f} steps/s ({100 * c['cost']:.0f} % cost; per-pair ratios "
         f"{', '.join(f'{r:.2f}' for r in c['ratios'])}); PS CPU {c['ps_cpu_ms'][0]:.2f} -> {c['ps_cpu_ms'][1]:.2f} "
         f"ms per step; accuracy {c['accuracy']:.4f} (load {c['load_before']:.1f} -> {c['load_after']:.1f})",
         "a cost: every pair slower (elastic stays opt-in)" if max(c["ratios"]) < 1 else
         "within noise: pairs on both sides of 1 (issue 24)")]


def bench_b15scale(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    r = elastic.scale(cycles=args.cycles, elements=args.scale_elements, joins=args.joins)
    cells = []
    for what, label in (("remove", "PS 2 drained"), ("add", "PS 2 added back"), ("join", "unlisted PS 3 joined"),
                        ("leave", "PS 3 drained and left")):
        if what not in r:
            continue
        m = r[what]
        cells.append(f"{label}: freeze per moved primary p50 {m['freeze_p50_ms']:.1f} ms, max {m['freeze_max_ms']:.1f} "
                     f"ms over {m['moved_primaries']}; longest gap between acknowledged pushes p50 "
                     f"{m['gap_p50_ms']:.0f} ms, max {m['gap_max_ms']:.0f} ms")
    worst = max(r[what]["freeze_max_ms"] for what in ("remove", "add", "join", "leave") if what in r)
    size = "one-shard counters" if r["elements"] == 1 else f"one-shard int64 counters of {r['elements'] * 8 >> 20} MiB each"
    return r, [("B15SCALE", f"elastic PS: replicas: 2, 3 PS, {r['shards']} {size}, PS 2 drained and added "
                f"back x {r['cycles']}, then a PS not in the cluster file joined, added, drained and removed x "
                f"{r['joins']}, while a driver pushes +1 to all back to back",
                "; ".join(cells) + f"; {r['acknowledged']} pushes acknowledged, counters "
                f"{'all equal to it' if r['exact'] else r['counters']}, lost_updates {r['lost_updates']}",
                f"freeze <= 50 ms per shard, exact: {'met' if worst <= 50 and r['exact'] else 'NOT met'}")]


def bench_b15scale_large(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    load = os.getloadavg()[0]
    r = elastic.scale_large(cycles=args.large_cycles, mib=args.large_mib, table_keys=args.large_keys)
    load = f"load {load:.1f} -> {os.getloadavg()[0]:.1f}"
    cells = [f"{label}: p50 {r[kind]['freeze_p50_ms']:.1f} ms, max {r[kind]['freeze_max_ms']:.1f} ms over "
             f"{r[kind]['moved_primaries']}" for kind, label in
             (("scalar", "scalar counters"), ("dense", f"{r['mib']} MiB dense shard"),
              ("table", f"dynamic table shard of {r['table_keys']:,} keys")) if kind in r]
    return r, [("B15SCALELARGE", f"elastic PS by shard size: replicas: 2, 3 PS, 6 scalar counters pushed back to back, "
                f"a one-shard {r['mib']} MiB int64 variable and a one-shard dynamic table of {r['table_keys']:,} keys "
                f"(dim 4); each PS drained and added back x {r['cycles']}; "
                "`python bench/run.py --only B15SCALELARGE`",
                "freeze per moved primary: " + "; ".join(cells) + f"; {r['acknowledged']} pushes acknowledged, "
                f"counters {'all equal to it' if r['exact'] else 'NOT equal to it'}, large shards "
                f"{'intact' if r['large_intact'] else 'CHANGED'}, lost_updates {r['lost_updates']} ({load})",
                "freeze flat with shard size (<= 50 ms): "
                f"{'met' if r['exact'] and max(r[k]['freeze_max_ms'] for k in ('dense', 'table') if k in r) <= 50 else 'NOT met'}")]


def bench_b15scale_sync(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    r = elastic.scale_sync(cycles=args.sync_cycles)
    return r, [("B15SCALESYNC", f"elastic PS in a sync job: replicas: 2, 3 PS, 2 workers (R = N = 2), {r['shards']} "
                f"one-shard counters pushed by every closure, PS 2 drained and added back x {r['cycles']}; "
                "`python bench/run.py --only B15SCALESYNC`",
                f"freeze per moved primary (it includes the wait for the open step's last gradient) p50 "
                f"{r['freeze_p50_ms']:.1f} ms, max {r['freeze_max_ms']:.1f} ms over {r['moved_primaries']}; "
                f"{r['steps']} steps, counters {'all equal to it' if r['exact'] else r['counters']}, lost_updates "
                f"{r['lost_updates']}", f"exact: {'met' if r['exact'] else 'NOT met'}")]


def bench_b15_memory(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    m = replicas.memory()
    one, two = m["replicas_1"], m["replicas_2"]
    return m, [("B15MEM", f"replicas: 2 vs 1, 2 PS, one {m['mib']} MiB float32 Adam variable per PS (3x of state per "
                "copy), 20 pushes each; peak RSS (VmHWM) per PS; `python bench/run.py --only B15MEM`",
                f"peak {max(two['peak_mib']):.0f} vs {max(one['peak_mib']):.0f} MiB ({m['peak_ratio']:.2f}x), "
                f"{m['state_ratio']:.2f}x above the bare daemon ({max(one['base_mib']):.0f} MiB); RSS at the end "
                f"{max(two['rss_mib']):.0f} vs {max(one['rss_mib']):.0f} MiB",
                f"<= 2.1x: {'met' if m['peak_ratio'] <= 2.1 else 'NOT met'}")]


def bench_b15_soak(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    from bench import replica_soak

    runs = [replica_soak.soak(mode, kills=k, seed=i)
            for i, (mode, k) in enumerate(zip(("async", "sync", "bounded"), _split(args.soak_kills, 3)))]
    cells = "; ".join(f"{r['mode']}: {r['kills']} kills ({r['kinds']['mid-catch-up']} mid-catch-up, {r['kinds']['mid-rejoin']} "
                      f"mid-rejoin, {r['sync_state_kills']} of the token queue's primary), {r['closures']} "
                      f"closures, counters {r['counters']} vs {r['expected']}"
                      + (f", global step {r['global_step']}" if r["global_step"] is not None else "")
                      + f", lost_updates {r['lost_updates']}, "
                      f"{r['checkpoints']['saved']} checkpoints, {r['seconds']:.0f} s" for r in runs)
    return {"runs": runs}, [("B15SOAK", "replicas: 2, 3 PS + 2 workers, a random PS SIGKILLed every ~2 s (mid-push, "
                             "mid-checkpoint, mid-catch-up) under async, sync, bounded; any PS, the one holding the "
                             "sync token queue included; `python bench/run.py --only B15SOAK`",
                             cells, f"exact, 0 lost: {'met' if all(r['exact'] for r in runs) else 'NOT met'}")]


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def bench_b15tablecatchup(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    r = table_catch_up.run(args.large_keys, 64, args.runs)
    rows = [("B15TABLECATCHUP", f"a dynamic table shard's catch-up to a new backup, {r['keys'] / 1e6:.0f} M keys x "
             f"{r['dim']} float32 Adagrad ({r['state_mib']:.0f} MiB), over the framed bulk port in one process, "
             f"in 8 MiB chunks vs one message, alternating, median of {len(r['time_ratios'])}: "
             f"`python bench/run.py --only B15TABLECATCHUP --runs {args.runs}`",
             f"chunked {r['chunked_s']:.2f} s vs whole {r['whole_s']:.2f} s (runs {r['chunked_runs_s']} vs "
             f"{r['whole_runs_s']}, same-pair ratios {r['time_ratios']}); peak RSS "
             f"growth {r['chunked_peak_rss_mib']:.0f} vs {r['whole_peak_rss_mib']:.0f} MiB",
             "no frame over a chunk: met by construction (whole needs one frame of the table's size)")]
    return r, rows


def bench_b15falsedown(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    r = heartbeats.run(args.false_down_s, args.burners)
    return r, [("B15FALSEDOWN", f"replicas: 2, 2 PS, a counter pushed back to back, nothing killed, {r['burners']} "
                f"busy-looping processes beside it for {r['seconds']:.0f} s (bench/heartbeats.py): "
                f"`python bench/run.py --only B15FALSEDOWN --burners {r['burners']}`",
                f"live PS tasks marked down {r['marked_down']}; the keeper's Status calls p50 "
                f"{r['status_p50_ms']:.0f} ms, p99 {r['status_p99_ms']:.0f} ms, max {r['status_max_ms']:.0f} ms "
                f"(a call times out at 250 ms), {r['status_over_250_ms']} of {r['status_calls']} over 250 ms; counter "
                f"{r['counter']} = {r['acknowledged']} acknowledged, lost_updates {r['lost_updates']} (load "
                f"{r['load_before']:.1f} -> {r['load_after']:.1f})",
                f"no live PS marked down: {'met' if r['marked_down'] == 0 and r['exact'] else 'NOT met'}")]


def bench_b15floor(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    f = replica_floor.floor(runs=args.runs)
    load = f"load {f['load_before']:.1f} -> {f['load_after']:.1f}"
    return f, [("B15FLOOR", f"the second copy's least CPU per W2 push, in-process (bench/replica_floor.py: a primary and a "
                f"backup behind a real bulk port, {f['pushes']} pushes, medians of {args.runs} alternating rounds); "
                f"`python bench/run.py --only B15FLOOR --runs {args.runs}`",
                f"one copy {f['one']:.2f} ms; backup acks without applying {f['ack']:.2f} ms (transport "
                f"{f['transport_ms']:.2f}); backup applies {f['apply']:.2f} ms (apply {f['apply_ms']:.2f}); the copy "
                f"{f['copy_ms']:.2f} ms per push; the copy as 2 PS make it (W2's shards in two halves, a batch each) "
                f"{f['split_ms']:.2f} ms per step ({load})", "measure (issue 24: what 2 cores allow)")]


BENCHES = {"B15": bench_b15, "B15COST": bench_b15cost, "B15TABLE1": bench_b15table1, "B15SCALE": bench_b15scale,
           "B15SCALESYNC": bench_b15scale_sync, "B15SCALELARGE": bench_b15scale_large, "B15SOAK": bench_b15_soak,
           "B15MEM": bench_b15_memory, "B15TABLECATCHUP": bench_b15tablecatchup,
           "B15FALSEDOWN": bench_b15falsedown, "B15FLOOR": bench_b15floor}
