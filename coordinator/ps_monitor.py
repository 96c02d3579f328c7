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

With a replica table (`replicated`, coordinator/replica_keeper.py) a PS that is down does not pause
dispatch (its shards' backups take over), and a restart loses only the shards that came back from a
checkpoint because both their copies had died: the keeper says so (`shard_restored`) before the restarted
PS may take their pushes, and the versions every earlier primary of such a shard reported count.

What to do when is decided by ps_health.py's pure state machine; this module owns the thread and the RPCs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pscluster.coordinator import ps_health as health
from pscluster.coordinator.ps_health import VersionRanges as VersionRanges
from pscluster.coordinator.replicas import Copies
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc

from pscluster.client.client import PSClient
from pscluster.errors import PsclusterError
from pscluster.net import rpc

log = logging.getLogger(__name__)


class PsMonitor:
    """Owns the `ps-monitor` thread and executes ps_health.decide; `wake()` asks for an immediate check,
    `stop()` ends it."""

    def __init__(self, client: PSClient, on_down: Callable[[], None], on_up: Callable[[], None],
                 interval: float = 0.5, on_fatal: Callable[[BaseException], None] | None = None,
                 max_failures: int = 5, replicated: bool = False,
                 clock: Callable[[], float] = time.monotonic,
                 table: Callable[[], dict[tuple[str, int], Copies]] | None = None) -> None:
        """table: the replica keeper's (replicas: 2 or elastic): where each shard lives now (a restarted PS gets
        again only the shards it is primary of)."""
        self._client = client
        self._replicated = replicated
        self._table = table
        self._on_down = on_down
        self._on_up = on_up
        self._on_fatal = on_fatal
        self._interval = interval
        self._clock = clock
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the state: the thread accounts while the loop records and status reads
        self._state = health.HealthState([s.incarnation for s in client.status()], max_failures,
                                         replicated=replicated)
        self._thread = threading.Thread(target=self._loop, name="ps-monitor", daemon=True)

    @property
    def incarnations(self) -> list[int]:
        """Per PS: the incarnation last accounted."""
        return self._state.incarnations

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
        self._decide(health.Reported(versions))

    def shard_restored(self, ps: int, incarnation: int, shard: tuple[str, int]) -> None:
        """Replicated: `shard` came back from a checkpoint on PS ps, restarted as `incarnation` (both copies died);
        called before that PS takes the shard's pushes."""
        self._decide(health.ShardRestored(ps, incarnation, *shard))

    @property
    def lost_updates(self) -> int:
        """Shard updates of completed closures that a PS restart rolled back (summed over shards).

        Computed from the latest reports, so closures that finish after the restart still count.
        """
        return sum(self.lost_updates_by_variable().values())

    def lost_updates_by_variable(self) -> dict[str, int]:
        """Lost shard updates per variable (for a one-shard variable: its completed closures lost)."""
        with self._lock:
            return health.lost_by_variable(self._state)

    def _decide(self, event: health.Event) -> list[health.Action]:
        with self._lock:
            return health.decide(self._state, event, self._clock())

    def _poll(self, woken: bool = False) -> health.Polled:
        if self._replicated:  # a replica table: every PS that answers counts on its own
            return health.Polled(tuple(self._status(stub) for stub in self._client.stubs), woken)
        try:
            statuses = [rpc.call(stub.Status, pb.PsStatusRequest(), timeout=1.0) for stub in self._client.stubs]
        except PsclusterError:
            return health.Polled(None, woken)
        return health.Polled(tuple(health.Seen(s.incarnation, s.restored_step) for s in statuses), woken)

    def _status(self, stub: pb_grpc.ParameterServerStub) -> health.Seen | None:
        try:
            status = rpc.call(stub.Status, pb.PsStatusRequest(), timeout=1.0)
        except PsclusterError:
            return None
        return health.Seen(status.incarnation, status.restored_step)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._check()
                self._decide(health.CheckPassed())
            except Exception as exc:
                for action in self._decide(health.CheckFailed(exc)):
                    if isinstance(action, health.Backoff):
                        log.warning("ps-monitor: check failed (%d of %d in a row): %s", action.failures,
                                    self._state.max_failures, exc)
                        self._stop.wait(action.seconds)
                    elif isinstance(action, health.GiveUp):
                        log.warning("ps-monitor: check failed (%d of %d in a row): %s", action.failures,
                                    self._state.max_failures, exc, exc_info=True)
                        if self._on_fatal is None:
                            raise
                        self._on_fatal(exc)
                        return

    def _check(self) -> None:
        """One round: wait for the interval or a wake, then look at every PS until each answers."""
        woken = self._wake.wait(self._interval)
        self._wake.clear()
        event: health.Polled | None = self._poll(woken)
        while event is not None:
            actions, event = self._decide(event), None
            for action in actions:
                if isinstance(action, health.Pause):
                    self._on_down()
                    log.warning("a PS is unavailable or restarted: dispatch paused until every PS answers")
                elif isinstance(action, health.PollSoon):
                    if self._stop.wait(action.after):
                        return
                    event = self._poll()
                elif isinstance(action, health.Account):
                    self._account(action)
                elif isinstance(action, health.Resume):
                    if action.paused_s is not None:
                        log.warning("every PS answers again after %.1f s; resuming dispatch", action.paused_s)
                    self._on_up()

    def _account(self, action: health.Account) -> None:
        ps = action.ps
        primaries = {key: c.primary for key, c in self._table().items()} if self._table is not None else None
        created = self._client.recreate_missing(ps, primaries)  # before dispatch resumes: no NotFoundError to closures
        if created:
            log.warning("ps %d came back without %d shard(s) created after its checkpoint; created them again",
                        ps, created)
        reply = rpc.call(self._client.stubs[ps].ListShards, pb.ListShardsRequest(), timeout=5.0)
        restored = {(i.spec.variable, i.spec.shard_index): max(i.restored_version, 0) for i in reply.shards}
        self._decide(health.Restored(ps, action.incarnation, restored))
        log.warning("ps %d restarted from checkpoint step %d; %d updates lost so far (applied after that "
                    "checkpoint; see ClusterCoordinator.lost_updates)", ps, action.restored_step, self.lost_updates)
