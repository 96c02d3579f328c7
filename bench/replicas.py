"""B15: replicated PS shards (replicas: 2). Failover latency under SIGKILL and replication's throughput cost.

failover(kills): 2 PS with replicas: 2 and a supervisor that restarts a killed PS. A driver thread pushes
+1 to a counter back to back (each push acknowledged only once the backup holds it). Each trial waits
until the counter's backup is in sync, SIGKILLs the counter's primary, and measures from the kill to the
first push acknowledged after the killed process is gone (necessarily by the promoted backup). At the
end the counter must equal the number of acknowledged pushes, and lost_updates() must be 0.

cost(runs): W2 (bench/training.py) async and sync with replicas: 1 and 2, alternating in the same run, with
each process's CPU per step; and async with one worker, where the cluster does not fill the 2 cores.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

import pscluster as ps
from bench import training
from pscluster.ops import status
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


# the cost trials: (name, training.w2 keywords); "async_1w" aims at spare cores: one worker runs one closure at a
# time, a chain of its compute and the PS's replies, so the cluster may keep less than the machine's 2 cores
# busy and the backup's CPU need not come out of a worker's share (the rows' "cores busy" says whether it did)
COST_MODES: list[tuple[str, dict[str, Any]]] = [
    ("async", {"mode": "async"}),
    ("sync", {"mode": "sync", "replicas_to_aggregate": 2, "total_num_replicas": 2}),
    ("async_1w", {"mode": "async", "num_workers": 1}),
]


class ProcessCpu:
    """A training.w2 probe: CPU (user + system, /proc) and voluntary context switches (threads woken after a
    wait, summed over threads) of every process of the cluster around the timed steps; per PS also each thread
    kind's share (`threads`: name -> (threads, switches, CPU s)), named by `py-spy dump` when it is on PATH."""

    def __init__(self) -> None:
        self.cpu_s: dict[str, float] = {}
        self.switches: dict[str, int] = {}
        self.threads: dict[str, dict[str, tuple[int, int, float]]] = {}
        self.sync_changes = 0  # sync-state changes (each one forward to its backup) made during the steps

    @staticmethod
    def _sync_versions(cluster: LocalCluster) -> list[int]:
        """Each PS's PsStatus.sync_version (read outside the CPU window: the asking costs the PS CPU)."""
        return [st.sync_version if st is not None else 0 for _, st, _ in status.gather(cluster.settings()).ps]

    @staticmethod
    def _tasks(pid: int) -> dict[int, tuple[int, float]]:
        """Per thread id: (voluntary context switches, CPU s)."""
        out = {}
        for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
            try:
                text = (task / "status").read_text()
                stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # a thread that ended in between
                continue
            switches = sum(int(line.split()[1]) for line in text.splitlines()
                           if line.startswith("voluntary_ctxt_switches"))
            out[int(task.name)] = (switches, (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK"))
        return out

    @staticmethod
    def _names(pid: int) -> dict[int, str]:
        """Thread id -> Python thread name, from `py-spy dump` (empty without py-spy)."""
        spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(pathlib.Path(sys.executable).parent))
        if spy is None:
            return {}
        dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30).stdout
        found = re.findall(r'^Thread (0x[0-9A-Fa-f]+|\d+) \(\w+\): "([^"]*)"', dump, re.M)
        return {int(tid, 0): name for tid, name in found}

    @classmethod
    def _read(cls, pid: int) -> tuple[float, int, dict[int, tuple[int, float]]]:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        tasks = cls._tasks(pid)
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), sum(s for s, _ in tasks.values()), tasks

    @contextlib.contextmanager
    def __call__(self, cluster: LocalCluster) -> Iterator[None]:
        procs = {"driver": os.getpid()}
        procs.update({f"ps{d.index}": d.pid for d in cluster.ps})
        procs.update({f"worker{d.index}": d.pid for d in cluster.workers})
        versions = self._sync_versions(cluster)
        before = {name: self._read(pid) for name, pid in procs.items()}
        yield
        after = {name: self._read(pid) for name, pid in procs.items()}
        # the queue's primary made them, its backup took the newest (the primary is PS 0 unless a PS failed)
        self.sync_changes = max(b - a for a, b in zip(versions, self._sync_versions(cluster)))
        self.cpu_s = {name: after[name][0] - before[name][0] for name in procs}
        self.switches = {name: after[name][1] - before[name][1] for name in procs}
        for name, pid in procs.items():
            if not name.startswith("ps"):
                continue
            names, kinds = self._names(pid), dict[str, tuple[int, int, float]]()
            for tid, (switches, cpu) in after[name][2].items():
                was = before[name][2].get(tid, (0, 0.0))
                kind = names.get(tid, "other")
                n, s, c = kinds.get(kind, (0, 0, 0.0))
                kinds[kind] = (n + 1, s + switches - was[0], c + cpu - was[1])
            self.threads[name] = kinds


def _trial(replicas: int, steps: int, **kw: Any) -> dict[str, Any]:
    probe = ProcessCpu()
    r = training.w2(replicas=replicas, steps=steps, probe=probe, **kw)
    cpu = {name: 1000.0 * s / steps for name, s in probe.cpu_s.items()}
    return {"steps_per_s": r["steps_per_s"], "accuracy": r["accuracy"], "cpu_ms": cpu,
            "wakeups": {name: n / steps for name, n in probe.switches.items()},
            "sync_changes": probe.sync_changes / steps,
            "threads": {ps: {kind: {"threads": n, "wakeups": s / steps, "cpu_ms": 1000.0 * c / steps}
                             for kind, (n, s, c) in kinds.items()} for ps, kinds in probe.threads.items()}}


def _median_of(trials: list[dict[str, Any]], field: str) -> dict[str, float]:
    return {name: statistics.median(t[field][name] for t in trials) for name in trials[0][field]}


def cost(runs: int = 3, steps: int = 2000, modes: Sequence[str] | None = None) -> dict[str, Any]:
    """W2 steps/s with replicas: 1 and 2, alternating in the same run (medians over `runs` pairs), per mode of
    COST_MODES, with each process's CPU ms and voluntary context switches per step (medians).

    `cpu_bound_cost` is what the CPU alone predicts when every core is busy (steps/s ~ cores / CPU per step of
    all processes): 1 - total CPU per step with 1 copy / with 2."""
    out: dict[str, Any] = {"load_before": os.getloadavg()[0]}
    for mode, kw in COST_MODES:
        if modes is not None and mode not in modes:
            continue
        pairs = [(_trial(1, steps, **kw), _trial(2, steps, **kw)) for _ in range(runs)]
        ones, twos = [a for a, _ in pairs], [b for _, b in pairs]
        one = statistics.median(a["steps_per_s"] for a in ones)
        two = statistics.median(b["steps_per_s"] for b in twos)
        cpu1, cpu2 = _median_of(ones, "cpu_ms"), _median_of(twos, "cpu_ms")
        ps1 = [v for k, v in cpu1.items() if k.startswith("ps")]
        ps2 = [v for k, v in cpu2.items() if k.startswith("ps")]
        out[mode] = {"replicas_1": one, "replicas_2": two, "cost": 1 - two / one,
                     "ratios": [b["steps_per_s"] / a["steps_per_s"] for a, b in pairs],
                     "accuracy_2": statistics.median(b["accuracy"] for b in twos),
                     "cpu_ms_1": cpu1, "cpu_ms_2": cpu2,
                     "wakeups_1": _median_of(ones, "wakeups"), "wakeups_2": _median_of(twos, "wakeups"),
                     "sync_changes_2": statistics.median(b["sync_changes"] for b in twos),
                     # per PS thread kind (bulk-conn: a worker's connection or the replica link's), one trial's
                     "threads_1": ones[len(ones) // 2]["threads"], "threads_2": twos[len(twos) // 2]["threads"],
                     "ps_cpu_ms_1": statistics.mean(ps1), "ps_cpu_ms_2": statistics.mean(ps2),
                     "total_cpu_ms_1": sum(cpu1.values()), "total_cpu_ms_2": sum(cpu2.values()),
                     "cpu_bound_cost": 1 - sum(cpu1.values()) / sum(cpu2.values()),
                     "cores_busy_1": one * sum(cpu1.values()) / 1000, "cores_busy_2": two * sum(cpu2.values()) / 1000}
    out["load_after"] = os.getloadavg()[0]
    return out


def table_cost(runs: int = 3, steps: int = 2000) -> dict[str, Any]:
    """W2 async steps/s with replicas: 1, placed by `k mod P` (elastic: false) and routed by the replica table
    with no backups (elastic: true), alternating in the same run (medians over `runs` pairs)."""
    out: dict[str, Any] = {"load_before": os.getloadavg()[0]}
    pairs = [(_trial(1, steps), _trial(1, steps, elastic=True)) for _ in range(runs)]
    plain, table = [a for a, _ in pairs], [b for _, b in pairs]
    out["plain"] = statistics.median(a["steps_per_s"] for a in plain)
    out["table"] = statistics.median(b["steps_per_s"] for b in table)
    out["ratios"] = [b["steps_per_s"] / a["steps_per_s"] for a, b in pairs]
    out["cost"] = 1 - out["table"] / out["plain"]
    out["ps_cpu_ms"] = [statistics.median(statistics.mean(v for k, v in t["cpu_ms"].items() if k.startswith("ps"))
                                          for t in trials) for trials in (plain, table)]
    out["accuracy"] = statistics.median(b["accuracy"] for b in table)
    out["load_after"] = os.getloadavg()[0]
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
