"""B15SOAK: SIGKILL a random PS every few seconds under training with replicas: 2; nothing acknowledged is lost.

3 PS (each the primary of one counter and the backup of another's), 2 workers, a supervisor that restarts
a killed PS (it rejoins as a backup and catches up). A driver schedules closures that push -1 to every
counter (SGD(1.0)) and checkpoints every few batches; a killer SIGKILLs, every `interval` seconds:
- a random PS once every shard's backup is in sync (it is the primary of some shards, mid-push or
  mid-checkpoint, and the backup of others), or
- with probability 1/4, the last victim again once its restarted process runs: while it rejoins or catches
  up. With 3 PS the others took its shards' copies while it was away, so a rebalance (`scale_ps`, run beside)
  gives it its share back: it is then the backup of the copies it takes while each catches up (a 32 MiB Adam
  "ballast" variable per PS makes each catch-up carry ~100 MiB), and the kill lands then ("mid-catch-up") if
  the coordinator shows it catching up within a few seconds ("mid-rejoin" otherwise). A kill there is safe
  when every shard it is the primary of has an in-sync backup; the rebalance it cut short is not retried.
A primary is never killed while a shard it holds has no in-sync backup (that is two copies lost: the
checkpoint fallback, whose loss lost_updates() reports; docs/ps_failures.md).

Oracle: async and bounded, every counter == closures completed; sync (R = N = 2), every counter ==
global step; bounded, the global step == closures completed too (each report counted once); lost_updates()
== 0. The sync token queue, bounded clocks and global step have a primary (PS 0 at first) and a backup like
a shard, so any PS is a victim in every mode, the token queue's primary included.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from typing import Any

import numpy as np

import pscluster as ps
from pscluster.ops.launcher import LocalCluster
from pscluster.placement import SYNC_STATE_KEY

NUM_PS = 3


def _increment(counters: list[Any]) -> int:
    ps.push([(c, np.array(-1, np.int64)) for c in counters])  # one push of every counter
    return 1


def _wait(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _retry(fn: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except ps.PsclusterError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def soak(mode: str = "async", kills: int = 34, interval: float = 2.0, seed: int = 0,
         ballast_mib: int = 32) -> dict[str, Any]:
    """`kills` SIGKILLs under `mode` training (async, sync or bounded); the counters must be exact.
    ballast_mib: an Adam variable of this size per PS (3x in state) that each catch-up carries."""
    rng = random.Random(seed)
    victims = list(range(NUM_PS))
    stop = threading.Event()
    completed = [0]
    errors: list[BaseException] = []
    kinds = {"in sync": 0, "mid-catch-up": 0, "mid-rejoin": 0}
    sync_kills = 0  # kills of the PS holding the token queue, clocks and global step (its primary)
    checkpoints = {"saved": 0, "failed": 0}
    started = time.monotonic()
    with LocalCluster(NUM_PS, 2, supervise=True, replicas=2) as cluster:
        coord = ps.ClusterCoordinator(cluster.settings())
        try:
            coord.wait_for_workers(2)
            counters = [coord.create_variable(f"counter{i}", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
                        for i in range(NUM_PS)]  # ordinals 0..2: one primary on each PS
            # ordinals 3..5: state that makes a catch-up last long enough to be killed in the middle of it
            ballast = [coord.create_variable(f"ballast{i}", shape=(ballast_mib << 18,), dtype="float32",
                                             optimizer=ps.Adam(1e-3)) for i in range(NUM_PS)]
            if mode == "sync":
                coord.configure_sync("sync", replicas_to_aggregate=2, total_num_replicas=2)
            elif mode == "bounded":
                coord.configure_sync("bounded", staleness=2)

            def all_in_sync() -> bool:
                table = coord.replica_table()  # the counters, the ballast and the sync state's row
                return len(table) == 2 * NUM_PS + 1 and all(c.backup is not None and c.in_sync for c in table.values())

            def safe(task: int) -> bool:
                """Every copy task is primary of has an in-sync backup: killing it loses no shard's last copy."""
                return all(c.backup is not None and c.in_sync for c in coord.replica_table().values()
                           if c.primary == task)

            def catching_up(task: int) -> bool:
                """task is the backup of a copy that is catching up, and killing it is safe."""
                return any(c.backup == task and not c.in_sync for c in coord.replica_table().values()) and safe(task)

            def rebalance(task: int, killed: threading.Event) -> None:
                """Give a restarted PS its share of the copies (it holds none), once the coordinator sees it up."""
                deadline = time.monotonic() + 60
                while not killed.is_set() and not stop.is_set() and time.monotonic() < deadline:
                    try:
                        coord.scale_ps(NUM_PS, cancelled=killed.is_set)
                        return
                    except ps.PsclusterError:  # not up yet, or another move raced it: again
                        time.sleep(0.1)

            def drive() -> None:
                batch = 0
                while not stop.is_set():
                    try:
                        values = [coord.schedule(_increment, args=(counters,)) for _ in range(40)]
                        completed[0] += sum(v.fetch() for v in values)
                        batch += 1
                        if batch % 3 == 0:
                            try:
                                coord.checkpoint()
                                checkpoints["saved"] += 1
                            except ps.PsclusterError:  # a PS was down for the whole retry: not a loss
                                checkpoints["failed"] += 1
                    except BaseException as exc:  # noqa: BLE001 - reported at the end
                        errors.append(exc)
                        return

            _wait(all_in_sync, "every counter's backup")
            driver = threading.Thread(target=drive, name="soak-driver", daemon=True)
            driver.start()
            last: int | None = None
            gone_pid = 0
            for _ in range(kills):
                if errors:
                    raise errors[0]
                if last is not None and rng.random() < 0.25:
                    # the last victim again once its restarted process runs: while it rejoins and catches up the
                    # copies the rebalance gives it (killed only while every copy it is primary of has an in-sync
                    # backup: a move may have made it a primary)
                    _wait(lambda: cluster.ps[last].pid != gone_pid, "the supervisor's restart", timeout=60.0)
                    killed = threading.Event()
                    mover = threading.Thread(target=rebalance, args=(last, killed), name="soak-rebalance", daemon=True)
                    mover.start()
                    try:
                        _wait(lambda: catching_up(last), "the restarted PS to catch up", timeout=10.0)
                        kinds["mid-catch-up"] += 1
                    except TimeoutError:
                        kinds["mid-rejoin"] += 1  # not seen catching up (yet, or already done): killed anyway
                        _wait(lambda: safe(last), "the restarted PS's copies to have in-sync backups", timeout=120.0)
                    gone_pid = cluster.ps[last].pid  # before the kill: the supervisor may restart it at once
                    cluster.kill(cluster.ps[last], signal.SIGKILL)
                    killed.set()
                    mover.join(timeout=120)
                    continue
                time.sleep(rng.uniform(0.5, 1.5) * interval)
                _wait(all_in_sync, "every backup in sync before a kill", timeout=120.0)
                kinds["in sync"] += 1
                last = rng.choice(victims)
                sync_kills += coord.replica_table()[SYNC_STATE_KEY].primary == last
                gone_pid = cluster.ps[last].pid
                cluster.kill(cluster.ps[last], signal.SIGKILL)
            stop.set()
            driver.join(timeout=120)
            if errors:
                raise errors[0]
            time.sleep(1.0)  # the coordinator notices the last kill (3 missed polls, 100 ms apart) before this
            _wait(all_in_sync, "every backup in sync at the end", timeout=120.0)
            values = [int(c.pull()) for c in counters]
            steps = _retry(lambda: coord.sync_stats()["global_step"]) if mode != "async" else None
            sync_holder = coord.replica_table()[SYNC_STATE_KEY].primary
            lost = coord.lost_updates
        finally:
            stop.set()
            coord.shutdown()
    expected = steps if mode == "sync" else completed[0]  # SGD(1.0) on -1: +1 per update
    return {"mode": mode, "kills": kills, "kinds": kinds, "closures": completed[0], "global_step": steps,
            "counters": values, "expected": expected, "lost_updates": lost, "checkpoints": checkpoints,
            "seconds": time.monotonic() - started, "victims": victims, "ballast": len(ballast),
            "sync_state_kills": sync_kills, "sync_state_on_ps": sync_holder,
            "exact": all(v == expected for v in values) and lost == 0
            and (mode != "bounded" or steps == completed[0])}
