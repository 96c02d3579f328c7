"""Sync reports a primary counted that its backup may not hold yet (replicas: 2), sent again to a new primary.

A StepDone's reply does not wait for the sync state's backup (server/sync_state.py): one forward per take instead
of one per take and per report. The closure's reply carries where its report was counted (SyncReport: the step,
the worker, and the epoch and version of the state). The coordinator keeps each such report until the state's
primary says its backup confirmed that version (the replica keeper's heartbeat round passes the primary's
PsStatus on), and sends it again when the state's row has a newer epoch than the one that counted it: at once
when the row moved before the closure's reply arrived, else when a keeper round sees the move. A report counts
once on the PS (a repeat of one it holds, or one for a step that advanced, changes nothing), so a resend is
always safe; without it a report lost with its primary would leave its step one short forever (R = N).

`HeldReports` is the bookkeeping (no threads, no RPC); `ReportResender` owns the thread that sends.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from pscluster.proto import pscluster_pb2 as pb

from pscluster.errors import PsclusterError

log = logging.getLogger(__name__)

LIMIT = 4096  # reports held at most: a take waits for its backup, so ~N in flight are unconfirmed, never more


@dataclass(frozen=True)
class Report:
    """A closure's StepDone and the (epoch, version) of the sync state that counted it."""

    closure_id: int
    step: int
    worker: str
    epoch: int
    version: int


class HeldReports:
    """Reports not yet confirmed by the sync state's backup; decides which to send again (not thread-safe)."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self.epoch = 0  # the newest epoch of the state's row seen in a keeper round
        self._held: dict[int, Report] = {}  # closure id -> its report, oldest first
        self._sending: set[int] = set()  # closures whose resend is queued or in flight
        self.resent = 0  # reports sent again so far
        self.received = 0  # reports closures' replies carried (of a state with a backup)

    def __len__(self) -> int:
        return len(self._held)

    def add(self, report: Report) -> list[Report]:
        """A closure's reply carried its report; returns it when it must go again now (the row moved since)."""
        if report.epoch <= 0:  # one copy: the StepDone's reply was the whole story
            return []
        self.received += 1
        self._held.pop(report.closure_id, None)
        self._held[report.closure_id] = report
        while len(self._held) > self.limit:  # by construction never: a guard on memory, said loudly
            dropped = self._held.pop(next(iter(self._held)))
            log.warning("sync reports: more than %d unconfirmed; forgot closure %d's (step %d)", self.limit,
                        dropped.closure_id, dropped.step)
        return self._due([report])

    def round(self, epoch: int, confirmed: tuple[int, int]) -> list[Report]:
        """A keeper round: the row's epoch now and the (epoch, version) its primary's backup confirmed. Forgets what
        two copies hold; returns the reports to send again (counted at an older epoch than the row's)."""
        c_epoch, c_version = confirmed
        for cid, r in list(self._held.items()):
            if r.epoch == c_epoch and r.version <= c_version and cid not in self._sending:
                del self._held[cid]
        self.epoch = max(self.epoch, epoch)
        return self._due(list(self._held.values()))

    def sent(self, closure_id: int, epoch: int, version: int) -> list[Report]:
        """A resend's reply: where the report was counted this time; returns it when it must go again."""
        self._sending.discard(closure_id)
        r = self._held.get(closure_id)
        if r is None:
            return []
        self.resent += 1
        if epoch <= 0:  # counted by a state with one copy now: nothing to confirm
            del self._held[closure_id]
            return []
        self._held[closure_id] = r = replace(r, epoch=epoch, version=version)
        return self._due([r])

    def failed(self, closure_id: int, retryable: bool) -> None:
        """A resend failed: a retryable failure goes again at the next round, any other forgets the report."""
        self._sending.discard(closure_id)
        if not retryable:
            self._held.pop(closure_id, None)

    def _due(self, reports: list[Report]) -> list[Report]:
        due = [r for r in reports if r.epoch < self.epoch and r.closure_id not in self._sending]
        self._sending.update(r.closure_id for r in due)
        return due


class ReportResender:
    """Holds closures' sync reports and sends again those a new primary may lack; `stop()` joins its thread."""

    def __init__(self, step_done: Callable[[int, int, str], tuple[int, int]], limit: int = LIMIT) -> None:
        """step_done(closure id, step, worker) -> (epoch, version): the client's StepDone (it retries while the
        state's row moves)."""
        self._step_done = step_done
        self._lock = threading.Lock()
        self._held = HeldReports(limit)
        self._queue: queue.SimpleQueue[Report | None] = queue.SimpleQueue()  # bounded: one entry per held report
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sync-reports", daemon=True)

    def start(self) -> ReportResender:
        """Start the sending thread (what was reported before waits in the queue)."""
        self._thread.start()
        return self

    @property
    def held(self) -> int:
        """Reports not yet confirmed by two copies."""
        with self._lock:
            return len(self._held)

    @property
    def received(self) -> int:
        """Reports closures' replies carried so far."""
        with self._lock:
            return self._held.received

    @property
    def resent(self) -> int:
        """Reports sent again so far."""
        with self._lock:
            return self._held.resent

    def reported(self, closure_id: int, report: pb.SyncReport) -> None:
        """A closure's reply carried its report (the coordinator's loop: never blocks)."""
        with self._lock:
            due = self._held.add(Report(closure_id, report.step, report.worker, report.epoch, report.version))
        self._send(due)

    def observe(self, epoch: int, confirmed: tuple[int, int]) -> None:
        """A keeper round's view of the state's row (its thread: never blocks)."""
        with self._lock:
            due = self._held.round(epoch, confirmed)
        self._send(due)

    def stop(self) -> None:
        """Stop the thread and join it: what is queued is dropped, a resend in flight ends within the client's
        retry_for."""
        self._stop.set()
        self._queue.put(None)
        if self._thread.ident is not None:
            self._thread.join(timeout=30)

    def _send(self, due: list[Report]) -> None:
        for r in due:
            self._queue.put(r)

    def _loop(self) -> None:
        while (r := self._queue.get()) is not None and not self._stop.is_set():
            try:
                epoch, version = self._step_done(r.closure_id, r.step, r.worker)
            except PsclusterError as exc:
                log.warning("sync reports: closure %d's report of step %d could not be sent again%s: %s",
                            r.closure_id, r.step, " (next round tries again)" if exc.retryable else "", exc)
                with self._lock:
                    self._held.failed(r.closure_id, exc.retryable)
                continue
            log.info("sync reports: closure %d's report of step %d sent again to the state's new primary (epoch %d)",
                     r.closure_id, r.step, epoch)
            with self._lock:
                due = self._held.sent(r.closure_id, epoch, version)
            self._send(due)
