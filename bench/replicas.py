"""B15: replicated PS shards (replicas: 2). Failover latency under SIGKILL and replication's throughput cost.

failover(kills): 2 PS with replicas: 2 and a supervisor that restarts a killed PS. A driver thread pushes
+1 to a counter back to back (each push acknowledged only once the backup holds it). Each trial waits
until the counter's backup is in sync, SIGKILLs the counter's primary, and measures from the kill to the
first push acknowledged after the killed process is gone (necessarily by the promoted backup). At the
end the counter must equal the number of acknowledged pushes, and lost_updates() must be 0.

cost(runs): W2 (bench/training.py) async and sync with replicas: 1 and 2, alternating in the same run.
"""

from __future__ import annotations

import signal
import statistics
import threading
import time
from typing import Any

import numpy as np

import pscluster as ps
from bench import training
from pscluster.ops.launcher import LocalCluster


def _wait(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.005)


def failover(kills: int = 100) -> dict[str, Any]:
    """Kill -> first acknowledged push on the new primary, over `kills` SIGKILLs of the counter's primary."""
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
                cluster.kill(cluster.ps[victim], signal.SIGKILL)  # returns once the process is gone
                gone = time.monotonic()
                _wait(lambda: len(acked) > before and acked[-1] > gone, "a push acknowledged by the new primary",
                      timeout=30.0)
                first = next(t for t in acked[before:] if t > gone)
                latencies.append(first - t0)
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
    return {"kills": kills, "p50_ms": statistics.median(ms), "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
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
