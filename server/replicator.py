"""The primary's side of PS-to-PS replication: one `Replicator` per backup PS (see server/replication.py).

It owns a queue of forwards (filled under shard locks, in apply order) and a named thread that sends them
in batches, one Replicate call with a deadline each; a batch that fails is sent again (the backup ignores
versions it holds). Past MAX_QUEUED_BYTES a shard's updates are skipped and its whole state is sent
instead, as for a backup that answers GAP. `wait` blocks a push's reply until its versions are confirmed.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server.store import Key

from pscluster.errors import UnavailableError

log = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 256 << 20  # per backup; past it a shard's whole state is sent instead of its updates
BATCH_BYTES = 16 << 20  # forwards per Replicate call (an install may exceed it alone)
# a queued forward: shard, the version it made, its message (tensors: dtype and shape), bytes, its arrays
Item = tuple[Key, int, pb.ReplicaForward, int, list[np.ndarray]]


class ReplicaLink(Protocol):
    """The Replicate call to one backup PS (server/replica_links.py; tests may pass a core's `receive`)."""

    def replicate(self, request: pb.ReplicateRequest, arrays: Sequence[np.ndarray],
                  timeout: float) -> pb.ReplicateReply:
        """Send one batch (tensors carry dtype and shape; their bytes are arrays, in `tensors_of` order);
        raise a PsclusterError when it did not get through."""

    def close(self) -> None:
        """Release the connection."""


def name_of(key: Key) -> str:
    """`variable[shard]`, as messages name a shard."""
    return f"{key[0]}[{key[1]}]"


class Replicator:
    """Sends one backup PS its forwards; owns the queue and the `replicate-<ps>-to-<backup>` thread."""

    def __init__(self, backup: int, link: ReplicaLink, from_ps: int, timeout: float,
                 resync: Callable[[Key], None], max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        self.backup = backup
        self._link = link
        self._from_ps = from_ps
        self._timeout = timeout
        self._resync = resync  # queue a shard's whole state (takes the shard's lock: never called under ours)
        self._max_queued = max_queued_bytes
        self._cond = threading.Condition()
        self._queue: collections.deque[Item] = collections.deque()
        self._queued_bytes = 0
        self._dirty: set[Key] = set()  # shards whose forwards were skipped (queue full): resync them
        self.acked: dict[Key, int] = {}  # the highest version the backup confirmed, per shard
        self.stale: dict[Key, int] = {}  # shards the backup refused: it knows a newer epoch
        self.keys: set[Key] = set()  # shards this replicator serves now (the hub's roles)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"replicate-{from_ps}-to-{backup}", daemon=True)
        self._thread.start()

    def put(self, key: Key, version: int, msg: pb.ReplicaForward, arrays: list[np.ndarray]) -> None:
        """Queue a forward and its arrays, owned from now on (called under the shard's lock: never waits)."""
        nbytes = sum([a.nbytes for a in arrays])
        with self._cond:
            if key in self._dirty and not msg.HasField("spec"):
                return  # its whole state is on the way; it includes this update
            if self._queued_bytes + nbytes > self._max_queued and self._queue:
                self._dirty.add(key)
            else:
                if msg.HasField("spec"):
                    self._dirty.discard(key)
                self._queue.append((key, version, msg, nbytes, arrays))
                self._queued_bytes += nbytes
            self._cond.notify_all()

    def wait(self, key: Key, version: int, deadline: float) -> bool:
        """Block until the backup confirmed `version` of key; False when this replicator stopped serving key.

        Raises:
            UnavailableError: the backup knows a newer epoch (this PS is deposed), or the deadline passed.
        """
        with self._cond:
            while True:
                if key in self.stale:
                    raise UnavailableError(f"{name_of(key)}: backup ps {self.backup} knows epoch {self.stale[key]}, "
                                           "newer than this PS's: it is no longer the primary; re-read placement")
                if self.acked.get(key, -1) >= version:
                    return True
                if key not in self.keys or self._stop.is_set():
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise UnavailableError(f"{name_of(key)}: backup ps {self.backup} did not confirm version {version} "
                                           "in time; the push was not acknowledged (retry it with the same id)")
                self._cond.wait(left)

    def forget(self, key: Key) -> None:
        """Drop what the backup confirmed of key: its role changed, the next confirmation starts afresh."""
        with self._cond:
            self.acked.pop(key, None)
            self.stale.pop(key, None)

    def poke(self) -> None:
        """Wake waiters to look at the roles again."""
        with self._cond:
            self._cond.notify_all()

    def signal_stop(self) -> None:
        """Stop sending and wake every waiter (they look at the roles again); `stop` joins."""
        self._stop.set()
        self.poke()

    def stop(self) -> None:
        """Stop sending, wake every waiter, join the thread, close the link."""
        self.signal_stop()
        self._thread.join(timeout=self._timeout + 5)
        self._link.close()

    @property
    def finished(self) -> bool:
        """Whether the thread has ended (a signalled replicator may still be inside one bounded RPC)."""
        return not self._thread.is_alive()

    def _take(self) -> list[Item]:
        with self._cond:
            while not self._queue and not self._dirty and not self._stop.is_set():
                self._cond.wait()
            batch: list[Item] = []
            size = 0
            while self._queue and (not batch or size + self._queue[0][3] <= BATCH_BYTES):
                item = self._queue.popleft()
                batch.append(item)
                size += item[3]
            return batch

    def _loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            with self._cond:
                dirty, self._dirty = self._dirty, set()
            for key in sorted(dirty):
                self._resync(key)
            batch = self._take()
            if not batch:
                continue
            request = pb.ReplicateRequest(forwards=[item[2] for item in batch], from_ps=self._from_ps)
            try:
                reply = self._link.replicate(request, [a for item in batch for a in item[4]], self._timeout)
                if len(reply.outcomes) != len(batch) or len(reply.versions) != len(batch):
                    raise UnavailableError(f"backup ps {self.backup} answered {len(reply.outcomes)} outcomes for "
                                           f"{len(batch)} forwards")
            except Exception as exc:  # noqa: BLE001 - the thread must outlive any failure: resend, log, back off
                failures += 1
                if failures == 1 or failures % 50 == 0:
                    log.warning("replication to ps %d failed (%d in a row), resending: %s", self.backup, failures, exc)
                with self._cond:
                    self._queue.extendleft(reversed(batch))
                self._stop.wait(min(0.01 * 2 ** min(failures, 6), 0.5))
                continue
            failures = 0
            gaps: set[Key] = set()
            with self._cond:
                for (key, version, msg, nbytes, _), outcome in zip(batch, reply.outcomes):
                    self._queued_bytes -= nbytes
                    if outcome == pb.REPLICA_APPLIED:
                        if version > self.acked.get(key, -1):
                            self.acked[key] = version
                    elif outcome == pb.REPLICA_GAP:
                        gaps.add(key)
                    else:
                        self.stale[key] = msg.epoch
                self._cond.notify_all()
            for key in sorted(gaps):
                with self._cond:
                    self._dirty.add(key)
