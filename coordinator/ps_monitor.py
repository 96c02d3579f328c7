"""Watches every PS task: pauses dispatch while one is down, and counts updates lost by a restart.

A restarted PS has a new incarnation and serves its newest checkpoint. Workers report the shard
versions their pushes produced, tagged with the PS incarnation, only when their closure completes;
the updates lost are the *reported* versions of the old incarnation beyond the version the PS
restored. A version applied by an attempt that then failed is not reported (its closure re-runs and
is applied again), so it is not counted: for a one-shard counter pushed once per closure,
counter == completed - lost_updates exactly.

Memory: per shard and incarnation the reported versions are kept as sorted disjoint ranges; a run
of consecutive reports is one range, so the ranges grow with the number of versions never reported
(failed attempts) and late reports in flight, not with the number of closures completed. After a
restart the old incarnation keeps only its ranges above the restored version.

A check that fails (a PS answering garbage, a restart met again mid-accounting) is logged and retried
with backoff; dispatch stays paused meanwhile. After `max_failures` failed checks in a row the monitor
gives up and reports the last error through `on_fatal`, so the coordinator fails `join()` with it
instead of staying paused forever.

With replicas: 2 (`lost_shards` given, coordinator/replica_keeper.py) a PS that is down does not pause
dispatch (its shards' backups take over), and a restart loses only the shards that came back from a
checkpoint because both their copies had died: only those count.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable

from pscluster.proto import pscluster_pb2 as pb

from pscluster.client.client import PSClient
from pscluster.errors import PsclusterError
from pscluster.net import rpc

log = logging.getLogger(__name__)


class VersionRanges:
    """A set of integers as sorted disjoint closed ranges; `count_above(v)` counts members > v."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, v: int) -> None:
        """Insert v (idempotent), merging with its neighbours."""
        i = bisect.bisect_right(self._starts, v) - 1
        if i >= 0 and self._starts[i] <= v <= self._ends[i]:
            return
        joins_left = i >= 0 and self._ends[i] == v - 1
        joins_right = i + 1 < len(self._starts) and self._starts[i + 1] == v + 1
        if joins_left and joins_right:
            self._ends[i] = self._ends[i + 1]
            del self._starts[i + 1], self._ends[i + 1]
        elif joins_left:
            self._ends[i] = v
        elif joins_right:
            self._starts[i + 1] = v
        else:
            self._starts.insert(i + 1, v)
            self._ends.insert(i + 1, v)

    def count_above(self, v: int) -> int:
        """How many members are > v."""
        return sum(e - max(s, v + 1) + 1 for s, e in zip(self._starts, self._ends) if e > v)

    def drop_through(self, v: int) -> None:
        """Forget members <= v."""
        i = bisect.bisect_right(self._ends, v)
        del self._starts[:i], self._ends[:i]
        if self._starts and self._starts[0] <= v:
            self._starts[0] = v + 1

    def __len__(self) -> int:
        return len(self._starts)


class PsMonitor:
    """Owns the `ps-monitor` thread; `wake()` asks for an immediate check, `stop()` ends it."""

    def __init__(self, client: PSClient, on_down: Callable[[], None], on_up: Callable[[], None],
                 interval: float = 0.5, on_fatal: Callable[[BaseException], None] | None = None,
                 max_failures: int = 5, lost_shards: Callable[[int], set[tuple[str, int]]] | None = None) -> None:
        self._client = client
        self._lost_shards = lost_shards
        self._on_down = on_down
        self._on_up = on_up
        self._on_fatal = on_fatal
        self._max_failures = max_failures
        self._interval = interval
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, int, int], VersionRanges] = {}  # (variable, shard, incarnation) -> reported
        self.incarnations = [s.incarnation for s in client.status()]
        # per restart: the PS, its old incarnation and the version each of its shards came back with
        self._restores: list[tuple[int, int, dict[tuple[str, int], int]]] = []
        self._thread = threading.Thread(target=self._loop, name="ps-monitor", daemon=True)

    def start(self) -> PsMonitor:
        """Start watching."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching and join the thread."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def wake(self) -> None:
        """Check now (a closure just met an unavailable PS)."""
        self._wake.set()

    def record(self, versions: list[pb.ShardVersion]) -> None:
        """Note shard versions reported by a finished closure."""
        with self._lock:
            for v in versions:
                key = (v.variable, v.shard_index, v.incarnation)
                ranges = self._seen.get(key)
                if ranges is None:  # not setdefault: that would build a VersionRanges per report
                    ranges = self._seen[key] = VersionRanges()
                ranges.add(v.version)

    @property
    def lost_updates(self) -> int:
        """Shard updates of completed closures that a PS restart rolled back (summed over shards).

        Computed from the latest reports, so closures that finish after the restart still count.
        """
        return sum(self.lost_updates_by_variable().values())

    def lost_updates_by_variable(self) -> dict[str, int]:
        """Lost shard updates per variable (for a one-shard variable: its completed closures lost)."""
        out: dict[str, int] = {}
        with self._lock:
            for ps, old, restored in self._restores:
                only = self._lost_shards(ps) if self._lost_shards is not None else None
                for (var, shard), version in restored.items():
                    if only is not None and (var, shard) not in only:
                        continue  # its backup took over: nothing acknowledged was lost
                    seen = self._seen.get((var, shard, old))
                    if seen is not None:
                        out[var] = out.get(var, 0) + seen.count_above(version)
        return out

    def _statuses(self) -> list[pb.PsStatus] | None:
        try:
            return [rpc.call(stub.Status, pb.PsStatusRequest(), timeout=1.0) for stub in self._client.stubs]
        except PsclusterError:
            return None

    def _loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self._check()
                failures = 0
            except Exception as exc:
                failures += 1
                log.warning("ps-monitor: check failed (%d of %d in a row): %s", failures, self._max_failures, exc,
                            exc_info=failures == self._max_failures)
                if failures >= self._max_failures:
                    if self._on_fatal is None:
                        raise
                    self._on_fatal(exc)
                    return
                self._stop.wait(min(0.1 * 2 ** failures, 2.0))

    def _check(self) -> None:
        """One round: wait for the interval or a wake, then look at every PS (the loop body)."""
        woken = self._wake.wait(self._interval)
        self._wake.clear()
        if self._lost_shards is not None:
            self._check_replicated()
            if woken:
                self._on_up()  # a closure met a dead PS: its retry finds the promoted backup, nothing to wait for
            return
        statuses = self._statuses()
        restarted = statuses is not None and any(
            s.incarnation != old for s, old in zip(statuses, self.incarnations))
        if statuses is not None and not restarted:
            if woken:
                # A closure was handed back as a cluster failure but every PS answers and none
                # restarted (e.g. a token wait timed out): resume at once rather than stay paused.
                self._on_up()
            return
        self._on_down()
        started = time.monotonic()
        log.warning("a PS is unavailable or restarted: dispatch paused until every PS answers")
        while statuses is None and not self._stop.wait(0.1):
            statuses = self._statuses()
        if statuses is None:
            return
        for ps, status in enumerate(statuses):
            if status.incarnation != self.incarnations[ps]:
                self._account(ps, status)
        log.warning("every PS answers again after %.1f s; resuming dispatch", time.monotonic() - started)
        self._on_up()

    def _check_replicated(self) -> None:
        """replicas: 2: note each restart as it answers; never pause (the replica keeper promotes backups)."""
        for ps, stub in enumerate(self._client.stubs):
            try:
                status = rpc.call(stub.Status, pb.PsStatusRequest(), timeout=1.0)
            except PsclusterError:
                continue
            if status.incarnation != self.incarnations[ps]:
                self._account(ps, status)

    def _account(self, ps: int, status: pb.PsStatus) -> None:
        old = self.incarnations[ps]
        created = self._client.recreate_missing(ps)  # before dispatch resumes: no NotFoundError to closures
        if created:
            log.warning("ps %d came back without %d shard(s) created after its checkpoint; created them again",
                        ps, created)
        reply = rpc.call(self._client.stubs[ps].ListShards, pb.ListShardsRequest(), timeout=5.0)
        restored = {(i.spec.variable, i.spec.shard_index): max(i.restored_version, 0) for i in reply.shards}
        with self._lock:
            self._restores.append((ps, old, restored))
            for (var, shard), version in restored.items():
                seen = self._seen.get((var, shard, old))
                if seen is not None:
                    seen.drop_through(version)  # only what the restart rolled back can ever count
        self.incarnations[ps] = status.incarnation
        log.warning("ps %d restarted from checkpoint step %d; %d updates lost so far (applied after that "
                    "checkpoint; see ClusterCoordinator.lost_updates)", ps, status.restored_step, self.lost_updates)
