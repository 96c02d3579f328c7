"""Synchronous and bounded-staleness updates (TF1's SyncReplicasOptimizer; ps-lite's bounded delay).

sync: PS 0 keeps the global step G and a token queue of N (`total_num_replicas`) tokens per step.
A closure takes a token (G, replica) before its first pull and tags its pushes with G. Every shard
accumulates the gradients tagged with its current step; when R (`replicas_to_aggregate`) have
arrived it applies their average once and moves to the next step; a gradient tagged with an older
step is stale: dropped and counted (a repeat of a push its step counted is dropped, not counted). A
closure that finished its pushes reports StepDone(G); after R reports G advances and the tokens of
the next step are released. Every reporting closure has pushed to every shard, so R reports mean
every shard has seen R gradients of the step: no shard can be left behind, and no step waits for
backups (N > R) or for a dead token holder, whose closure is rescheduled with the same id and gets
its token back.

bounded: pushes apply on arrival (async), but a worker may start a step only while its clock is at
most `staleness` steps ahead of the slowest live worker; the widest spread ever admitted is kept
for inspection.

The token queue and the clocks are the pure state machine of sync_tokens.py; `SyncReplicas` is its
executor (the condition variable, the waiting, G on the core) and keeps the shards' accumulators.

replicas: 2: the token queue, the clocks and G have a primary (PS 0 at first) and a backup in the replica
table, under SYNC_STATE_KEY. Only the primary answers TakeToken and StepDone (others: UNAVAILABLE, the
client re-reads the table); after each change it forwards the whole state (sync_tokens.to_wire) on the
replication stream and a take's reply waits until the backup holds it, as a push's reply does (a report's does
not: sync_state.py). A promoted backup
goes on from the newest state it holds: a closure's retried take gets its token back (`tokens`), a retried
report counts once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

import numpy as np
from pscluster.server import sync_tokens as tok
from pscluster.server.dynamic_table import sum_duplicates
from pscluster.server.ps import ParameterServerCore
from pscluster.server.push_record import PushKey, push_key
from pscluster.server.replica_notes import SkipNote
from pscluster.server.store import PushItem, PushResult, Shard
from pscluster.server.sync_state import SyncStateCopies

from pscluster.errors import DeadlineExceededError, InvalidArgumentError, ResourceExhaustedError, UnavailableError
from pscluster.placement import SYNC_STATE_KEY

if TYPE_CHECKING:
    from pscluster.server.replication import Replication

MODES = tok.MODES
WORKER_LEASE_S = tok.WORKER_LEASE_S


class SyncSnapshot(TypedDict):
    """What a checkpoint keeps of the sync state (the header's JSON spells R and N so)."""

    mode: tok.Mode
    R: int
    N: int
    staleness: int
    dropped: int


@dataclass
class Accumulator:
    """Gradients of one shard for its current step."""

    step: int
    count: int = 0
    dense: np.ndarray | None = None
    rows: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    contributors: set[str] = field(default_factory=set)
    earlier: frozenset[str] = frozenset()  # who made the previous step (a repeat of theirs is not stale)
    skips: int = 0  # replicas whose gradient of this step was not finite (not counted in `count`)
    lock: threading.Lock = field(default_factory=threading.Lock)


class SyncReplicas(SyncStateCopies):
    """Sync/bounded state of one PS task (token queue and clocks are used on PS 0): the executor of
    sync_tokens.decide plus the shards' accumulators."""

    def __init__(self, core: ParameterServerCore, clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.dropped = 0
        self.skipped = 0  # shard updates skipped: a replica of their step had a non-finite gradient
        self._clock = clock  # ages bounded-mode leases; waiting deadlines are real time
        self._cond = threading.Condition()
        self._state = tok.TokenState()
        self._acc: dict[tuple[str, int], Accumulator] = {}
        # shard -> (its last step settled, the version that step left): one entry per shard
        self._settled: dict[tuple[str, int], tuple[int, int]] = {}
        # replicas: 2: shard -> (its last step skipped, the place of the note of it in the backup's queue):
        # a skipped step's replies wait for the note (one entry per shard)
        self._marks: dict[tuple[str, int], tuple[int, SkipNote | None]] = {}
        # replicas: 2: changes of the token state made here (primary) or the newest taken (backup): the
        # forwards' sequence; `_held`: (epoch, version) of the last forward taken as backup
        self.version = 0
        self._held = (0, 0)
        self._sent: tuple[int, str] | None = None
        self._sent_epoch = 0
        self._waiting: dict[int, tuple[str, tok.Mode]] = {}
        self._pregranted: dict[int, tuple[int, int]] = {}

    @property
    def mode(self) -> tok.Mode:
        """async, sync or bounded."""
        return self._state.mode

    @property
    def replicas_to_aggregate(self) -> int:
        """R: gradients averaged into one step (sync)."""
        return self._state.replicas_to_aggregate

    @property
    def total_num_replicas(self) -> int:
        """N: tokens per step (sync)."""
        return self._state.total_num_replicas

    @property
    def staleness(self) -> int:
        """How many steps a worker may run ahead of the slowest (bounded)."""
        return self._state.staleness

    @property
    def max_spread(self) -> int:
        """The widest spread ever admitted (bounded)."""
        return self._state.max_spread

    @property
    def clocks(self) -> dict[str, int]:
        """Steps completed per worker (bounded)."""
        return self._state.clocks

    @property
    def started(self) -> dict[str, int]:
        """Steps begun per worker (bounded)."""
        return self._state.started

    @property
    def accumulates(self) -> bool:
        """True when pushes go to accumulators rather than straight to the optimizer."""
        return self.mode == "sync"

    @property
    def global_step(self) -> int:
        """G (mirrors the core's global step)."""
        return self.core.global_step

    def configure(self, mode: str, replicas_to_aggregate: int, total_num_replicas: int, staleness: int) -> int:
        """Switch mode; returns G. Partial accumulations are discarded, unless nothing changes: then it is a
        no-op (a PS that add_ps configures again may hold the open step's acknowledged gradients)."""
        if mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "sync" and not 1 <= replicas_to_aggregate <= total_num_replicas:
            raise InvalidArgumentError(
                f"need 1 <= replicas_to_aggregate ({replicas_to_aggregate}) <= total_num_replicas "
                f"({total_num_replicas})")
        if mode == "bounded" and staleness < 0:
            raise InvalidArgumentError(f"staleness must be >= 0, got {staleness}")
        checked: tok.Mode = "sync" if mode == "sync" else "bounded" if mode == "bounded" else "async"
        event = tok.Configure(checked, replicas_to_aggregate, total_num_replicas, staleness)
        replication = self._replication()
        with self._cond:
            state = self._state
            r = max(1, replicas_to_aggregate)
            if (state.mode, state.replicas_to_aggregate, state.total_num_replicas, state.staleness) == \
                    (checked, r, max(r, total_num_replicas), staleness):
                return self.core.global_step
            self._acc.clear()
            self._settled.clear()
            self._marks.clear()
            if replication is not None and replication.is_backup(SYNC_STATE_KEY):
                tok.reconfigure(self._state, event)  # the token maps come from the primary's forwards
                return self.core.global_step
            self._perform(tok.decide(self._state, event, self._clock()))
            version = self._changed(replication)
            step = self.core.global_step
        self._replicated(replication, version)
        return step

    def _perform(self, actions: list[tok.Action]) -> None:
        # under self._cond
        for action in actions:
            if isinstance(action, tok.Advance):
                self.core.global_step = action.global_step
            if isinstance(action, (tok.Advance, tok.WakeWaiters)):
                self._cond.notify_all()

    # -- shards (every PS) -----------------------------------------------------------------------
    def push(self, push_id: str, step: int, items: Sequence[PushItem]) -> list[PushResult]:
        """Accumulate a push tagged with `step`; apply the average of a shard's R-th gradient."""
        checked = self.core.store.validate_push(items)
        return [self._accumulate(shard, item, local, push_id, step) for shard, item, local in checked]

    def skip(self, push_id: str, step: int, shards: Sequence[Shard]) -> list[PushResult]:
        """A replica whose gradient of `step` was not finite. The step is skipped (value, slots and version
        unchanged) on a shard once more than N - R replicas skipped it (N total_num_replicas, R
        replicas_to_aggregate) and R replicas reported; otherwise its R-th finite gradient applies it.

        The rule is step-wide whatever the arrival order: a replica skips on every shard of the step or
        pushes to all of them, so more than N - R skips leave every shard fewer than R finite gradients
        (none can apply), and at most N - R let none of them skip. With N == R a single skip skips the
        step once every replica reported; with backups (N > R) a skip is a backup's missing gradient.
        """
        return [self._accumulate(shard, None, None, push_id, step) for shard in shards]

    def _accumulate(self, shard: Shard, item: PushItem | None, local: np.ndarray | None, push_id: str,
                    step: int) -> PushResult:
        try:
            return self._accumulate_one(shard, item, local, push_id, step)
        finally:  # the push that settled a skipped step (told or refused) waits for its note as well
            self._await_mark(shard.spec.key, step)

    def _await_mark(self, key: tuple[str, int], step: int) -> None:
        """With replicas: 2, return once the backup holds the note of `step` if it was skipped on this shard: a
        promoted backup then knows the step settled, and a replica's retry of it returns at once there."""
        with self._cond:
            skipped, note = self._marks.get(key, (-1, None))
        replication = self._replication()
        if skipped == step and note is not None and replication is not None:
            replication.wait_skipped(key, note, replication.timeout)

    def _note_skip(self, shard: Shard, step_key: PushKey) -> SkipNote | None:
        """Note a skipped step in the shard's push record and queue the note for its backup (its queue place)."""
        replication = self._replication()
        with shard.lock:
            shard.record.add_key(step_key, shard.version)
            note: SkipNote | None = replication.skipped(shard, step_key) if replication is not None else None
            return note

    def _accumulate_one(self, shard: Shard, item: PushItem | None, local: np.ndarray | None, push_id: str,
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
            if not acc.contributors and self._settled_before(shard, step):
                # a promoted backup: the old primary applied this step and replicated it, then died before
                # every reply went out. The retry is a repeat; opening the step again here would wait for
                # gradients no replica will send
                with self._cond:
                    if self._acc.get(key) is acc:
                        self._acc[key] = Accumulator(step + 1)
                        self._settled[key] = (step, shard.version)
                        self._cond.notify_all()
                return PushResult(shard.version, False)
            acc.contributors.add(push_id)
            if item is None:
                acc.skips += 1
            else:
                acc.count += 1
                if local is None:
                    acc.dense = item.grad.copy() if acc.dense is None else acc.dense + item.grad
                else:
                    acc.rows.append((local, item.grad.copy()))
            need = self.replicas_to_aggregate
            skipped = acc.skips > self.total_num_replicas - need and acc.count + acc.skips >= need
            if acc.count < need and not skipped:
                return PushResult(shard.version, True)
            r = shard.value.dtype.type(need)
            step_key = push_key(f"sync:{acc.step}")
            refused: ResourceExhaustedError | None = None
            mark: SkipNote | None = None  # a skipped step's note in the backup's queue
            skip = False
            if acc.count < need:  # skipped
                result = PushResult(shard.version, False, shard.version)
                mark, skip = self._note_skip(shard, step_key), True
                with self._cond:
                    self.skipped += 1
            elif acc.dense is not None:
                result = self.core.store.apply(shard, acc.dense / r, None, step_key)
            else:
                ids = np.concatenate([i for i, _ in acc.rows])
                grads = np.concatenate([g for _, g in acc.rows]) / r
                if shard.table is not None:
                    # one occurrence per key and step, however many replicas' batches carry it: a step is one
                    # update, so admission and LFU count steps (summed as the table would: same bits)
                    ids, _, grads = sum_duplicates(ids, grads)
                try:
                    result = self.core.store.apply(shard, grads, ids, step_key)
                except ResourceExhaustedError as exc:
                    # the step's new keys do not fit this table shard (nothing changed): the step is skipped
                    # here, and still settles, so no replica waits for it; the replica whose push completed
                    # it is told why
                    refused = exc
                    result = PushResult(shard.version, False, shard.version)
                    mark, skip = self._note_skip(shard, step_key), True
                    with self._cond:
                        self.skipped += 1
            with self._cond:
                self._acc[key] = Accumulator(acc.step + 1, earlier=frozenset(acc.contributors))
                self._settled[key] = (acc.step, shard.version)
                if skip:
                    self._marks[key] = (acc.step, mark)
                self._cond.notify_all()
            if refused is not None:
                raise refused
            return result

    @staticmethod
    def _settled_before(shard: Shard, step: int) -> bool:
        """True if the shard's push record holds `step`'s aggregated update (applied here or replicated here)."""
        with shard.lock:
            return shard.record.seen_key(push_key(f"sync:{step}"))

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
            if last != step:
                return int(shard.version)
        self._await_mark(key, step)
        return version

    # -- token queue and clocks (PS 0) -----------------------------------------------------------
    def take_token(self, closure_id: int, worker: str, timeout: float,
                   reports: Sequence[tuple[int, int, str]] = ()) -> tuple[int, int]:
        """(step, replica) for a closure; blocks while the step's tokens are out (sync) or the worker
        is too far ahead (bounded). `reports`, (closure id, step, worker) of earlier closures' StepDones, count
        first, in the same change as the take (one forward to the backup; a retry counts each once).

        Raises:
            DeadlineExceededError: no token within timeout (the closure is handed back and rescheduled).
        """
        replication = self._replication()
        self._check_holder(replication)
        with self._admitted(replication):
            return self._take_token(replication, closure_id, worker, timeout, reports)

    def _take_token(self, replication: Replication | None, closure_id: int, worker: str, timeout: float,
                    reports: Sequence[tuple[int, int, str]] = ()) -> tuple[int, int]:
        with self._cond:
            for report in reports:
                self._report(replication, *report)
            mode = self._state.mode  # a wait keeps the rules it began with
            event: tok.TakeToken | tok.RetryToken = tok.TakeToken(closure_id, worker, self.core.global_step)
            deadline = time.monotonic() + timeout
            while True:
                [answer] = tok.decide(self._state, event, self._clock())
                if isinstance(answer, tok.Grant):
                    granted, version = answer, self._changed(replication)
                    break
                if not isinstance(answer, (tok.AwaitTokens, tok.AwaitSlowest)):
                    raise AssertionError(f"a take was answered with {answer}")  # decide's contract
                if isinstance(event, tok.TakeToken):
                    self._changed(replication)  # a bounded newcomer's clock, a worker's last take
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceededError(answer.refusal(timeout))
                if replication is not None and self.core.gate.is_frozen(SYNC_STATE_KEY):
                    # the queue moves to another PS (elastic.py): a waiter would hold the freeze, while the
                    # StepDone calls that release its tokens are refused; it retries there (same closure id).
                    # Checked under self._cond before each wait: the freeze's wake-up cannot slip in between.
                    raise UnavailableError(f"the sync token queue is moving off ps {self.core.ps_index}; retry "
                                           "(placement changes within milliseconds)")
                self._waiting[closure_id] = (worker, mode)
                self._cond.wait(remaining if answer.poll is None else min(remaining, answer.poll))
                self._waiting.pop(closure_id, None)
                pre = self._pregranted.pop(closure_id, None)
                if pre is not None:  # a report decided it (`_grant_waiting`): its forward holds the grant
                    granted, version = tok.Grant(closure_id, *pre), self.version
                    break
                if replication is not None and not replication.is_primary(SYNC_STATE_KEY):
                    raise UnavailableError(f"ps {self.core.ps_index} no longer holds the sync token queue; "
                                           "re-read placement and take the token there (same closure id)")
                event = tok.RetryToken(closure_id, worker, self.core.global_step, mode)
        self._replicated(replication, version)
        return granted.step, granted.replica

    def step_done(self, closure_id: int, step: int, worker: str) -> tuple[int, int]:
        """A closure finished the pushes of its step; maybe advance G and release tokens.

        Returns (epoch, version) of the sync state that counted the report, (0, 0) with one copy. With replicas: 2
        the reply does not wait for the backup to hold it (sync_state.py): the caller keeps the pair, and the
        coordinator sends the report again if the state moves to a new primary before the backup confirmed it."""
        replication = self._replication()
        self._check_holder(replication)
        with self._admitted(replication):
            with self._cond:
                self._report(replication, closure_id, step, worker)
                version = self._changed(replication, waited=False)
                epoch = self._sent_epoch
        if replication is None:
            return 0, 0
        if not epoch:  # deposed during the call: counted here only; the client retries on the new primary
            raise UnavailableError(f"ps {self.core.ps_index} no longer holds the sync token queue; re-read placement "
                                   "and report there (same closure id: it counts once)")
        return epoch, version

    def _report(self, replication: Replication | None, closure_id: int, step: int, worker: str) -> None:
        """Under self._cond: count a StepDone (its forward is the caller's `_changed`)."""
        self._perform(tok.decide(self._state, tok.StepDone(closure_id, step, worker, self.core.global_step),
                                 self._clock()))
        self._grant_waiting(replication)

    # -- checkpoints -----------------------------------------------------------------------------
    def snapshot(self) -> SyncSnapshot:
        """What a checkpoint keeps of the sync state."""
        with self._cond:
            return SyncSnapshot(mode=self.mode, R=self.replicas_to_aggregate, N=self.total_num_replicas,
                                staleness=self.staleness, dropped=self.dropped)

    def restore(self, saved: object, step: int) -> None:
        """Reinstate a snapshot read back from a checkpoint header (JSON, so checked here); partial
        accumulations were not saved and start over at `step`."""
        if isinstance(saved, dict) and saved.get("mode") in MODES:
            self.configure(saved["mode"], int(saved["R"]), int(saved["N"]), int(saved["staleness"]))
            self.dropped = int(saved.get("dropped", 0))
        self.core.global_step = step


def attach(core: ParameterServerCore) -> SyncReplicas:
    """Install sync-replica state on a PS core."""
    sync = core.sync = SyncReplicas(core)
    return sync
