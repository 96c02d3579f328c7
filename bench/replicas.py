"""B15: replicated PS shards (replicas: 2). Failover latency under SIGKILL and replication's throughput cost.

failover(kills): 2 PS with replicas: 2 and a supervisor that restarts a killed PS. A driver thread pushes
+1 to a counter back to back (each push acknowledged only once the backup holds it). Each trial waits
until the counter's backup is in sync, SIGKILLs the counter's primary, and measures from the kill to the
first push acknowledged after the killed process is gone (necessarily by the promoted backup). At the
end the counter must equal the number of acknowledged pushes, and lost_updates() must be 0.

cost(runs): W2 (bench/training.py) async and sync with replicas: 1 and 2, alternating in the same run.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from typing import Any

import numpy as np

import pscluster as ps
from bench import training
from pscluster.ops.launcher import LocalCluster

STOP_SETTLE_S = 0.02  # a SIGSTOPped primary's last replies, written before the stop, arrive within this


def _wait(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.005)


def failover(kills: int = 100, sigstop: bool = False) -> dict[str, Any]:
    """Kill -> first acknowledged push on the new primary, over `kills` SIGKILLs of the counter's primary;
    sigstop: SIGSTOP it instead (its pushers wait for a reply that never comes), SIGCONT once a push was
    acknowledged by the new primary (the first more than STOP_SETTLE_S after the stop: the stopped PS may
    have sent a reply before it, none after), after which it rejoins as backup."""
    acked: list[float] = []
    stop = threading.Event()
    errors: list[BaseException] = []
    with LocalCluster(2, 0, supervise=True, replicas=2) as cluster:
        coord = ps.ClusterCoordinator(cluster.settings())
        try:
            counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
            key = ("counter", 0)
            one = np.array(-1, np.int64)

            def pusher() -> None:
                while not stop.is_set():
                    try:
                        coord.client.push([(counter, one)])
                    except ps.PsclusterError as exc:  # retried for retry_for already: a failure to report
                        errors.append(exc)
                        return
                    acked.append(time.monotonic())

            def in_sync() -> bool:
                c = coord.replica_table().get(key)
                return c is not None and c.in_sync and c.backup is not None

            _wait(in_sync, "the counter's backup")
            thread = threading.Thread(target=pusher, name="b15-pusher", daemon=True)
            thread.start()
            latencies = []
            for _ in range(kills):
                _wait(in_sync, "the restarted PS to rejoin as backup")
                _wait(lambda: len(acked) > 20, "pushes")
                victim = coord.replica_table()[key].primary
                before = len(acked)
                t0 = time.monotonic()
                if sigstop:
                    os.kill(cluster.ps[victim].pid, signal.SIGSTOP)
                    gone = t0 + STOP_SETTLE_S
                else:
                    cluster.kill(cluster.ps[victim], signal.SIGKILL)  # returns once the process is gone
                    gone = time.monotonic()
                _wait(lambda: len(acked) > before and acked[-1] > gone, "a push acknowledged by the new primary",
                      timeout=30.0)
                first = next(t for t in acked[before:] if t > gone)
                latencies.append(first - t0)
                if sigstop:
                    os.kill(cluster.ps[victim].pid, signal.SIGCONT)
                if errors:
                    raise errors[0]
            stop.set()
            thread.join(timeout=30)
            total = int(counter.pull())
            lost = coord.lost_updates
        finally:
            stop.set()
            coord.shutdown()
    ms = sorted(1000 * x for x in latencies)
    return {"kills": kills, "signal": "SIGSTOP" if sigstop else "SIGKILL", "p50_ms": statistics.median(ms),
            "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
            "max_ms": ms[-1], "acknowledged": len(acked), "counter": total, "lost_updates": lost,
            "exact": total == len(acked) and lost == 0}


def cost(runs: int = 3) -> dict[str, Any]:
    """W2 async and sync steps/s with replicas: 1 and 2, alternating (medians over `runs` pairs)."""
    out: dict[str, Any] = {}
    for mode, extra in (("async", {}), ("sync", {"replicas_to_aggregate": 2, "total_num_replicas": 2})):
        pairs = [(training.w2(mode=mode, **extra), training.w2(mode=mode, replicas=2, **extra))  # type: ignore[arg-type]
                 for _ in range(runs)]
        one = statistics.median(a["steps_per_s"] for a, _ in pairs)
        two = statistics.median(b["steps_per_s"] for _, b in pairs)
        out[mode] = {"replicas_1": one, "replicas_2": two, "cost": 1 - two / one,
                     "accuracy_2": statistics.median(b["accuracy"] for _, b in pairs)}
    return out


def _rss_mib(pid: int) -> tuple[float, float]:
    """(peak, current) resident set of a process, MiB (VmHWM, VmRSS)."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return int(fields["VmHWM"].split()[0]) / 1024, int(fields["VmRSS"].split()[0]) / 1024


def memory(mib: int = 64, pushes: int = 20) -> dict[str, Any]:
    """Peak RSS per PS with replicas: 1 and 2: one `mib` MiB float32 Adam variable per PS (value + 2 slots:
    3x mib of state per copy), `pushes` pushes of every variable; replicas: 2 also holds the other PS's copy."""
    out: dict[str, Any] = {}
    n = mib << 18  # float32 elements
    for replicas in (1, 2):
        with LocalCluster(2, 0, replicas=replicas) as cluster:
            coord = ps.ClusterCoordinator(cluster.settings())
            try:
                base = [_rss_mib(d.pid)[1] for d in cluster.ps]  # the interpreter, numpy, grpc: before any state
                variables = [coord.create_variable(f"m{i}", shape=(n,), dtype="float32", optimizer=ps.Adam(1e-3))
                             for i in range(2)]  # ordinals 0 and 1: one primary on each PS
                if replicas == 2:
                    _wait(lambda: all(c.in_sync and c.backup is not None for c in coord.replica_table().values()),
                          "both backups in sync")
                grad = np.full(n, 1e-3, np.float32)
                for _ in range(pushes):
                    coord.client.push([(v, grad) for v in variables])
                rss = [_rss_mib(d.pid) for d in cluster.ps]
            finally:
                coord.shutdown()
        out[f"replicas_{replicas}"] = {"base_mib": base, "peak_mib": [p for p, _ in rss], "rss_mib": [r for _, r in rss]}
    one, two = out["replicas_1"], out["replicas_2"]
    out["peak_ratio"] = max(two["peak_mib"]) / max(one["peak_mib"])
    out["state_ratio"] = max(p - b for p, b in zip(two["peak_mib"], two["base_mib"])) / \
        max(p - b for p, b in zip(one["peak_mib"], one["base_mib"]))
    out["mib"] = mib
    return out
