"""Runs one closure: unpickle, run inside a ClosureScope, classify the outcome. No gRPC."""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

import cloudpickle

from pscluster import closures
from pscluster.client.client import PSClient
from pscluster.client.context import ClosureScope
from pscluster.client.datasets import WorkerDatasets, WorkerInfo
from pscluster.closures import FunctionCache
from pscluster.errors import PsclusterError

if TYPE_CHECKING:
    from pscluster.ops.metrics import WorkerMetrics

log = logging.getLogger(__name__)


# a closure's StepDone: (step, worker, the sync state's epoch and version that counted it)
SyncReport = tuple[int, str, int, int]


@dataclass(frozen=True)
class Outcome:
    """What running a closure produced: a pickled result, the user's error, or a cluster failure."""

    result: bytes = b""
    error_type: str = ""
    error_message: str = ""
    error_traceback: str = ""
    error_pickled: bytes = b""
    retryable: bool = False
    seconds: float = 0.0
    versions: tuple[tuple[str, int, int, int], ...] = ()  # (variable, shard, version, PS incarnation)
    scalars: tuple[tuple[str, float], ...] = ()  # report(): (name, mean over the closure)
    # sync/bounded: its StepDone (step, worker, and the sync state's epoch and version that counted it: with
    # replicas: 2 the coordinator sends it again to a new primary unless the backup confirmed it)
    report: SyncReport | None = None


class ClosureRunner:
    """Executes closures for one worker process."""

    def __init__(self, client: PSClient, datasets: WorkerDatasets, metrics: bool = True) -> None:
        self.client = client
        self.datasets = datasets
        self.functions = FunctionCache()
        self.closures_run = 0
        self.metrics: WorkerMetrics | None = None
        if metrics:  # the worker daemon asks for them only with a metrics port: prometheus_client is ~0.1 s to import
            from pscluster.ops.metrics import WorkerMetrics

            self.metrics = WorkerMetrics(client.nonfinite_counts)

    def run(self, closure_id: int, payload: bytes, sync_mode: str = "async", worker_index: int | None = None,
            final_below: int = 0, push_pull: bool = False) -> Outcome:
        """Run the closure in payload; never raises."""
        if worker_index is not None and worker_index != self.datasets.info.worker_index:
            # The coordinator's word wins: it may dispatch before our Register reply was processed.
            self.datasets.info = WorkerInfo(self.datasets.info.worker_id, worker_index)
        outcome = self._run(closure_id, payload, sync_mode, final_below, push_pull)
        kind = "retryable" if outcome.retryable else "error" if outcome.error_type else "ok"
        if self.metrics is not None:
            self.metrics.closures.labels(kind).inc()
            self.metrics.latency.observe(outcome.seconds)
        return outcome

    def _run(self, closure_id: int, payload: bytes, sync_mode: str, final_below: int = 0,
             push_pull: bool = False) -> Outcome:
        start = time.perf_counter()
        report: SyncReport | None = None
        try:
            fn, args, kwargs = self.functions.decode(payload)
            with ClosureScope(closure_id, self.client, self.datasets, sync_mode, final_below, push_pull) as scope:
                value = fn(*args, **kwargs)
                if scope.token is not None:  # its pushes are in: count it towards the step
                    worker = self.datasets.info.worker_id
                    epoch, version = self.client.step_done(closure_id, scope.token.step, worker)
                    report = (scope.token.step, worker, epoch, version)
            result = closures.dumps(value)
            versions = tuple((k[0], k[1], v, k[2]) for k, v in scope.versions.items())
            scalars = tuple((name, total / count) for name, (total, count) in scope.scalars.items())
        except PsclusterError as exc:
            if exc.retryable:  # the cluster failed the closure (a PS is down): rescheduled, not the user's
                log.warning("closure %d: %s; handing it back", closure_id, exc)
                return Outcome(retryable=True, error_type=type(exc).__name__, error_message=str(exc),
                               seconds=time.perf_counter() - start)
            return self._user_error(exc, start, report)
        except Exception as exc:  # noqa: BLE001 - the user's error, reported not retried
            return self._user_error(exc, start, report)
        self.closures_run += 1
        return Outcome(result=result, seconds=time.perf_counter() - start, versions=versions, scalars=scalars,
                       report=report)

    @staticmethod
    def _user_error(exc: Exception, start: float, report: SyncReport | None = None) -> Outcome:
        try:
            pickled = cloudpickle.dumps(exc)
            cloudpickle.loads(pickled)
        except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text only
            pickled = b""
        return Outcome(error_type=type(exc).__name__, error_message=str(exc),
                       error_traceback="".join(traceback.format_exception(exc)), error_pickled=pickled,
                       seconds=time.perf_counter() - start, report=report)


