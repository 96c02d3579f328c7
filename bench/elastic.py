"""B15SCALE: elastic PS (docs/elastic.md). The freeze per moved shard when a PS is drained and added back.

3 PS with replicas: 2 hold `shards` one-shard counters. A driver thread pushes +1 to every counter back to
back (one push id for all of them, acknowledged once both copies hold it). Each cycle drains PS 2
(coord.remove_ps) and brings it back (coord.add_ps) while the driver pushes. Per moved primary the
coordinator measures the freeze: from the FreezeShard call on the old primary to the new primary holding
the switched table (the time the shard refuses pushes). The driver sees more than that: a refused push is
retried after the client's backoff (20 ms, then doubling) and a re-read of the table, and a push waits for
a new backup's catch-up; the longest gap between two acknowledged pushes during a scale is reported too.
Then `joins` times a PS the cluster file does not list is started (`pscluster ps --join`: it joins the
coordinator's PS list as PS 3), added (coord.add_ps(3): it takes its share), drained (coord.remove_ps(3):
it leaves the list) and stopped, under the same pushes; its freezes and gaps are reported apart.
At the end every counter must equal the number of acknowledged pushes, and lost_updates() must be 0.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from typing import Any

import numpy as np

import pscluster as ps
from pscluster.ops.launcher import LocalCluster
from pscluster.tables import TableConfig


def _wait(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def scale(cycles: int = 10, shards: int = 6, elements: int = 1, joins: int = 3) -> dict[str, Any]:
    """Drain PS 2 and add it back `cycles` times, then add and remove an unlisted PS `joins` times, under
    back-to-back pushes; freeze per moved primary. elements: each counter's size (1: a scalar; more: a
    vector of int64, every element counts the pushes)."""
    acked: list[float] = []
    stop = threading.Event()
    errors: list[BaseException] = []
    phases = ("remove", "add", "join", "leave")
    freezes: dict[str, list[float]] = {what: [] for what in phases}
    gaps: dict[str, list[float]] = {what: [] for what in phases}
    moved = dict.fromkeys(phases, 0)
    with LocalCluster(3, 0, supervise=False, replicas=2) as cluster:
        coord = ps.ClusterCoordinator(cluster.settings())
        try:
            shape: tuple[int, ...] = () if elements == 1 else (elements,)
            counters = [coord.create_variable(f"counter{i}", shape=shape, dtype="int64", optimizer=ps.SGD(1.0))
                        for i in range(shards)]
            one = np.full(shape, -1, np.int64)
            _wait(lambda: len(t := coord.replica_table()) == shards + 1 and all(c.in_sync for c in t.values()),
                  "every counter's backup")

            def pusher() -> None:
                while not stop.is_set():
                    try:
                        coord.client.push([(c, one) for c in counters])
                    except ps.PsclusterError as exc:  # retried for retry_for already: a failure to report
                        errors.append(exc)
                        return
                    acked.append(time.monotonic())

            def measure(what: str, change: Any) -> None:
                _wait(lambda: len(acked) > 20, "pushes")
                first = len(acked)
                started = time.monotonic()
                report = change()
                ended = time.monotonic()
                _wait(lambda: len(acked) > first + 5 and acked[-1] > ended, "pushes after the scale")
                during = [started] + [t for t in acked[first:] if t <= ended] + \
                    [next(t for t in acked[first:] if t > ended)]
                gaps[what].append(max(b - a for a, b in zip(during, during[1:])))
                freezes[what] += report.freezes_s
                moved[what] += report.moved
                if errors:
                    raise errors[0]

            thread = threading.Thread(target=pusher, name="b15scale-pusher", daemon=True)
            thread.start()
            for _ in range(cycles):
                measure("remove", lambda: coord.remove_ps(2))
                measure("add", lambda: coord.add_ps(2))
            for _ in range(joins):
                joined = cluster.add_ps()  # started outside the measure: a process start is not a freeze
                measure("join", lambda: coord.add_ps(joined.index))
                measure("leave", lambda: coord.remove_ps(joined.index))
                if coord.client.num_ps != 3:
                    raise RuntimeError(f"ps {joined.index} did not leave the PS list: {coord.client.num_ps} PS")
                cluster.retire_ps(joined)
            stop.set()
            thread.join(timeout=30)
            totals = [int(np.asarray(c.pull()).min()) for c in counters]
            if elements > 1:
                totals += [int(np.asarray(c.pull()).max()) for c in counters]
            lost = coord.lost_updates
        finally:
            stop.set()
            coord.shutdown()
    out: dict[str, Any] = {"cycles": cycles, "joins": joins, "shards": shards, "elements": elements, "acknowledged": len(acked), "counters": totals,
                           "lost_updates": lost, "exact": all(t == len(acked) for t in totals) and lost == 0}
    for what in phases:
        if not gaps[what]:
            continue
        ms = [1e3 * f for f in freezes[what]] or [0.0]
        out[what] = {"moved_primaries": len(ms), "moved_copies": moved[what], "freeze_p50_ms": statistics.median(ms),
                     "freeze_max_ms": max(ms), "gap_p50_ms": 1e3 * statistics.median(gaps[what]),
                     "gap_max_ms": 1e3 * max(gaps[what]), "freeze_p99_ms": _pct(ms, 0.99)}
    return out


def _increment(*counters: Any) -> int:
    for counter in counters:
        counter.push(np.array(-1, np.int64))
    return 1


def scale_sync(cycles: int = 3, shards: int = 6) -> dict[str, Any]:
    """A sync job (R = N = 2 workers) while PS 2 is drained and added back `cycles` times: the freeze per
    moved primary, which in a sync job includes the wait for the open step's last gradient (docs/elastic.md:
    the move falls between two steps); every counter must equal the steps taken."""
    freezes: list[float] = []
    with LocalCluster(3, 2, supervise=False, replicas=2) as cluster:
        coord = ps.ClusterCoordinator(cluster.settings())
        try:
            coord.wait_for_workers(2)
            counters = [coord.create_variable(f"counter{i}", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
                        for i in range(shards)]
            _wait(lambda: len(t := coord.replica_table()) == shards + 1 and all(c.in_sync for c in t.values()),
                  "every counter's backup")
            coord.configure_sync("sync", replicas_to_aggregate=2, total_num_replicas=2)
            values = []
            for _ in range(cycles):
                for change in (lambda: coord.remove_ps(2), lambda: coord.add_ps(2)):
                    values += [coord.schedule(_increment, args=tuple(counters)) for _ in range(40)]
                    base = len(values) // 2 - 20
                    _wait(lambda: int(counters[0].pull()) >= base + 5, "sync steps under way")
                    freezes += change().freezes_s
            coord.join(timeout=60)
            closures = sum(v.fetch() for v in values)
            totals = [int(c.pull()) for c in counters]
            lost = coord.lost_updates
        finally:
            coord.shutdown()
    ms = [1e3 * f for f in freezes]
    return {"cycles": cycles, "shards": shards, "steps": closures // 2, "counters": totals, "lost_updates": lost,
            "exact": all(t == closures // 2 for t in totals) and lost == 0, "moved_primaries": len(ms),
            "freeze_p50_ms": statistics.median(ms), "freeze_max_ms": max(ms)}


class _Moves(logging.Handler):
    """The embedded coordinator's log of each moved primary: (variable, freeze in ms)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.frozen: list[tuple[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("scale: %s[%d] moved from ps") and isinstance(record.args, tuple):
            self.frozen.append((str(record.args[0]), float(record.args[4])))


def scale_large(cycles: int = 2, mib: int = 64, table_keys: int = 1_000_000, shards: int = 6) -> dict[str, Any]:
    """The freeze per moved primary by shard size: `shards` scalar counters (pushed +1 back to back), a dense
    one-shard variable of `mib` MiB and a one-shard dynamic table of `table_keys` keys (dim 4, SGD), while each
    PS in turn is drained and added back, `cycles` times (every primary moves at least once per cycle). The
    freeze ends when the successor answers the switch's SetRoles; its new backup's catch-up (the whole
    shard) comes after. At the end the large variables must hold what they held before the moves."""
    moves = _Moves()
    logger = logging.getLogger("pscluster.coordinator.elastic")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(moves)
    acked = [0]
    stop = threading.Event()
    errors: list[BaseException] = []
    try:
        with LocalCluster(3, 0, supervise=False, replicas=2) as cluster:
            coord = ps.ClusterCoordinator(cluster.settings())
            try:
                one_shard = ps.FixedShardsPartitioner(1)
                counters = [coord.create_variable(f"counter{i}", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
                            for i in range(shards)]
                n = (mib << 20) // 8
                big = coord.create_variable("dense", shape=(n,), dtype="int64", optimizer=ps.SGD(1.0),
                                            partitioner=one_shard)
                coord.client.push([(big, -np.arange(n, dtype=np.int64))])  # over a message: streamed
                table = coord.create_variable("table", shape=(None, 4), dtype="float32", optimizer=ps.SGD(1.0),
                                              sparse=True, table=TableConfig(dim=4, capacity=2 * table_keys),
                                              partitioner=one_shard)
                keys = np.arange(table_keys, dtype=np.int64) * 7919 + 3
                for part in np.array_split(keys, max(1, table_keys // 100_000)):  # rows -(key % 1000)
                    coord.client.push_rows(table, part, np.repeat((part % 1000).astype(np.float32)[:, None], 4, 1))
                _wait(lambda: len(t := coord.replica_table()) == shards + 3 and all(c.in_sync for c in t.values()),
                      "every shard's backup", 300)
                one = np.array(-1, np.int64)

                def pusher() -> None:
                    while not stop.is_set():
                        try:
                            coord.client.push([(c, one) for c in counters])
                        except ps.PsclusterError as exc:
                            errors.append(exc)
                            return
                        acked[0] += 1

                thread = threading.Thread(target=pusher, name="b15scale-large-pusher", daemon=True)
                thread.start()
                for _ in range(cycles):
                    for task in range(3):
                        coord.remove_ps(task)
                        coord.add_ps(task)
                        if errors:
                            raise errors[0]
                stop.set()
                thread.join(timeout=60)
                totals = [int(c.pull()) for c in counters]
                intact = bool(np.array_equal(big.pull(), np.arange(n, dtype=np.int64)))
                sample = keys[:: max(1, table_keys // 10_000)]
                rows = coord.client.pull_rows(table, sample)
                intact = intact and bool(np.array_equal(rows, np.repeat(-(sample % 1000).astype(np.float32)[:, None], 4, 1)))
                lost = coord.lost_updates
            finally:
                stop.set()
                coord.shutdown()
    finally:
        logger.removeHandler(moves)
        logger.setLevel(level)
    out: dict[str, Any] = {"cycles": cycles, "mib": mib, "table_keys": table_keys, "acknowledged": acked[0],
                           "lost_updates": lost, "large_intact": intact,
                           "exact": all(t == acked[0] for t in totals) and lost == 0 and intact}
    for kind, names in (("scalar", {f"counter{i}" for i in range(shards)}), ("dense", {"dense"}),
                        ("table", {"table"})):
        ms = [f for name, f in moves.frozen if name in names]
        if ms:
            out[kind] = {"moved_primaries": len(ms), "freeze_p50_ms": statistics.median(ms), "freeze_max_ms": max(ms)}
    return out
