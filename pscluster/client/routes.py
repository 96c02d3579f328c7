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
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from pscluster.proto import pscluster_pb2 as pb

log = logging.getLogger(__name__)

Key = tuple[str, int]
Item = TypeVar("Item", pb.PullItem, pb.PushItem)


class Routes:
    """The newest replica table a client has seen: shard key -> primary PS index."""

    def __init__(self, stubs: Callable[[], Sequence[Any]], timeout: float = 1.0) -> None:
        self._stubs = stubs
        self._timeout = timeout
        self._lock = threading.Lock()
        self.version = 0
        self.primary: dict[Key, int] = {}

    def refresh(self) -> bool:
        """Ask every PS for its table (in parallel, bounded); keep the newest. True if it was newer."""
        futures = [stub.GetRoles.future(pb.GetRolesRequest(), timeout=self._timeout) for stub in self._stubs()]
        newest: pb.SetRolesRequest | None = None
        for fut in futures:
            try:
                table = fut.result()
            except grpc.RpcError:
                continue  # that PS is down or restarting: another one knows
            if newest is None or table.version > newest.version:
                newest = table
        with self._lock:
            if newest is None or newest.version <= self.version:
                return False
            self.version = newest.version
            self.primary = {(r.ref.variable, r.ref.shard_index): r.primary for r in newest.roles}
        log.info("replica table version %d: %d shards", newest.version, len(newest.roles))
        return True

    def route(self, plan: dict[int, list[tuple[Item, Any]]], targets: dict[int, list[Any]] | None = None
              ) -> tuple[dict[int, list[tuple[Item, Any]]], dict[int, list[Any]] | None]:
        """plan (and the fused-reply targets aligned with it) with each item under its shard's primary."""
        primary = self.primary
        if not primary or all(primary.get((item.ref.variable, item.ref.shard_index), ps) == ps
                              for ps, items in plan.items() for item, _ in items):
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
        return moved, (moved_targets if targets is not None else None)
