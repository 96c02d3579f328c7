"""B11 chaos soak: W2 async on 2 PS + 3 workers under a seeded fault schedule, with exact accounting.

Schedule (times scale with `duration_s`; B11 is 600 s): a worker SIGKILLed every 10 s (the supervisor
replaces it), a worker SIGSTOPped for 5 s every 30 s, a PS SIGKILLed at 30% and 70% of the run (3 and
7 minutes of 10; the supervisor restores it from the newest automatic checkpoint, taken every 5 s).
The driver schedules closures in rounds of `round_size` and joins each round. Recorded: every
RemoteValue resolved, counter == completed - lost counter updates, test accuracy, and each role's
threads / open files / RSS (from /proc) in the window after 20% of the run against the last 8%.
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import threading
import time
from typing import Any

import numpy as np

import pscluster as ps
from bench.common import rss_kib
from bench.training import mnist
from pscluster.ops.launcher import Daemon, LocalCluster


def make_counted_step(params: list[ps.Variable], counter: ps.Variable):
    """W2's step, plus one push of -1 to a one-shard counter in the same push."""

    def step(iterator) -> float:
        x, y = next(iterator)
        loss, grads = mnist.mlp_grads(ps.pull(params), x, y)
        ps.push([*zip(params, grads), (counter, np.array(-1, np.int64))])
        return loss

    return step


def _proc_figures(pid: int) -> tuple[int, int, int] | None:
    """(threads, open files, RSS KiB) of pid, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            threads = next(int(line.split()[1]) for line in fh if line.startswith("Threads:"))
        return threads, len(os.listdir(f"/proc/{pid}/fd")), rss_kib(pid)
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return None


class Chaos:
    """Owns the fault thread: runs the seeded schedule against `cluster` until `stop()` joins it."""

    def __init__(self, cluster: LocalCluster, duration_s: float, seed: int) -> None:
        self.cluster = cluster
        self.duration_s = duration_s
        self.rng = random.Random(seed)
        self.counts = {"worker_kills": 0, "worker_stops": 0, "ps_kills": 0}
        self.samples: list[tuple[float, str, tuple[int, int, int]]] = []  # (fraction of run, role, figures)
        self._stop = threading.Event()
        self._stopped: list[Daemon] = []
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> Chaos:
        """Start the schedule (time 0 is now)."""
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the schedule, resume any stopped worker, join the thread."""
        self._stop.set()
        self._thread.join(timeout=60)
        for d in self._stopped:
            self._cont(d)

    def _cont(self, d: Daemon) -> None:
        if d.proc is not None and d.proc.poll() is None:
            os.kill(d.pid, signal.SIGCONT)

    def _events(self) -> list[tuple[float, str]]:
        d = self.duration_s
        ev = [(t, "kill_worker") for t in np.arange(10.0, d, 10.0)]
        ev += [(t, "stop_worker") for t in np.arange(25.0, d, 30.0)]  # offset: not on a kill's second
        ev += [(0.3 * d, "kill_ps"), (0.7 * d, "kill_ps")]
        ev += [(t, "sample") for t in np.arange(0.0, d, 2.0)]
        return sorted((float(t), kind) for t, kind in ev)

    def _run(self) -> None:
        try:
            pending: list[tuple[float, Daemon]] = []  # SIGCONT due times
            for at, kind in self._events():
                while not self._stop.is_set():
                    now = time.monotonic() - self._t0
                    for due, d in [p for p in pending if p[0] <= now]:
                        self._cont(d)
                        pending.remove((due, d))
                        self._stopped.remove(d)
                    if now >= at:
                        break
                    self._stop.wait(min(0.05, at - now))
                if self._stop.is_set():
                    return
                self._fault(kind, at, pending)
        except BaseException as exc:  # noqa: BLE001 - reported by the soak's result
            self.error = exc

    def _fault(self, kind: str, at: float, pending: list[tuple[float, Daemon]]) -> None:
        alive = [w for w in self.cluster.workers if w.proc is not None and w.proc.poll() is None
                 and w not in self._stopped]
        if kind == "kill_worker" and alive:
            self.cluster.kill(self.rng.choice(alive), signal.SIGKILL)  # the supervisor starts a replacement
            self.counts["worker_kills"] += 1
        elif kind == "stop_worker" and alive:
            victim = self.rng.choice(alive)
            self.cluster.kill(victim, signal.SIGSTOP)
            self._stopped.append(victim)
            pending.append((at + 5.0, victim))
            self.counts["worker_stops"] += 1
        elif kind == "kill_ps":
            self.cluster.kill(self.rng.choice(self.cluster.ps), signal.SIGKILL)
            self.counts["ps_kills"] += 1
        elif kind == "sample":
            frac = at / self.duration_s
            for role, daemons in (("ps", self.cluster.ps), ("worker", self.cluster.workers)):
                for d in daemons:
                    figures = _proc_figures(d.pid) if d.proc is not None and d.proc.poll() is None else None
                    if figures is not None:
                        self.samples.append((frac, role, figures))
            own = _proc_figures(os.getpid())
            if own is not None:
                self.samples.append((frac, "coordinator", own))


def growth(samples: list[tuple[float, str, tuple[int, int, int]]]) -> dict[str, dict[str, float]]:
    """Per role: threads / fds / RSS MiB, the max over [0.2, 0.3) of the run and the min over [0.92, 1.0).

    A leak is what stays: the late minimum rises with it, while a thread or socket that lives for
    a moment (a restart's reader, a checkpoint in flight) only lifts a maximum.
    """
    out: dict[str, dict[str, float]] = {}
    for role in ("ps", "worker", "coordinator"):
        early = [f for t, r, f in samples if r == role and 0.2 <= t < 0.3]
        late = [f for t, r, f in samples if r == role and t >= 0.92]
        if not early or not late:
            continue
        for i, name in enumerate(("threads", "fds", "rss_mib")):
            scale = 1024 if name == "rss_mib" else 1
            out.setdefault(role, {})[f"{name}_early"] = max(f[i] for f in early) / scale
            out[role][f"{name}_late"] = min(f[i] for f in late) / scale
    return out


def soak(duration_s: float = 600.0, seed: int = 0, num_workers: int = 3, round_size: int = 200,
         rss_slack_mib: float = 20.0) -> dict[str, Any]:
    """Run the soak; returns figures and `ok` (every check met)."""
    x, y, xt, yt = mnist.load_mnist()
    with tempfile.TemporaryDirectory(prefix="pscluster-b11-") as tmp:
        train_path = f"{tmp}/train.npz"
        np.savez(train_path, x=x, y=y)
        with LocalCluster(2, num_workers, workdir=f"{tmp}/cluster", supervise=True) as cluster:
            coord = ps.ClusterCoordinator(cluster.settings(checkpoint_every_s=5.0))
            chaos = Chaos(cluster, duration_s, seed)
            try:
                coord.wait_for_workers(num_workers)
                params = mnist.create_params(coord, lr=0.1)
                counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
                step = make_counted_step(params, counter)
                it = iter(mnist.make_dataset(coord, train_path, 64))
                completed = unresolved = errors = 0
                start = time.monotonic()
                chaos.start()
                while time.monotonic() - start < duration_s:
                    values = [coord.schedule(step, args=(it,)) for _ in range(round_size)]
                    try:
                        coord.join(timeout=300)
                    except Exception:  # noqa: BLE001 - counted, the soak goes on
                        errors += 1
                    for v in values:
                        if not v.done():
                            unresolved += 1
                            continue
                        try:
                            v.fetch()
                            completed += 1
                        except Exception:  # noqa: BLE001
                            errors += 1
                chaos.stop()
                coord.join(timeout=120)
                counter_value = int(counter.pull())
                lost = coord.lost_updates_by_variable().get("counter", 0)
                acc = mnist.accuracy(ps.pull(params), xt, yt)
                status = coord.status()
            finally:
                chaos.stop()
                coord.shutdown()
    g = growth(chaos.samples)
    flat = all(v[f"{n}_late"] <= v[f"{n}_early"] + (rss_slack_mib if n == "rss_mib" else 0)
               for v in g.values() for n in ("threads", "fds", "rss_mib"))
    r = {"duration_s": duration_s, "completed": completed, "unresolved": unresolved, "errors": errors,
         "counter": counter_value, "lost_counter_updates": lost, "lost_updates": coord.lost_updates,
         "accuracy": acc, "retried": status.retried, **chaos.counts, "growth": g, "flat": flat,
         "chaos_error": repr(chaos.error) if chaos.error else None}
    r["exact"] = counter_value == completed - lost
    r["ok"] = (r["exact"] and unresolved == 0 and errors == 0 and acc >= 0.92 and flat and chaos.error is None
               and len(g) == 3)
    return r
