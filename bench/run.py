"""Run the benchmarks of ../shared/BENCHMARKS.md and write the table into BENCHMARKS.md.

    python bench/run.py --write BENCHMARKS.md            # everything (several minutes)
    python bench/run.py --only B1,B9                     # a subset, printed only
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import pathlib
import platform
import statistics
import sys
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
# run as a script, bench/ itself is first on sys.path, where bench/profile.py would shadow the standard
# profile module (torch.optim imports it): the repository root takes its place
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # the benchmark process shares 2 cores with daemons

from bench import chaos, closures, copies, floor, profile, replica_rows, training, transfer  # noqa: E402

Row = tuple[str, str, str, str]  # id, what, measured, target and verdict


def _runs(fn: Callable[[], dict[str, float]], n: int) -> dict[str, float]:
    """Median of every field over n runs."""
    results = [fn() for _ in range(n)]
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


def bench_b1(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    r = transfer.b1(runs=args.runs)
    rows = [("B1", "pull 100 MB float32 sharded over 2 PS (bulk path over TCP, `shared_memory: false`)",
             f"{r['ps_pull_gbps']:.2f} GB/s = {r['pull_vs_tcp']:.2f} x raw TCP ({r['tcp_pull_gbps']:.2f}); "
             f"gRPC-only path {r['ps_pull_grpc_gbps']:.2f}; raw grpcio stream {r['grpc_stream_gbps']:.2f}, "
             f"one message {r['grpc_one_message_gbps']:.2f}; same-host shared memory (the default here) "
             f"{r['ps_pull_shm_gbps']:.2f}",
             f">= 0.75 x TCP: {'met' if r['pull_vs_tcp'] >= 0.75 else 'NOT met'}"),
            ("B1", "push 100 MB + SGD on the PS (bulk path over TCP)",
             f"{r['ps_push_gbps']:.2f} GB/s = {r['push_vs_tcp']:.2f} x raw TCP ({r['tcp_push_gbps']:.2f}); "
             f"gRPC-only path {r['ps_push_grpc_gbps']:.2f}; same-host shared memory {r['ps_push_shm_gbps']:.2f}",
             f">= 0.75 x TCP: {'met' if r['push_vs_tcp'] >= 0.75 else 'NOT met'}")]
    return r, rows


def bench_b1tls(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    r = transfer.b1_tls(runs=args.runs)
    b4 = _runs(lambda: closures.b4(tls=False), max(1, args.runs // 2))
    b4t = _runs(lambda: closures.b4(tls=True), max(1, args.runs // 2))
    r.update({"b4_round_trip_ms": b4["round_trip_ms"], "b4_tls_round_trip_ms": b4t["round_trip_ms"],
              "b4_closures_per_s": b4["closures_per_s"], "b4_tls_closures_per_s": b4t["closures_per_s"]})
    ok = min(r["pull_tls_ratio"], r["push_tls_ratio"]) >= 0.5
    return r, [("B1TLS", "pull / push 100 MB over 2 PS, mutual TLS beside plaintext (bulk path, same run)",
                f"pull {r['ps_pull_tls_gbps']:.2f} GB/s with TLS vs {r['ps_pull_gbps']:.2f} plaintext "
                f"(x{r['pull_tls_ratio']:.2f}); push {r['ps_push_tls_gbps']:.2f} vs {r['ps_push_gbps']:.2f} "
                f"(x{r['push_tls_ratio']:.2f})", f"TLS >= 0.5 x plaintext: {'met' if ok else 'NOT met'}"),
               ("B1TLS", "B4 with TLS: empty closures, 2 workers, mutual TLS beside plaintext (same run)",
                f"round trip {r['b4_tls_round_trip_ms']:.2f} ms with TLS vs {r['b4_round_trip_ms']:.2f} plaintext; "
                f"{r['b4_tls_closures_per_s']:.0f} vs {r['b4_closures_per_s']:.0f} closures/s", "table")]


def bench_b9(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    r = transfer.b9()
    return r, [("B9", "PS peak RSS, 1 GiB float32 variable (SGD), 2 concurrent pulls",
                f"baseline {r['baseline_rss'] / 2**20:.0f} MiB + {r['ratio']:.3f} x the variable "
                f"(peak {r['peak_rss_during_pulls'] / 2**20:.0f} MiB)",
                f"<= 1.3 x + baseline: {'met' if r['ratio'] <= 1.3 else 'NOT met'}")]


def bench_b2(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    base = training.numpy_baseline()
    # default and fused push-pull alternate, so both see the same machine
    pairs = [(training.w2(), training.w2(push_pull=True)) for _ in range(args.runs)]
    r = {k: statistics.median(a[k] for a, _ in pairs) for k in pairs[0][0]}
    rpp = {k: statistics.median(b[k] for _, b in pairs) for k in pairs[0][1]}
    r10 = _runs(lambda: training.w2(steps_per_closure=10), max(3, args.runs // 2))
    out = {"numpy": base, "w2": r, "w2_push_pull": rpp, "w2_10_per_closure": r10}

    def row(what: str, m: dict[str, float]) -> Row:
        return ("B2", what, f"{m['steps_per_s']:.0f} steps/s, accuracy {m['accuracy']:.4f} "
                f"(single-process numpy in the same run: {base['steps_per_s']:.0f} steps/s, {base['accuracy']:.4f}; "
                f"ratio {m['steps_per_s'] / base['steps_per_s']:.2f})",
                f">= 1000 steps/s: {'met' if m['steps_per_s'] >= 1000 else 'NOT met'}; acc >= 0.925: "
                f"{'met' if m['accuracy'] >= 0.925 else 'NOT met'}; >= 0.45 x numpy: "
                f"{'met' if m['steps_per_s'] >= 0.45 * base['steps_per_s'] else 'NOT met'}")

    return out, [row("W2 async, 2 PS + 2 workers, 1 step/closure", r),
                 row("W2 async, 1 step/closure, fused push-pull (`push_pull: true`)", rpp),
                 ("B2", "W2 async, 10 steps/closure", f"{r10['steps_per_s']:.0f} steps/s, accuracy {r10['accuracy']:.4f}",
                  "(TF PSS: 258)")]


def bench_floor(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    base = training.numpy_baseline()
    # bare sockets and pscluster alternate, so both see the same machine
    triples = [(floor.w2_floor(), floor.w2_floor(dispatch=True), training.w2(push_pull=True)) for _ in range(args.runs)]
    bare = {k: statistics.median(a[k] for a, _, _ in triples) for k in triples[0][0]}
    sent = {k: statistics.median(b[k] for _, b, _ in triples) for k in triples[0][1]}
    ours = statistics.median(c["steps_per_s"] for _, _, c in triples)
    out = {"numpy": base, "floor": bare, "floor_with_dispatch": sent, "w2_push_pull_steps_per_s": ours}
    return out, [("FLOOR", "W2 async over bare sockets + numpy (2 PS + 2 worker processes, a fused push-pull, no "
                           "coordinator, no framing or validation; bench/floor.py): the ceiling of this layout",
                  f"{bare['steps_per_s']:.0f} steps/s = {bare['steps_per_s'] / base['steps_per_s']:.2f} x single-process "
                  f"numpy ({base['steps_per_s']:.0f}); workers {bare['worker_cpu_us_per_step']:.0f} us of CPU per step; "
                  f"with a 1-byte closure per step from this process (2 in flight per worker): "
                  f"{sent['steps_per_s']:.0f} steps/s = {sent['steps_per_s'] / base['steps_per_s']:.2f} x numpy, "
                  f"{sent['coordinator_cpu_us_per_step']:.0f} us of dispatcher CPU per step; "
                  f"pscluster W2 push-pull in the same run {ours:.0f} steps/s = {ours / sent['steps_per_s']:.2f} x the "
                  f"floor with dispatch", "table (what pscluster adds)")]


def bench_b3(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    sync = _runs(lambda: training.w2(mode="sync", replicas_to_aggregate=2, total_num_replicas=2), args.runs)
    bounded = _runs(lambda: training.w2(mode="bounded", staleness=2), args.runs)
    asyn = _runs(lambda: training.w2(), args.runs)
    out = {"sync": sync, "bounded": bounded, "async": asyn}
    return out, [("B3", "W2 sync (R = N = 2), minibatches/s",
                  f"{sync['steps_per_s']:.0f} steps/s, accuracy {sync['accuracy']:.4f} (async same run "
                  f"{asyn['steps_per_s']:.0f})",
                  f">= 460 (2 x Ray's 230), acc >= 0.92: "
                  f"{'met' if sync['steps_per_s'] >= 460 and sync['accuracy'] >= 0.92 else 'NOT met'}"),
                 ("B3", "W2 bounded staleness (tau = 2)",
                  f"{bounded['steps_per_s']:.0f} steps/s, accuracy {bounded['accuracy']:.4f}", "acc >= 0.92: "
                  f"{'met' if bounded['accuracy'] >= 0.92 else 'NOT met'}")]


def bench_b4(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    r = _runs(closures.b4, args.runs)
    bare = floor.round_trip_floor()  # the least any round trip between two processes costs here
    r["bare_round_trip_ms"] = bare["round_trip_us"] / 1e3
    return r, [("B4", "empty closures through the coordinator, 2 workers",
                f"{r['closures_per_s']:.0f} closures/s; round trip {r['round_trip_ms']:.2f} ms "
                f"(p90 {r['round_trip_p90_ms']:.2f}); driver + coordinator CPU {r['coordinator_cpu_ms']:.3f} ms "
                f"per closure; a bare blocking 1-byte round trip between two processes in the same run: "
                f"{r['bare_round_trip_ms']:.3f} ms",
                f"<= 0.15 ms round trip: {'met' if r['round_trip_ms'] <= 0.15 else 'NOT met'}; <= 0.1 ms CPU: "
                f"{'met' if r['coordinator_cpu_ms'] <= 0.1 else 'NOT met'}")]


def bench_b5(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    r = closures.b5(runs=args.runs)
    return r, [("B5", "worker SIGKILLed while busy (50 ms closures)",
                f"its closures finished elsewhere after {r['seconds_median']:.3f} s (max {r['seconds_max']:.3f}); "
                f"{r['applied_twice']} updates applied twice in {r['runs']} runs",
                f"<= 0.5 s, zero twice: {'met' if r['seconds_median'] <= 0.5 and r['applied_twice'] == 0 else 'NOT met'}")]


def bench_b6(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    r = closures.b6(runs=max(3, args.runs // 2))
    return r, [("B6", "worker SIGSTOPped (hang), default heartbeats (0.5 s / 2 s)",
                f"its closures finished elsewhere after {r['seconds_median']:.2f} s (max {r['seconds_max']:.2f}); "
                f"{r['applied_twice']} applied twice", f"<= 3 s: {'met' if r['seconds_max'] <= 3 else 'NOT met'}")]


def bench_b7(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    r = closures.b7(runs=3)
    return r, [("B7", "PS SIGKILLed mid-run, restarted from checkpoint by the launcher",
                f"closures complete again {r['pause_s_median']:.2f} s after the kill (restart + restore "
                f"{r['restart_and_restore_s_median']:.2f} s); lost updates reported exactly in "
                f"{r['runs_with_exact_lost_report']}/{r['runs']} runs (median {r['lost_updates_median']:.0f})",
                f"<= 5 s + restore: {'met' if r['pause_s_median'] <= 5 + r['restart_and_restore_s_median'] else 'NOT met'}")]


def bench_b8(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    rows = []
    out: dict[str, Any] = {}
    for hidden, label in ((128, "W2"), (1280, "W2 with 1280 hidden units (10x the compute)")):
        base = training.numpy_baseline(steps=1000, hidden=hidden)
        cells = []
        for p in (1, 2):
            for w in (1, 2, 4):
                r = training.w2(num_ps=p, num_workers=w, steps=1000, hidden=hidden)
                out[f"{hidden}:{p}x{w}"] = r
                cells.append(f"{p} PS x {w} W: {r['steps_per_s']:.0f} ({r['steps_per_s'] / base['steps_per_s']:.2f}x)")
        out[f"{hidden}:numpy"] = base
        rows.append(("B8", f"{label} async steps/s by (PS, workers), 1000 steps; (x single-process numpy "
                     f"{base['steps_per_s']:.0f} steps/s, same run)", "; ".join(cells), "table (2 cores total)"))
    return out, rows


def bench_b10(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    r = closures.b10()
    ok = r["rss_growth_mib"] <= 50 and r["last_vs_first"] >= 0.9
    return r, [("B10", f"{r['closures']:,} empty closures, one coordinator, 2 workers (join every 10k)",
                f"coordinator RSS {r['rss_at_first_window_mib']:.0f} MiB at 100k -> {r['rss_at_end_mib']:.0f} MiB "
                f"at 1M (+{r['rss_growth_mib']:.1f} MiB); {r['first_window_per_s']:.0f} closures/s over the first "
                f"100k, {r['last_window_per_s']:.0f} over the last (x{r['last_vs_first']:.2f})",
                f"<= 50 MiB growth, >= 0.9 x rate: {'met' if ok else 'NOT met'}")]


def bench_b11(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    r = chaos.soak(duration_s=600.0, seed=0)
    g = r["growth"]
    flat = "; ".join(f"{role} threads {v['threads_early']:.0f}->{v['threads_late']:.0f}, fds "
                     f"{v['fds_early']:.0f}->{v['fds_late']:.0f}, RSS {v['rss_mib_early']:.0f}->{v['rss_mib_late']:.0f} MiB"
                     for role, v in g.items())
    return r, [("B11", "chaos soak: 10 min W2 async, 2 PS + 3 workers, seed 0, automatic checkpoints every 5 s; "
                "a separate run: `python bench/run.py --only B11`",
                f"{r['completed']} closures, {r['unresolved']} unresolved, {r['errors']} errors; "
                f"{r['worker_kills']} worker SIGKILLs, {r['worker_stops']} SIGSTOPs, {r['ps_kills']} PS SIGKILLs, "
                f"{r['retried']} retried; counter {r['counter']} = completed - lost ({r['lost_counter_updates']}): "
                f"{r['exact']}; accuracy {r['accuracy']:.4f}; per role, max over minute 2-3 -> min over 9.2-10: {flat}",
                "all resolved, exact, acc >= 0.92, no growth (RSS within 20 MiB): "
                f"{'met' if r['ok'] else 'NOT met'}")]


def bench_b12(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    from bench import torch_cnn  # torch is an optional extra: imported only for B12

    one = _runs(torch_cnn.single, args.runs)
    ddp = _runs(torch_cnn.ddp, args.runs)
    ps_ = _runs(torch_cnn.cluster, args.runs)
    out = {"single": one, "ddp": ddp, "cluster": ps_}
    return out, [("B12", "torch CNN (examples/torch_mnist.py, 20.5k params, Adam 2e-3), 100 + 1000 minibatches of 64; "
                  "`python bench/run.py --only B12`",
                  f"2 PS + 2 workers {ps_['steps_per_s']:.0f} steps/s, accuracy {ps_['accuracy']:.4f}; single-process "
                  f"torch {one['steps_per_s']:.0f} steps/s, {one['accuracy']:.4f}; DDP gloo x2 "
                  f"{ddp['steps_per_s']:.0f} steps/s, {ddp['accuracy']:.4f}; cluster = "
                  f"{ps_['steps_per_s'] / one['steps_per_s']:.2f} x single, {ps_['steps_per_s'] / ddp['steps_per_s']:.2f} x DDP",
                  "table, same run (accuracy >= 0.95 for the cluster: "
                  f"{'met' if ps_['accuracy'] >= 0.95 else 'NOT met'})")]


def bench_b14_cnn(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    from bench import torch_cnn  # torch is an optional extra: imported only here

    one = _runs(lambda: torch_cnn.single(recipe="adamw-cosine"), args.runs)
    ps_ = _runs(lambda: torch_cnn.cluster(recipe="adamw-cosine"), args.runs)
    return {"single": one, "cluster": ps_}, [
        ("B14CNN", "torch CNN of B12 with AdamW (2e-3, wd 0.01) + 100 linear warmup updates + cosine decay "
         "(SequentialLR, from_torch on the PS), 100 + 1000 minibatches of 64; `python bench/run.py --only B14CNN`",
         f"2 PS + 2 workers {ps_['steps_per_s']:.0f} steps/s, accuracy {ps_['accuracy']:.4f}; single-process torch "
         f"{one['steps_per_s']:.0f} steps/s, {one['accuracy']:.4f}; cluster = "
         f"{ps_['steps_per_s'] / one['steps_per_s']:.2f} x single",
         "table, same run (second half of B14; accuracy within 1 point of single-process: "
         f"{'met' if ps_['accuracy'] >= one['accuracy'] - 0.01 else 'NOT met'})")]


def bench_b14_precision(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    from bench import fit_bench, torch_cnn  # torch is an optional extra: imported only here

    one = _runs(torch_cnn.single, args.runs)
    f32 = _runs(lambda: fit_bench.precision("float32"), args.runs)
    bf16 = _runs(lambda: fit_bench.precision("bfloat16"), args.runs)
    ratio = bf16["pushed_bytes_per_step"] / f32["pushed_bytes_per_step"]
    drop = 100 * (f32["accuracy"] - bf16["accuracy"])
    # the same comparison without asynchrony: one process, seeds 0..runs-1, the same minibatches for both dtypes
    fixed = {d: [fit_bench.precision_in_process(d, seed)["accuracy"] for seed in range(args.runs)]
             for d in ("float32", "bfloat16")}
    gaps = [100 * (a - b) for a, b in zip(fixed["float32"], fixed["bfloat16"])]
    out = {"single": one, "float32": f32, "bfloat16": bf16, "in_process": fixed}
    return out, [("B14MP", "torch CNN of B12 (Adam 2e-3) on 2 PS + 2 workers in float32 and in bfloat16 (float32 masters "
                  "on the PS), 100 + 1000 minibatches of 64, medians of --runs; `python bench/run.py --only B14MP --runs 5`",
                  f"float32 {f32['steps_per_s']:.0f} steps/s, {f32['pushed_bytes_per_step'] / 1e3:.1f} kB pushed/step, "
                  f"accuracy {f32['accuracy']:.4f}; bfloat16 {bf16['steps_per_s']:.0f} steps/s, "
                  f"{bf16['pushed_bytes_per_step'] / 1e3:.1f} kB pushed/step ({ratio:.2f} x), accuracy "
                  f"{bf16['accuracy']:.4f}; single-process torch {one['steps_per_s']:.0f} steps/s, {one['accuracy']:.4f}; "
                  f"in one process without asynchrony (float32 masters, the same minibatches per seed), points lost "
                  f"per seed {', '.join(f'{g:+.1f}' for g in gaps)} (median {statistics.median(gaps):+.1f})",
                  f"about half the bytes, <= 0.5 points lost (cluster medians): "
                  f"{'met' if ratio <= 0.55 and drop <= 0.5 else 'NOT met'}")]


def bench_fit(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    from bench import fit_bench

    r = fit_bench.overhead(pairs=args.runs)
    ratios = [f / loop for f, loop in zip(r["fit"], r["loop"])]
    med = statistics.median(ratios)
    return {"pairs": r, "ratios": ratios}, [
        ("FIT", "pscluster.training.fit vs the same step in a hand-written schedule/join loop (4 epochs x 100 closures, "
         "CNN of B12, 2 PS + 2 workers, alternating pairs on one cluster); `python -m bench.run --only FIT`",
         f"loop {statistics.median(r['loop']):.0f} steps/s, fit {statistics.median(r['fit']):.0f} steps/s; "
         f"fit / loop per pair {', '.join(f'{x:.3f}' for x in ratios)} (median {med:.3f})",
         f"overhead <= 3%: {'met' if med >= 0.97 else 'NOT met'}")]


def bench_b13(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    from bench import sparse

    r = sparse.b13(reps=args.runs, tf_python=args.tf_python, dynamic=True)
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_batch"].items())
    tf = ""
    verdict = "TF not run (--tf-python)"
    if "tf" in r:
        tf_cpu = sum(r["tf_cpu_ms_per_batch"].values())
        tf = (f"; TF PSS same run {r['tf'] / 1e6:.2f} M rows/s ({tf_cpu:.1f} ms of CPU per batch): "
              f"{r['ratio']:.2f} x TF")
        verdict = f">= 2 x TF: {'met' if r['ratio'] >= 2 else 'NOT met'}"
    return r, [("B13", "sparse workload of issue 26: 10 M x 64 float32 (2.4 GiB) in 2 shards on 2 PS, 2 workers, a "
                "closure per batch of 4,096 random ids (pull the unique rows, push 2 x row x count, SGD 0.01); rows "
                "pulled + pushed = 2 x 4,096 per batch; median of repetitions of 20 + 400 closures, alternating with "
                "TF; `python bench/run.py --only B13 --tf-python PATH/TO/tf-venv/bin/python`",
                f"{r['pscluster'] / 1e6:.2f} M rows/s (CPU ms per batch: {cpu}){tf}; single-closure loop on one "
                f"worker {r['loop'] / 1e6:.2f} M rows/s; worker peak RSS {r['worker_peak_rss_mib']:.0f} MiB = "
                f"{r['worker_peak_rss_mib'] / r['table_mib']:.3f} x the table; largest PS RSS "
                f"{r['ps_max_rss_mib']:.0f} MiB", verdict),
               ("B13", "the same workload on a hash-keyed dynamic table of the same cluster (empty at the start, ids "
                "hashed into 10 M distinct int64 keys, capacity 6 M per shard), alternating with the fixed table and "
                "TF in each repetition; same command",
                f"{r['dynamic'] / 1e6:.2f} M rows/s, {r['dynamic_live_keys']:,} live keys at the end"
                + (f"; {r['dynamic_ratio']:.2f} x TF's fixed table (per repetition "
                   + ", ".join(f"{x:.2f}" for x in r["dynamic_ratios"]) + ")" if "dynamic_ratio" in r else ""),
                "dynamic >= 1 x TF's fixed table: " + ("TF not run" if "dynamic_ratio" not in r
                                                       else "met" if r["dynamic_ratio"] >= 1 else "NOT met"))]


def bench_b16(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    from bench import dyntables

    out: dict[str, Any] = {}
    rows: list[Row] = []
    goals = {1_000_000: 8e6, 10_000_000: 5e6}
    for keys, dim in ((1_000_000, 64), (10_000_000, 8)):
        f = dyntables.bench(keys, dim, args.runs, checkpoint=True)
        out[f"{keys}x{dim}"] = f

        def m(name: str) -> float:
            return float(f[name]["median"])

        met = {f"lookups >= {goals[keys] / 1e6:.0f} M/s": m("lookup") >= goals[keys],
               "inserts >= 2 M/s, pause <= 200 ms": m("insert") >= 2e6 and m("insert_longest_batch") <= 0.2,
               "save <= 1 s/GiB (into the page cache)": m("checkpoint_save") <= 1,
               "durable save <= 1.1 x its floor": m("checkpoint_save_durable") <= 1.1 * m("file_durable_floor"),
               "restore <= 3 s/GiB": m("restore_into_2_shards") <= 3,
               "sweep >= 50 M/s": m("eviction_sweep") >= 50e6}
        if keys >= 10_000_000:  # the issue sets these at 10 M keys (memory at 8 floats a row)
            met["update >= 2 M/s"] = m("lookup_adagrad_update") >= 2e6
            met["<= 32 B/key"] = m("bytes_per_key_beyond_row_and_slots") <= 32
        rows.append((
            "B16", f"dynamic table in process, one shard, {keys / 1e6:.0f} M live keys x {dim} float32, Adagrad; batches "
            f"of 4,096 keys; median of {args.runs}; `python bench/dyntables.py --keys {keys} --dim {dim} --runs "
            f"{args.runs}`",
            f"lookups {m('lookup') / 1e6:.2f} M keys/s (numpy gather of as many rows {m('numpy_gather_floor') / 1e6:.2f} M); "
            f"lookup + Adagrad update {m('lookup_adagrad_update') / 1e6:.2f} M/s; inserts {m('insert') / 1e6:.2f} M "
            f"keys/s, longest batch of 65,536 {m('insert_longest_batch') * 1e3:.0f} ms (first writes of as many rows "
            f"{m('numpy_first_write_floor') / 1e6:.2f} M/s); {m('bytes_per_key_beyond_row_and_slots'):.1f} B/key beyond "
            f"row and slots (RSS); save into the page cache {m('checkpoint_save'):.2f} s/GiB (a plain write of as "
            f"many bytes {m('file_write_floor'):.2f}; CPU {m('save_write_cpu'):.2f} vs {m('file_write_cpu'):.2f}; the "
            f"snapshot's share {m('save_snapshot'):.3f}), made durable "
            f"(fsync) {m('checkpoint_save_durable'):.2f} s/GiB (plain write + fsync {m('file_durable_floor'):.2f}), "
            f"restore into 2 shards {m('restore_into_2_shards'):.2f} s/GiB ({m('restore_cpu'):.2f} s/GiB of CPU); "
            f"eviction sweep {m('eviction_sweep') / 1e6:.0f} M keys/s; the "
            f"compiled kernels' first call {m('kernels_first_call'):.2f} s (numba's import and the cached code: paid "
            f"once a process, so by the first row of a run)",
            "goals " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in met.items())))
    return out, rows


def bench_b14(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    from bench import optimizers

    r = optimizers.b14(runs=args.runs)
    copy_s = r["copy_s"]
    dense = "; ".join(f"{name} {s * 1e3:.0f} ms ({s / copy_s:.1f} x)" for name, s in r["dense_s"].items())
    sparse = "; ".join(f"{name} {s * 1e3:.1f} ms" for name, s in r["sparse_s"].items())
    return r, [("B14", "PS optimizers in process, CPU time per update (median): 1 GiB dense float32 variable, and 4,096 "
                "random rows of a 10 M x 64 float32 table; bench/optimizers.py",
                f"numpy copy of 1 GiB {copy_s * 1e3:.0f} ms ({r['copy_gib_per_s']:.1f} GiB/s); dense: {dense} "
                f"(x = ratio to the copy); sparse 4,096 rows: {sparse}",
                "measure (first half of B14; the CNN with AdamW comes later)")]


def bench_profile(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    r = profile.profile_w2()
    cells = []
    for name, ms in r["cpu_ms_per_step"].items():
        top = ", ".join(f"{c} {100 * f:.0f}%" for c, f in list(r["components"].get(name, {}).items())[:4])
        cells.append(f"{name} {ms:.2f} ms" + (f" ({top})" if top else ""))
    return r, [("PROFILE", "W2 async (2 PS + 2 workers): CPU per step by process (/proc), GIL-holding samples by "
                "component (py-spy --gil, if installed)",
                f"{r['steps_per_s']:.0f} steps/s; total {r['total_cpu_ms_per_step']:.2f} ms of CPU per step: "
                + "; ".join(cells), "measure first (issue 9)")]


def bench_copies(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    r = copies.copies(runs=args.runs)

    def cells(arm: str) -> str:
        return "; ".join(f"{int(n) >> 10} KiB {m['at_16_us']:.1f} vs {m['median_us']:.1f} us "
                         f"({m['slow_within_1_31']:.0f}/31 slow)" for n, m in r[arm].items())

    return r, [("COPIES", "one memmove (np.copyto) whose destination sits 16 bytes past its source modulo 4 KiB, vs "
                          "the median over all distances; how many of the distances 1-31 cost > 2.5 x the median "
                          "(bench/copies.py)",
                f"glibc default: {cells('default')}. With rep movsb off ({copies.NO_REP_MOVSB}): "
                f"{cells('no_rep_movsb')}", "table (docs/architecture.md: not set by default)")]


BENCHES = {"B1": bench_b1, "B1TLS": bench_b1tls, "B9": bench_b9, "B2": bench_b2, "FLOOR": bench_floor, "B3": bench_b3, "B4": bench_b4, "B5": bench_b5,
           "B6": bench_b6, "B7": bench_b7, "B8": bench_b8,
           "B10": bench_b10, "B11": bench_b11, "B12": bench_b12, "B13": bench_b13, "B14": bench_b14, "B16": bench_b16,
           "B14MP": bench_b14_precision, "B14CNN": bench_b14_cnn, "FIT": bench_fit, "PROFILE": bench_profile,
           "COPIES": bench_copies}
BENCHES.update(replica_rows.BENCHES)  # the B15 family (bench/replica_rows.py)
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _write_table(path: pathlib.Path, rows: list[Row], kept_ids: set[str]) -> None:
    """Rewrite the table between the bench markers: new rows replace their ids, other ids' rows stay.

    A subset run (`--only B11`) so updates its own rows and says which command produced them,
    without wiping the figures of the full run. Rows of ids that bench/run.py does not measure
    (B13DYN, written by bench/dyntables.py) always stay.
    """
    command = "python bench/run.py " + " ".join(sys.argv[1:])
    text = path.read_text() if path.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    head, _, rest = text.partition(BEGIN)
    old, _, tail = rest.partition(END)
    old_lines = old.strip("\n").splitlines()
    rows_by_id = [(line.split("|")[1].strip(), line) for line in old_lines if line.startswith("| ")]
    kept_rows = [(rid, line) for rid, line in rows_by_id if rid != "id" and (rid in kept_ids or rid not in BENCHES)]
    kept = [line for _, line in kept_rows]
    if any(rid in kept_ids for rid, _ in kept_rows):  # a subset run beside earlier figures
        intro = [line for line in old_lines if not line.startswith("|")]
        stamp = f"; a separate run {datetime.date.today()}: `{command}`"
        rows = [(a, b if "separate run" in b else b + stamp, c, d) for a, b, c, d in rows]
    else:
        intro = [f"Measured {datetime.date.today()} on this machine ({os.cpu_count()} cores, Python "
                 f"{platform.python_version()}), medians; command: `{command}`", ""]
    order = list(BENCHES)
    lines = kept + [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    lines.sort(key=lambda line: order.index(line.split("|")[1].strip()) if line.split("|")[1].strip() in order
               else len(order))
    table = intro + ["| id | what | measured (same run) | target |", "|---|---|---|---|"] + lines
    path.write_text(f"{head}{BEGIN}\n" + "\n".join(table).replace("\n\n\n", "\n\n") + f"\n{END}{tail}")


def main() -> int:
    """Run the selected benchmarks; print rows; optionally rewrite the table in BENCHMARKS.md."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(BENCHES), help="comma-separated ids")
    parser.add_argument("--runs", type=int, default=5, help="runs per figure (median reported)")
    parser.add_argument("--kills", type=int, default=100, help="B15: PS kills in the failover trial")
    parser.add_argument("--stops", type=int, default=10, help="B15: PS SIGSTOPs in the failover trial")
    parser.add_argument("--cycles", type=int, default=10, help="B15SCALE: drain-and-add-back cycles of PS 2")
    parser.add_argument("--scale-elements", type=int, default=1, help="B15SCALE: int64 elements per counter shard")
    parser.add_argument("--large-cycles", type=int, default=2, help="B15SCALELARGE: rounds of draining each PS")
    parser.add_argument("--large-mib", type=int, default=64, help="B15SCALELARGE: the dense shard's size in MiB")
    parser.add_argument("--large-keys", type=int, default=1_000_000, help="B15SCALELARGE: the dynamic table's keys")
    parser.add_argument("--sync-cycles", type=int, default=3, help="B15SCALESYNC: drain-and-add-back cycles")
    parser.add_argument("--joins", type=int, default=3, help="B15SCALE: join-add-remove cycles of an unlisted PS")
    parser.add_argument("--burners", type=int, default=16, help="B15FALSEDOWN: busy processes beside the cluster")
    parser.add_argument("--false-down-s", type=float, default=60.0, help="B15FALSEDOWN: seconds under that load")
    parser.add_argument("--soak-kills", type=int, default=100, help="B15SOAK: PS kills, split over async/sync/bounded")
    parser.add_argument("--write", help="rewrite the table between the bench markers of this file")
    parser.add_argument("--tf-python", default=None, help="B13: a Python with tensorflow-cpu 2.21 (optional peer)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    rows: list[Row] = []
    raw: dict[str, Any] = {}
    for key in args.only.split(","):
        try:
            result, new_rows = BENCHES[key.strip()](args)
        except Exception as exc:  # noqa: BLE001 - a failed benchmark is a row, not a lost table
            result, new_rows = {"error": repr(exc)}, [(key, "FAILED to run", repr(exc)[:300], "")]
        raw[key] = result
        rows += new_rows
        for row in new_rows:
            print(" | ".join(row), flush=True)
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / "latest.json").write_text(json.dumps(raw, indent=1, default=str))
    if args.write:
        _write_table(ROOT / args.write, rows, set(BENCHES) - {k.strip() for k in args.only.split(",")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
