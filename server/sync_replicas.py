"""Synchronous and bounded-staleness updates (TF1's SyncReplicasOptimizer; ps-lite's bounded delay).

sync: PS 0 keeps the global step G and a token queue of N (`total_num_replicas`) tokens per step.
A closure takes a token (G, replica) before its first pull and tags its pushes with G. Every shard
accumulates the gradients tagged with its current step; when R (`replicas_to_aggregate`) have
arrived it applies their average once and moves to the next step; a gradient tagged with an older
step is stale: dropped and counted (a repeat of a push its step counted is dropped, not counted). A
closure that finished its pushes reports StepDone(G); after R reports G advances and the tokens of
the next step are released. Every reporting closure has pushed to every shard, so R reports mean
every shard has seen R gradients of the step: no shard can be left behind, and no step waits for backups (N > R) or for a dead token holder, whose
closure is rescheduled with the same id and gets its token back.

bounded: pushes apply on arrival (async), but a worker may start a step only while its clock is at
most `staleness` steps ahead of the slowest live worker; the widest spread ever admitted is kept
for inspection.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pscluster.server.ps import ParameterServerCore
from pscluster.server.push_record import push_key
from pscluster.server.store import PushItem, PushResult

from pscluster.errors import DeadlineExceededError, InvalidArgumentError

MODES = ("async", "sync", "bounded")
# A bounded-mode worker that took no token for this long (it has no closure to run: the queue drained
# towards the others) no longer holds the others back.
WORKER_LEASE_S = 2.0


@dataclass
class Accumulator:
    """Gradients of one shard for its current step."""

    step: int
    count: int = 0
    dense: np.ndarray | None = None
    rows: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    contributors: set[str] = field(default_factory=set)
    earlier: frozenset[str] = frozenset()  # who made the previous step (a repeat of theirs is not stale)
    poisoned: bool = False  # a contributor's gradient was not finite: the step is skipped here
    lock: threading.Lock = field(default_factory=threading.Lock)


class SyncReplicas:
    """Sync/bounded state of one PS task (token queue and clocks are used on PS 0)."""

    def __init__(self, core: ParameterServerCore, clock: Any = time.monotonic) -> None:
        self.core = core
        self.mode = "async"
        self.replicas_to_aggregate = 1
        self.total_num_replicas = 1
        self.staleness = 0
        self.dropped = 0
        self.skipped = 0  # shard updates skipped: a replica of their step had a non-finite gradient
        self.max_spread = 0
        self._clock = clock
        self._cond = threading.Condition()
        self._acc: dict[tuple[str, int], Accumulator] = {}
        # shard -> (its last step settled, the version that step left): one entry per shard
        self._settled: dict[tuple[str, int], tuple[int, int]] = {}
        self._issued: dict[int, int] = {}
        self._tokens: dict[int, tuple[int, int]] = {}
        self._done: dict[int, set[int]] = {}
        self.clocks: dict[str, int] = {}  # bounded: steps completed per worker
        self.started: dict[str, int] = {}  # bounded: steps begun per worker
        self._last_seen: dict[str, float] = {}

    @property
    def accumulates(self) -> bool:
        """True when pushes go to accumulators rather than straight to the optimizer."""
        return self.mode == "sync"

    @property
    def global_step(self) -> int:
        """G (mirrors the core's global step)."""
        return self.core.global_step

    def configure(self, mode: str, replicas_to_aggregate: int, total_num_replicas: int, staleness: int) -> int:
        """Switch mode; returns G. Partial accumulations are discarded."""
        if mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "sync" and not 1 <= replicas_to_aggregate <= total_num_replicas:
            raise InvalidArgumentError(
                f"need 1 <= replicas_to_aggregate ({replicas_to_aggregate}) <= total_num_replicas "
                f"({total_num_replicas})")
        if mode == "bounded" and staleness < 0:
            raise InvalidArgumentError(f"staleness must be >= 0, got {staleness}")
        with self._cond:
            self.mode = mode
            self.replicas_to_aggregate = max(1, replicas_to_aggregate)
            self.total_num_replicas = max(self.replicas_to_aggregate, total_num_replicas)
            self.staleness = staleness
            self._acc.clear()
            self._settled.clear()
            self._issued.clear()
            self._tokens.clear()
            self._done.clear()
            self._cond.notify_all()
            return self.core.global_step

    # -- shards (every PS) -----------------------------------------------------------------------
    def push(self, push_id: str, step: int, items: Sequence[PushItem]) -> list[PushResult]:
        """Accumulate a push tagged with `step`; apply the average of a shard's R-th gradient."""
        checked = self.core.store.validate_push(items)
        return [self._accumulate(shard, item, local, push_id, step) for shard, item, local in checked]

    def skip(self, push_id: str, step: int, shards: Sequence[Any]) -> list[PushResult]:
        """A replica whose gradient of `step` was not finite: it counts towards each shard's R
        contributions (so the step completes and the token queue moves on, exactly as if it had
        pushed) and that step's update is skipped on the shard: value, slots and version unchanged.

        Every replica that reports StepDone has pushed or skipped on every shard of the step, so
        with total_num_replicas == replicas_to_aggregate a skipped step is skipped on every shard.
        With backups, each shard averages the first R contributions it gets (as for gradients), so
        a backup's gradient may complete a shard's step before the skip arrives there.
        """
        return [self._accumulate(shard, None, None, push_id, step) for shard in shards]

    def _accumulate(self, shard: Any, item: PushItem | None, local: np.ndarray | None, push_id: str,
                    step: int) -> PushResult:
        key = shard.spec.key
        with self._cond:
            acc = self._acc.get(key)
            if acc is None or step > acc.step:  # first push of this shard, or a restore left it behind
                acc = self._acc[key] = Accumulator(step)
        with acc.lock:
            current = acc is self._acc.get(key)
            if step < acc.step or not current:
                # a repeat of a push the step already counted (a client's retry after its reply was lost)
                # is not a stale gradient: only a contribution no step took is dropped
                counted = acc.contributors if not current and step == acc.step else \
                    acc.earlier if step == acc.step - 1 else frozenset()
                if push_id not in counted:
                    with self._cond:
                        self.dropped += 1
                return PushResult(shard.version, False)
            if push_id in acc.contributors:
                return PushResult(shard.version, False)
            acc.contributors.add(push_id)
            if item is None:
                acc.poisoned = True
            elif local is None:
                acc.dense = item.grad.copy() if acc.dense is None else acc.dense + item.grad
            else:
                acc.rows.append((local, item.grad.copy()))
            acc.count += 1
            if acc.count < self.replicas_to_aggregate:
                return PushResult(shard.version, True)
            r = shard.value.dtype.type(self.replicas_to_aggregate)
            step_key = push_key(f"sync:{acc.step}")
            if acc.poisoned:
                result = PushResult(shard.version, False, shard.version)
                with self._cond:
                    self.skipped += 1
            elif acc.dense is not None:
                result = self.core.store.apply(shard, acc.dense / r, None, step_key)
            else:
                ids = np.concatenate([i for i, _ in acc.rows])
                grads = np.concatenate([g for _, g in acc.rows]) / r
                result = self.core.store.apply(shard, grads, ids, step_key)
            with self._cond:
                self._acc[key] = Accumulator(acc.step + 1, earlier=frozenset(acc.contributors))
                self._settled[key] = (acc.step, shard.version)
                self._cond.notify_all()
            return result

    def settled(self, key: tuple[str, int], step: int, timeout: float) -> int:
        """The version shard `key` holds once `step` settled there (applied: its new version; skipped: the
        version it had), waiting up to timeout for the step's last contribution; on timeout, the version
        an applied step would make (the caller's wait for the backup then times out and says so)."""
        with self._cond:
            shard = self.core.store.get(key)
            done = self._cond.wait_for(lambda: self._settled.get(key, (-1, 0))[0] >= step, timeout)
            last, version = self._settled.get(key, (-1, 0))
            if not done:
                return shard.version + 1
            return version if last == step else shard.version

    # -- token queue and clocks (PS 0) -----------------------------------------------------------
    def take_token(self, closure_id: int, worker: str, timeout: float) -> tuple[int, int]:
        """(step, replica) for a closure; blocks while the step's tokens are out (sync) or the worker
        is too far ahead (bounded).

        Raises:
            DeadlineExceededError: no token within timeout (the closure is handed back and rescheduled).
        """
        with self._cond:
            if self.mode == "sync":
                return self._sync_token(closure_id, timeout)
            if self.mode == "bounded":
                return self._bounded_token(closure_id, worker, timeout)
            return self.core.global_step, 0

    def _sync_token(self, closure_id: int, timeout: float) -> tuple[int, int]:
        held = self._tokens.get(closure_id)
        if held is not None and held[0] == self.core.global_step:
            return held
        if not self._cond.wait_for(lambda: self._issued.get(self.core.global_step, 0) < self.total_num_replicas,
                                   timeout):
            g = self.core.global_step
            raise DeadlineExceededError(
                f"no sync token for step {g} within {timeout:.1f} s: all {self.total_num_replicas} are out and "
                f"{len(self._done.get(g, ()))} of {self.replicas_to_aggregate} replicas reported")
        g = self.core.global_step
        replica = self._issued.get(g, 0)
        self._issued[g] = replica + 1
        self._tokens[closure_id] = (g, replica)
        return g, replica

    def _min_clock(self, now: float) -> int:
        live = [c for w, c in self.clocks.items() if now - self._last_seen.get(w, now) <= WORKER_LEASE_S]
        return min(live) if live else 0

    def _bounded_token(self, closure_id: int, worker: str, timeout: float) -> tuple[int, int]:
        # ps-lite's bounded delay: a worker may start its step t only once every live worker has
        # completed step t - staleness; `started` counts steps begun (closures in flight included),
        # `clocks` steps completed.
        held = self._tokens.get(closure_id)
        if held is not None:
            return held
        now = self._clock()
        if worker not in self.clocks:
            self.clocks[worker] = self.started[worker] = self._min_clock(now)  # a newcomer starts level
        self._last_seen[worker] = now

        def admitted() -> bool:
            return self.started[worker] - self._min_clock(self._clock()) <= self.staleness

        deadline = time.monotonic() + timeout  # real time: the injected clock only ages leases
        while not admitted():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._cond.wait(min(remaining, 0.05))  # leases expire without a notify: look again soon
        if not admitted():
            raise DeadlineExceededError(
                f"worker {worker} is {self.started[worker] - self._min_clock(self._clock())} steps ahead of the "
                f"slowest (staleness {self.staleness}) after waiting {timeout:.1f} s")
        step = self.started[worker]
        self.started[worker] = step + 1
        self._tokens[closure_id] = (step, 0)
        self._last_seen[worker] = self._clock()
        self.max_spread = max(self.max_spread, step - self._min_clock(self._clock()))
        return step, 0

    def step_done(self, closure_id: int, step: int, worker: str) -> None:
        """A closure finished the pushes of its step; maybe advance G and release tokens."""
        with self._cond:
            if self.mode == "sync":
                if step != self.core.global_step:
                    return  # a backup's report for a step that already advanced
                done = self._done.setdefault(step, set())
                done.add(closure_id)
                if len(done) >= self.replicas_to_aggregate:
                    self.core.global_step = step + 1
                    for old in [s for s in self._done if s <= step]:
                        del self._done[old]
                    for old in [s for s in self._issued if s < step]:
                        del self._issued[old]
                    self._tokens = {c: t for c, t in self._tokens.items() if t[0] >= step}
                    self._cond.notify_all()
            else:
                if self.mode == "bounded" and worker:
                    self.clocks[worker] = self.clocks.get(worker, 0) + 1
                    self._last_seen[worker] = self._clock()
                    self._tokens.pop(closure_id, None)
                self.core.global_step += 1
                self._cond.notify_all()

    # -- checkpoints -----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint keeps of the sync state."""
        with self._cond:
            return {"mode": self.mode, "R": self.replicas_to_aggregate, "N": self.total_num_replicas,
                    "staleness": self.staleness, "dropped": self.dropped}

    def restore(self, saved: Any, step: int) -> None:
        """Reinstate a snapshot; partial accumulations were not saved and start over at `step`."""
        if isinstance(saved, dict) and saved.get("mode") in MODES:
            self.configure(saved["mode"], int(saved["R"]), int(saved["N"]), int(saved["staleness"]))
            self.dropped = int(saved.get("dropped", 0))
        self.core.global_step = step


def attach(core: ParameterServerCore) -> SyncReplicas:
    """Install sync-replica state on a PS core."""
    sync = core.sync = SyncReplicas(core)
    return sync
