"""B4 (closure dispatch), B5 (worker SIGKILL), B6 (worker SIGSTOP), B7 (PS SIGKILL), B10 (long run)."""

from __future__ import annotations

import os
import resource
import signal
import statistics
import time

import numpy as np

import pscluster as ps
from bench.common import local_cluster
from pscluster.ops.launcher import LocalCluster


def _noop() -> None:
    return None


def b4(closures: int = 3000, round_trips: int = 300, tls: bool = False, inflight: int | None = None) -> dict[str, float]:
    """Empty closures per second with 2 workers, and one closure's round-trip latency (mutual TLS if tls;
    inflight: the coordinator's max_inflight_per_worker, default the settings' own)."""
    with local_cluster(1, 2, tls=tls) as cluster:
        extra = {} if inflight is None else {"max_inflight_per_worker": inflight}
        coord = ps.ClusterCoordinator(cluster.settings(**extra))
        try:
            coord.wait_for_workers(2)
            for _ in range(200):
                coord.schedule(_noop)
            coord.join()
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(closures):
                coord.schedule(_noop)
            coord.join()
            rate = closures / (time.perf_counter() - start)
            cpu_ms = (time.process_time() - cpu) / closures * 1e3  # this process: driver + coordinator
            latencies = []
            for _ in range(round_trips):
                t = time.perf_counter()
                coord.schedule(_noop).fetch()
                latencies.append(time.perf_counter() - t)
        finally:
            coord.shutdown()
    return {"closures_per_s": rate, "coordinator_cpu_ms": cpu_ms, "round_trip_ms": statistics.median(latencies) * 1e3,
            "round_trip_p90_ms": statistics.quantiles(latencies, n=10)[-1] * 1e3}


def _busy_step(counter: ps.Variable, seconds: float) -> int:
    time.sleep(seconds)
    counter.push(np.array(-1, np.int64))
    return 1


def _victim_closures(coord: ps.ClusterCoordinator, address: str) -> list[int]:
    for w in coord.snapshot().workers:
        if w.address == address:
            return sorted(w.inflight)
    return []


def _worker_fault(sig: int, runs: int, closure_s: float = 0.05) -> dict[str, float]:
    times, twice = [], 0
    for _ in range(runs):
        with LocalCluster(1, 2, supervise=False) as cluster:
            coord = ps.ClusterCoordinator(cluster.settings())
            try:
                coord.wait_for_workers(2)
                counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
                n = 200
                values = [coord.schedule(_busy_step, args=(counter, closure_s)) for _ in range(n)]
                while coord.status().done < 40:
                    time.sleep(0.002)
                victim = cluster.workers[0]
                address = next(line.split()[-1] for line in victim.log_path.read_text().splitlines()
                               if line.startswith(("READY worker", "SERVING worker")))
                inflight = _victim_closures(coord, address)
                t0 = time.perf_counter()
                cluster.kill(victim, sig)
                by_id = {v.closure_id: v for v in values}
                while not all(by_id[c].done() for c in inflight):
                    time.sleep(0.001)
                times.append(time.perf_counter() - t0)
                coord.join(timeout=120)
                twice += int(counter.pull()) - n  # > 0 means some update applied twice
            finally:
                coord.shutdown()
                if sig == signal.SIGSTOP:
                    cluster.kill(victim, signal.SIGCONT)
    return {"seconds_median": statistics.median(times), "seconds_max": max(times), "applied_twice": twice,
            "closure_seconds": closure_s, "runs": runs}


def b5(runs: int = 5) -> dict[str, float]:
    """Worker SIGKILLed while busy: time until its closures finish elsewhere; updates applied twice."""
    return _worker_fault(signal.SIGKILL, runs)


def b6(runs: int = 3) -> dict[str, float]:
    """Worker SIGSTOPped (hang): time until its closures finish elsewhere (default heartbeat settings)."""
    return _worker_fault(signal.SIGSTOP, runs)


def b7(runs: int = 3) -> dict[str, float]:
    """PS SIGKILLed mid-run (the launcher restores it): pause until closures complete again; lost updates."""
    pauses, restore_s, lost, exact = [], [], [], 0
    for _ in range(runs):
        with LocalCluster(2, 2) as cluster:
            coord = ps.ClusterCoordinator(cluster.settings())
            try:
                coord.wait_for_workers(2)
                counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
                first = [coord.schedule(_busy_step, args=(counter, 0.002)) for _ in range(100)]
                coord.checkpoint()
                rest = [coord.schedule(_busy_step, args=(counter, 0.002)) for _ in range(1000)]
                while coord.status().done < 300:
                    time.sleep(0.001)
                victim = cluster.ps[counter.shards[0].ps]
                restarts = victim.restarts
                t0 = time.perf_counter()
                cluster.kill(victim)
                done_at_kill = coord.status().done
                while victim.restarts == restarts:
                    time.sleep(0.001)
                cluster.wait_ready(victim)
                restore_s.append(time.perf_counter() - t0)
                while coord.status().done <= done_at_kill + 4:  # past the closures in flight at the kill
                    time.sleep(0.001)
                pauses.append(time.perf_counter() - t0)
                coord.join(timeout=120)
                lost.append(coord.lost_updates)
                exact += int(int(counter.pull()) == len(first) + len(rest) - coord.lost_updates)
            finally:
                coord.shutdown()
    return {"pause_s_median": statistics.median(pauses), "restart_and_restore_s_median": statistics.median(restore_s),
            "lost_updates_median": statistics.median(lost), "runs_with_exact_lost_report": exact, "runs": runs}


def _rss() -> int:
    """This process's resident set size in bytes (the embedded coordinator lives here)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def b10(total: int = 1_000_000, batch: int = 10_000, window: int = 100_000) -> dict[str, float]:
    """Empty closures through one coordinator, 2 workers: RSS growth and rate, first vs last window."""
    with LocalCluster(1, 2) as cluster:
        coord = ps.ClusterCoordinator(cluster.settings())
        try:
            coord.wait_for_workers(2)
            marks: list[tuple[int, float, int]] = [(0, time.perf_counter(), _rss())]  # (closures, time, rss)
            done = 0
            while done < total:
                for _ in range(batch):
                    coord.schedule(_noop)
                coord.join()
                done += batch
                if done % window == 0:
                    marks.append((done, time.perf_counter(), _rss()))
                    print(f"B10: {done} closures, {window / (marks[-1][1] - marks[-2][1]):.0f}/s, "
                          f"RSS {marks[-1][2] / 2**20:.1f} MiB", flush=True)
            coord_done = coord.status().done
        finally:
            coord.shutdown()
    rates = [window / (b[1] - a[1]) for a, b in zip(marks, marks[1:])]
    return {"closures": total, "completed": coord_done, "rss_at_first_window_mib": marks[1][2] / 2**20,
            "rss_at_end_mib": marks[-1][2] / 2**20, "rss_growth_mib": (marks[-1][2] - marks[1][2]) / 2**20,
            "first_window_per_s": rates[0], "last_window_per_s": rates[-1], "last_vs_first": rates[-1] / rates[0],
            "pid": os.getpid()}
