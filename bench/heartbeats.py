"""B15FALSEDOWN: how often a live PS is marked down (its shards failed over) under heavy CPU load.

replicas: 2, 2 PS, a driver pushing +1 to a counter back to back (as B15), nothing killed, for `seconds`, with
`burners` busy-looping processes beside the cluster (load 10+ on 2 cores with 8 of them). Every mark-down is a
false one; the replica keeper logs each with why (coordinator/replica_keeper.py), counted here. The counter
must still equal the acknowledged pushes, with lost_updates 0.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

import pscluster as ps
from pscluster.ops.launcher import LocalCluster

BURN = "import os, time\nend = time.monotonic() + float(os.environ['BURN_S'])\nwhile time.monotonic() < end: pass\n"


class _Downs(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "marked down" in message:
            self.lines.append(message)


def run(seconds: float = 30.0, burners: int = 8) -> dict[str, Any]:
    """One run: the mark-downs of live PS tasks over `seconds` with `burners` busy processes beside them."""
    downs = _Downs()
    logger = logging.getLogger("pscluster.coordinator.replica_keeper")
    logger.addHandler(downs)
    acked = 0
    stop = threading.Event()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with LocalCluster(2, 0, supervise=True, replicas=2) as cluster:
            coord = ps.ClusterCoordinator(cluster.settings())
            try:
                counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
                keeper = coord._keeper  # the bench times the keeper's own Status calls
                assert keeper is not None
                plain = keeper._status
                latencies: list[float] = []

                def timed(index: int) -> Any:
                    started = time.monotonic()
                    try:
                        return plain(index)
                    finally:
                        latencies.append(time.monotonic() - started)

                keeper._status = timed  # type: ignore[method-assign]
                one = np.array(-1, np.int64)

                def pusher() -> None:
                    nonlocal acked
                    while not stop.is_set():
                        coord.client.push([(counter, one)])
                        acked += 1

                deadline = time.monotonic() + 60
                while not all(c.in_sync for c in coord.replica_table().values()) and time.monotonic() < deadline:
                    time.sleep(0.05)
                thread = threading.Thread(target=pusher, name="b15-falsedown-pusher", daemon=True)
                thread.start()
                load_before = os.getloadavg()[0]
                env = {**os.environ, "BURN_S": str(seconds)}
                procs = [subprocess.Popen([sys.executable, "-c", BURN], env=env) for _ in range(burners)]
                del latencies[:]
                time.sleep(seconds)
                loaded = sorted(latencies)
                load_after = os.getloadavg()[0]
                stop.set()
                thread.join(timeout=60)
                total = int(counter.pull())
                lost = coord.lost_updates
            finally:
                stop.set()
                coord.shutdown()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        logger.removeHandler(downs)
    ms = [1000 * x for x in loaded]
    return {"seconds": seconds, "burners": burners, "marked_down": len(downs.lines), "why": downs.lines[:5],
            "status_calls": len(ms), "status_p50_ms": ms[len(ms) // 2], "status_p99_ms": ms[int(0.99 * len(ms))],
            "status_max_ms": ms[-1], "status_over_250_ms": sum(1 for x in ms if x > 250),
            "acknowledged": acked, "counter": total, "lost_updates": lost, "exact": total == acked and lost == 0,
            "load_before": load_before, "load_after": load_after}


if __name__ == "__main__":
    print(run(float(sys.argv[1]) if len(sys.argv) > 1 else 30.0, int(sys.argv[2]) if len(sys.argv) > 2 else 8))
