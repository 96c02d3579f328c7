"""Where each shard's primary is with replicas: 2, as the PS tasks last said; pull and push plans follow it.

A variable's handle places shard k on PS `ordinal mod P` (pscluster/placement.py), which is where the
replica table puts every primary at first. After a failover the coordinator's table moves some primaries;
every PS holds the whole table, so a client that meets an unavailable PS (or one that says it is not the
primary) asks the live ones (GetRoles), keeps the newest table it gets, and sends each plan item to its
shard's primary from then on. Nothing changes while no shard moved: a plan is rerouted only when some
item's primary differs from its handle's PS.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from pscluster.errors import UnavailableError
from pscluster.proto import pscluster_pb2 as pb

log = logging.getLogger(__name__)

Key = tuple[str, int]
Item = TypeVar("Item", pb.PullItem, pb.PushItem)


RETRY_CAP_S = 0.5  # the longest back-off between a client's retries
# with replicas: 2, between retries that look for a promoted primary: a failover takes ~0.1 s after a
# kill, ~0.4 s after a SIGSTOP; a longer back-off would be most of the failover time (B15: doubling from
# 20 ms put the retry that found the new primary 300 ms after the first failure)
ROUTED_RETRY_CAP_S = 0.05
GRACE_S = 0.05  # a table refresh waits this long past the first answer for the other PS tasks'


def retry_wait(backoff: float, moved: bool, routed: bool) -> tuple[float, float]:
    """(the sleep before a retry, the back-off after it) given the current back-off; moved: the replica
    table just got newer (the retry goes at once to the new primary); routed: the client follows one."""
    if moved:
        return 0.0, backoff
    return backoff, min(backoff * 2, ROUTED_RETRY_CAP_S if routed else RETRY_CAP_S)


class Routes:
    """The newest replica table a client has seen: shard key -> primary PS index."""

    def __init__(self, stubs: Callable[[], Sequence[Any]], timeout: float = 1.0,
                 on_ps_list: Callable[[list[str]], None] | None = None) -> None:
        """on_ps_list: told the coordinator's PS list when a newer table brings a newer one (a PS joined)."""
        self._stubs = stubs
        self._timeout = timeout
        self._on_ps_list = on_ps_list
        self._lock = threading.Lock()
        self.version = 0
        self.ps_epoch = 0
        self.primary: dict[Key, int] = {}
        self.drained: frozenset[int] = frozenset()  # PS tasks a scale drained: new shards go elsewhere
        # PS tasks holding some copy (primary or backup): a PS marked down holds none once the table moved on
        self.holders: frozenset[int] = frozenset()
        self.live: frozenset[int] = frozenset()  # PS tasks that answered the last refresh with a table

    def refresh(self) -> bool:
        """Ask every PS for its table (in parallel, bounded); keep the newest. True if it was newer.

        A PS that does not answer (SIGSTOPped) delays this by GRACE_S past the first answer, not the timeout.
        """
        futures = [stub.GetRoles.future(pb.GetRolesRequest(), timeout=self._timeout) for stub in self._stubs()]
        task_of = {id(fut): ps for ps, fut in enumerate(futures)}
        live: set[int] = set()
        done: list[Any] = []
        cond = threading.Condition()

        def finished(fut: Any) -> None:
            with cond:
                done.append(fut)
                cond.notify()

        for fut in futures:
            fut.add_done_callback(finished)
        newest: pb.SetRolesRequest | None = None
        deadline = time.monotonic() + self._timeout
        seen = 0
        with cond:
            while seen < len(futures):
                if seen == len(done):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    cond.wait(left)
                    continue
                fut = done[seen]
                seen += 1
                try:
                    table = fut.result()
                except grpc.RpcError:
                    continue  # that PS is down or restarting: another one knows
                live.add(task_of[id(fut)])
                if newest is None:
                    deadline = min(deadline, time.monotonic() + GRACE_S)  # the other live PS answer about now
                if newest is None or table.version > newest.version:
                    newest = table
            answered = set(map(id, done))
        for fut in futures:
            if id(fut) not in answered:
                fut.cancel()
        with self._lock:
            self.live = frozenset(live)
            if newest is None or newest.version <= self.version:
                return False
            grown = newest.ps_epoch > self.ps_epoch and len(newest.ps_addresses) > 0
            self.ps_epoch = max(self.ps_epoch, newest.ps_epoch)
        if grown and self._on_ps_list is not None:  # channels to a PS that joined before routing to it
            self._on_ps_list(list(newest.ps_addresses))
        with self._lock:
            if newest.version <= self.version:
                return False
            self.version = newest.version
            self.primary = {(r.ref.variable, r.ref.shard_index): r.primary for r in newest.roles}
            self.drained = frozenset(newest.drained)
            self.holders = frozenset({r.primary for r in newest.roles} | {r.backup for r in newest.roles if r.backup >= 0})
        log.info("replica table version %d: %d shards", newest.version, len(newest.roles))
        return True

    def moved_off(self, ps: int, request: pb.BulkRequest | pb.PushRequest | pb.PullRequest) -> bool:
        """Whether a newer table (asked now) puts some shard of a pull or push sent to PS ps elsewhere: a call
        still waiting on ps (SIGSTOPped) is given up and retried there."""
        if isinstance(request, pb.BulkRequest):
            items: Sequence[Any] = request.push.items if request.HasField("push") else \
                request.pull.items if request.HasField("pull") else ()
        else:
            items = request.items
        if not items:
            return False  # a token or step call: PS 0's, no shard's
        self.refresh()
        primary = self.primary
        return any(primary.get((i.ref.variable, i.ref.shard_index), ps) != ps for i in items)

    def route(self, plan: dict[int, list[tuple[Item, Any]]], targets: dict[int, list[Any]] | None = None
              ) -> tuple[dict[int, list[tuple[Item, Any]]], dict[int, list[Any]] | None]:
        """plan (and the fused-reply targets aligned with it) with each item under its shard's primary.

        Raises:
            UnavailableError: an item would go to a PS that left the PS list (retryable: the caller re-reads
                the table, which names the shard's primary now).
        """
        primary = self.primary
        if not primary or all(primary.get((item.ref.variable, item.ref.shard_index), ps) == ps
                              for ps, items in plan.items() for item, _ in items):
            self._check_listed(plan)
            return plan, targets
        moved: dict[int, list[tuple[Item, Any]]] = defaultdict(list)
        moved_targets: dict[int, list[Any]] = defaultdict(list)
        for ps, items in plan.items():
            aligned = targets.get(ps) if targets is not None else None
            for i, (item, arr) in enumerate(items):
                dest = primary.get((item.ref.variable, item.ref.shard_index), ps)
                moved[dest].append((item, arr))
                if aligned is not None:
                    moved_targets[dest].append(aligned[i])
        self._check_listed(moved)
        return moved, (moved_targets if targets is not None else None)

    def _check_listed(self, plan: dict[int, Any]) -> None:
        count = len(self._stubs())
        gone = sorted(ps for ps in plan if ps >= count)
        if gone:
            raise UnavailableError(f"ps {gone[0]} left the PS list ({count} PS tasks now); re-reading where its "
                                   "shards are")
