"""The primary's side of PS-to-PS replication: one `Replicator` per backup PS (see server/replication.py).

It owns a queue of forwards (filled under shard locks, in apply order), sent in batches, one Replicate
call with a deadline each and one batch in flight at a time. Group commit: a push waiting for its
confirmation (`wait`) sends the batch itself when none is in flight (its forward and whatever queued
behind it), so the common path has no thread hop; the owned `replicate-<ps>-to-<backup>` thread sends
catch-ups, resends a failed batch after a back-off (the backup ignores versions it holds) and sends
forwards no push waits for. Past MAX_QUEUED_BYTES a shard's updates are skipped and its whole state is
sent instead, as for a backup that answers GAP; a whole state that does not fit waits (unsnapshotted) for a
batch to get through, except that one may always be queued (else a shard larger than the room never
catches up). A batch the backup refuses for good (a non-retryable error) is dropped: its updates' shards are
sent whole instead, and a refused whole state fails its shard's waiters until the roles change.
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

from pscluster.errors import PsclusterError, UnavailableError

log = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 256 << 20  # per backup; past it a shard's whole state is sent instead of its updates
BATCH_BYTES = 16 << 20  # forwards per Replicate call (an install may exceed it alone)
LINGER_S = 0.02  # forwards that no waiting push sent (it gave up) go after this long, by the thread
# with no such forward queued the thread sleeps this long: a push sends its own forward, so a thread woken every
# LINGER_S found nothing to do ~50 times a second (B15COST: ~1 wake-up per W2 step per PS, more than any but the
# connections' threads); a forward queued with no waiter on another path than these is sent within IDLE_S
IDLE_S = 0.5
LOG_EVERY_S = 30.0  # a backup that keeps failing is logged at its first failure, then at most this often
# a queued forward: shard, the version it made, its message (tensors: dtype and shape), bytes, its arrays,
# its place in the queue (1, 2, ...: `queued` when it was put), and a plain dense update's compact form
# (server/replica_wire.py; None for any other forward)
Item = tuple[Key, int, pb.ReplicaForward, int, list[np.ndarray], int, bytes | None]


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
                 resync: Callable[[Key, int], None], max_queued_bytes: int = MAX_QUEUED_BYTES,
                 batch_bytes: int = BATCH_BYTES) -> None:
        """batch_bytes: the forwards one batch groups (one forward alone may exceed it), within what one frame of
        the backup takes: a larger batch would be refused and its shards sent whole."""
        self.backup = backup
        self._batch_bytes = batch_bytes
        self._link = link
        # a link that carries dense batches in the compact form (FrameLink; not gRPC's, nor a test's receive)
        self._dense: Callable[[Sequence[bytes], Sequence[np.ndarray], float], tuple[list[int], list[int]]] | None = \
            getattr(link, "replicate_dense", None)
        self._from_ps = from_ps
        self._timeout = timeout
        # resync(key, start): queue a shard's whole state, or its chunk from row start (server/catch_up.py);
        # it takes the shard's lock: never called under ours
        self._resync = resync
        self._cursor: dict[Key, int] = {}  # a catch-up in chunks: the row its next chunk starts at
        self._due: dict[Key, int] = {}  # chunks to queue (their previous one was confirmed): key -> start row
        self._staging: set[Key] = set()  # its catch-up in chunks is under way: nothing of it counts as held yet
        self._max_queued = max_queued_bytes
        # held as `with self._mutex`: the same lock as the conditions', without Condition.__enter__/__exit__'s
        # two Python calls per use (five uses per replicated push)
        self._mutex = threading.Lock()
        lock = self._mutex
        self._cond = threading.Condition(lock)  # the sender waits here for forwards
        # pushes wait here for confirmations: a put wakes the sender alone, not every waiting push
        self._acks = threading.Condition(lock)
        self._queue: collections.deque[Item] = collections.deque()
        self._queued_bytes = 0
        self._dirty: set[Key] = set()  # shards whose forwards were skipped (queue full): resync them
        self._waiting: set[Key] = set()  # shards whose whole state found no room: resync after a batch got through
        self.refused: dict[Key, str] = {}  # shards whose whole state the backup refused for good (until forget)
        self._confirmed: dict[Key, int] = {}  # per shard, the place of its last config change, sweep or install applied
        self._logged = 0.0  # when a run of failures was last logged
        self.acked: dict[Key, int] = {}  # the highest version the backup confirmed, per shard
        self.stale: dict[Key, int] = {}  # shards the backup refused at this epoch: it knows a newer one
        self._epoch: dict[Key, int] = {}  # per shard, the epoch of its role when it was last (re)synced
        self.keys: set[Key] = set()  # shards this replicator serves now (the hub's roles)
        self.queued = 0  # forwards queued so far: the last one's place in the queue
        self._sending = False  # a batch is in flight (one at a time: the backup applies in order)
        self._failures = 0  # sends failed in a row (the thread resends after a back-off; pushes do not)
        self._wake = False  # the thread has work now: a catch-up, a resync, a resend
        # forwards that no push waits for are queued (a table pull's, or a waiter gave up): the thread lingers
        self._orphans = False
        self._idle = False  # the thread sleeps for IDLE_S (an orphan wakes it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"replicate-{from_ps}-to-{backup}", daemon=True)
        self._thread.start()

    @property
    def compact(self) -> bool:
        """Whether the link carries dense batches in the compact form (server/replica_wire.py): else a forward's
        compact bytes would never be sent, and are not built."""
        return self._dense is not None

    def put(self, key: Key, version: int, msg: pb.ReplicaForward, arrays: list[np.ndarray],
            wire: bytes | None = None, orphan: bool = False) -> int:
        """Queue a forward and its arrays, owned from now on (called under the shard's lock: never waits);
        wire: a plain dense update's compact form (msg's fields, server/replica_wire.py); orphan: no caller waits
        for it (the thread sends it, as a table pull's).

        Returns its place in the queue, or for a skipped one the place of the whole state sent instead (no
        earlier): a confirmation of key at that place or later holds it (`wait_config`)."""
        nbytes = sum([a.nbytes for a in arrays])
        install = msg.HasField("spec")
        with self._mutex:
            if (key in self._dirty or key in self._waiting) and not install:
                return self.queued + 1  # its whole state is on the way; it includes this update
            if key in self.refused:
                return self.queued + 1  # the backup refuses its state: nothing more of it until the roles change
            if msg.HasField("sync_state") and self._queue:
                # the whole sync state supersedes an older one still queued (not sent yet): one round trip
                # confirms both, and the older one's waiters are answered by the newer version
                self._queue = collections.deque(item for item in self._queue
                                                if item[0] != key or not item[2].HasField("sync_state"))
            if install and not msg.chunk_start:
                self._supersede(key)
            if not self._fits(nbytes, install):
                if install:  # snapshotted again once a batch got through: no churn while the backup is down
                    self._waiting.add(key)
                else:
                    self._dirty.add(key)
                    self._wake_sender()
                return self.queued + 1
            if install:
                self._dirty.discard(key)
                self._waiting.discard(key)
                self._due.pop(key, None)  # a chunk due of a catch-up this one replaces (or it is that chunk)
                if msg.chunk_more:
                    self._cursor[key] = msg.chunk_start + msg.value.shape[0]
                else:
                    self._cursor.pop(key, None)
                self._wake_sender()  # a catch-up has no push waiting for it: the thread sends it
            self.queued += 1
            self._queue.append((key, version, msg, nbytes, arrays, self.queued, wire))
            self._queued_bytes += nbytes
            if msg.pulled or orphan:  # a table pull's or a sync report's reply does not wait for its forward
                self._orphaned()
            return self.queued

    def put_series(self, key: Key, version: int, chunks: Sequence[tuple[pb.ReplicaForward, list[np.ndarray]]]) -> None:
        """Queue a catch-up's chunks back to back, all or none, as one whole state (a dynamic table's, cut from
        one snapshot: server/catch_up.py), so the shard's updates queued after it follow its last chunk; called
        under the shard's lock, never waits. No room: its shard's updates are skipped and a new snapshot is
        taken once a batch got through (as for a whole state)."""
        sizes = [sum([a.nbytes for a in arrays]) for _, arrays in chunks]
        with self._mutex:
            if key in self.refused:
                return
            self._supersede(key)
            if not self._fits(sum(sizes), True):
                self._waiting.add(key)
                return
            self._dirty.discard(key)
            self._waiting.discard(key)
            self._due.pop(key, None)
            self._cursor.pop(key, None)  # no chunk waits for a confirmation to be copied: all are queued
            for (msg, arrays), nbytes in zip(chunks, sizes):
                self.queued += 1
                self._queue.append((key, version, msg, nbytes, arrays, self.queued, None))
                self._queued_bytes += nbytes
            self._wake_sender()  # a catch-up has no push waiting for it: the thread sends it

    def _supersede(self, key: Key) -> None:
        """Under the lock: the shard's whole state supersedes what of it is still queued (its updates, an older
        catch-up): one snapshot per shard in memory at most; their waiters are answered by its confirmation."""
        if any(item[0] == key for item in self._queue):
            self._queued_bytes -= sum([item[3] for item in self._queue if item[0] == key])
            self._queue = collections.deque(item for item in self._queue if item[0] != key)

    def _fits(self, nbytes: int, install: bool) -> bool:
        """Under the lock: whether nbytes more may be queued; one whole state may overfill the queue (a shard
        larger than the room catches up too), and updates are counted against the room left beside it: a
        table's catch-up series larger than the room must not make every update racing it start it over."""
        if self._queued_bytes + nbytes <= self._max_queued or not self._queue:
            return True
        states = [item[3] for item in self._queue if item[2].HasField("spec")]
        if install:
            return not states
        return self._queued_bytes - sum(states) + nbytes <= self._max_queued

    def _orphaned(self) -> None:
        """Under the lock: a queued forward has no waiter to send it; the thread does, after LINGER_S."""
        self._orphans = True
        if self._idle:
            self._cond.notify()

    def _wake_sender(self) -> None:
        self._wake = True
        self._cond.notify()

    def wait(self, key: Key, version: int, deadline: float) -> bool:
        """Block until the backup confirmed `version` of key; False when this replicator stopped serving key.

        Raises:
            UnavailableError: the backup knows a newer epoch (this PS is deposed), or the deadline passed.
        """
        with self._mutex:
            try:
                while True:
                    self._check(key)
                    if self.acked.get(key, -1) >= version:
                        return True
                    if key not in self.keys or self._stop.is_set():
                        self._orphaned()
                        return False
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise UnavailableError(f"{name_of(key)}: backup ps {self.backup} did not confirm version "
                                               f"{version} in time; the push was not acknowledged (retry it with "
                                               "the same id)")
                    self._lead_or_wait(left)
            except BaseException:
                self._orphaned()  # what it queued may still be queued: the thread sends it
                raise

    def confirmed(self, key: Key) -> int:
        """The newest version of key the backup confirmed (0: none yet)."""
        with self._mutex:
            return self.acked.get(key, 0)

    def held(self, key: Key, version: int) -> bool:
        """Whether the backup confirmed `version` of key already; if not, what is queued goes by the thread (the
        caller does not wait to send it)."""
        with self._mutex:
            if self.acked.get(key, -1) >= version:
                return True
            self._orphaned()
            return False

    def _check(self, key: Key) -> None:
        """Under the lock: raise for a shard whose waiters cannot be confirmed at this epoch."""
        if key in self.stale:
            raise UnavailableError(f"{name_of(key)}: backup ps {self.backup} knows an epoch newer than "
                                   f"{self.stale[key]}, this PS's: it is no longer the primary; re-read placement")
        if key in self.refused:
            raise UnavailableError(f"{name_of(key)}: backup ps {self.backup} refused the shard's state "
                                   f"({self.refused[key]}); the update was not acknowledged")

    def _lead_or_wait(self, left: float) -> None:
        """Under the lock, for a waiter with `left` seconds: send the queued batch itself when none is in flight
        (group commit: its own forward and any queued behind it, no hop to the thread and back), bounded by
        its own deadline; else wait for a confirmation."""
        if not self._sending and self._queue and not self._failures and not self._stop.is_set():
            self._lead(min(self._timeout, left))
        else:
            self._acks.wait(left)

    def wait_config(self, key: Key, seq: int, deadline: float) -> None:
        """Block until the backup applied key's config change queued at place `seq` (what `put` returned), or
        a whole state of key queued after it (a skipped change, or one the backup answered GAP for, rides in
        the catch-up's spec).

        Raises:
            UnavailableError: the deadline passed, this replicator stopped or no longer serves key, or this PS
                is deposed (the call is idempotent: retry it).
        """
        with self._mutex:
            try:
                while self._confirmed.get(key, 0) < seq:
                    self._check(key)
                    left = deadline - time.monotonic()
                    if left <= 0 or self._stop.is_set() or key not in self.keys:
                        raise UnavailableError(f"{name_of(key)}: backup ps {self.backup} did not confirm a config "
                                               "change in time, or the shard's roles changed; retry the call (it is "
                                               "idempotent)")
                    self._lead_or_wait(left)
            except BaseException:
                self._orphaned()
                raise

    def forget(self, key: Key, epoch: int, resync: bool = False) -> None:
        """Drop what the backup confirmed of key: its role changed (now at epoch), the next confirmation starts
        afresh; a refusal of a forward of an older epoch still in flight no longer counts. resync: as
        `resync_later`, in the same critical section (an update between the two would be neither skipped nor
        held back, and could be confirmed by a copy the backup kept from before)."""
        with self._mutex:
            self.acked.pop(key, None)
            self.stale.pop(key, None)
            self.refused.pop(key, None)  # the new epoch's catch-up is tried afresh
            self._staging.discard(key)
            self._cursor.pop(key, None)
            self._due.pop(key, None)
            self._epoch[key] = epoch
            if resync:
                self._resync_later(key)

    def resync_later(self, key: Key) -> None:
        """Have the thread queue key's whole state soon (a new backup or epoch); until it does, key's updates
        are skipped (the state includes them), as for a queue that overflowed. The caller returns at once:
        a SetRoles answers before the shard is encoded, so a move's freeze does not grow with its size.
        Nothing of key counts as held until that state is confirmed: an update sent before it (queued between
        the thread taking the mark and its snapshot) may land on an older copy the backup kept."""
        with self._mutex:
            self._resync_later(key)

    def _resync_later(self, key: Key) -> None:
        self._dirty.add(key)
        self._staging.add(key)
        self._wake_sender()

    def poke(self) -> None:
        """Wake waiters (and the sender) to look at the roles again."""
        with self._mutex:
            self._orphans = self._orphans or bool(self._queue)  # waiters of a shard that moved leave theirs
            self._cond.notify_all()
            self._acks.notify_all()

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

    def _lead(self, timeout: float) -> None:
        """Under the lock: pop the next batch and send it without the lock (its arrays are let go on return)."""
        batch = self._pop()
        self._cond.release()
        try:
            self._send(batch, timeout)
        finally:
            self._cond.acquire()

    def _pop(self) -> list[Item]:
        """Under the lock: the next batch from the queue, marked in flight (`_send` sends it)."""
        batch: list[Item] = []
        size = 0
        chunked = False  # a batch carries one catch-up chunk at most: a frame holds a chunk, not a batch of them
        while self._queue and (not batch or size + self._queue[0][3] <= self._batch_bytes):
            chunk = self._queue[0][2].chunk_more or self._queue[0][2].chunk_start > 0
            if chunk and chunked:
                break
            chunked = chunked or chunk
            item = self._queue.popleft()
            batch.append(item)
            size += item[3]
        self._sending = True
        return batch

    def _send(self, batch: list[Item], timeout: float) -> None:
        """Send a popped batch (not under the lock) and record its outcomes; a failure puts it back first in
        the queue for the thread to resend after a back-off, a refusal for good drops it (`_refused`)."""
        dense = self._dense
        arrays = [a for item in batch for a in item[4]]
        try:
            wires = [wire for item in batch if (wire := item[6]) is not None]
            if dense is not None and len(wires) == len(batch):
                # dense updates only (an async push's): the compact form, no message per forward
                outcomes, versions = dense(wires, arrays, timeout)
            else:
                reply = self._link.replicate(pb.ReplicateRequest(forwards=[item[2] for item in batch],
                                                                 from_ps=self._from_ps), arrays, timeout)
                outcomes, versions = list(reply.outcomes), list(reply.versions)
            if len(outcomes) != len(batch) or len(versions) != len(batch):
                raise UnavailableError(f"backup ps {self.backup} answered {len(outcomes)} outcomes for "
                                       f"{len(batch)} forwards")
        except Exception as exc:  # noqa: BLE001 - the sender must outlive any failure: resend, log, back off
            if isinstance(exc, PsclusterError) and not exc.retryable:
                self._refused(batch, exc)
                return
            with self._mutex:
                self._queue.extendleft(reversed(batch))
                self._sending = False
                self._failures += 1
                failures = self._failures
                self._wake_sender()
                now = time.monotonic()
                due = failures == 1 or now - self._logged >= LOG_EVERY_S
                if due:
                    self._logged = now
            if due:
                log.warning("replication to ps %d failed (%d in a row), resending: %s", self.backup, failures, exc)
            return
        with self._mutex:
            self._failures = 0
            self._sending = False
            if self._waiting:  # the backup takes batches again: whole states that found no room are tried again
                self._dirty |= self._waiting
                self._waiting.clear()
                self._wake_sender()
            for (key, version, msg, nbytes, _, seq, _), outcome in zip(batch, outcomes):
                self._queued_bytes -= nbytes
                if outcome == pb.REPLICA_APPLIED:
                    if msg.HasField("spec") and msg.chunk_more:  # staged: the backup holds nothing of it yet
                        self._staging.add(key)
                        if self._cursor.get(key) == msg.chunk_start + msg.value.shape[0]:
                            self._due[key] = self._cursor[key]  # the next chunk may be copied now
                            self._wake_sender()
                        continue
                    if msg.HasField("spec"):
                        self._staging.discard(key)  # the last chunk (or a whole state): the copy is installed
                    if key in self._staging:
                        continue  # an update of the staged rows: held once the last chunk is
                    if version > self.acked.get(key, -1):
                        self.acked[key] = version
                    if msg.HasField("optimizer") or msg.HasField("spec") or msg.skipped or msg.swept:
                        self._confirmed[key] = max(self._confirmed.get(key, 0), seq)
                elif outcome == pb.REPLICA_GAP:
                    self._dirty.add(key)
                    self._wake_sender()
                elif msg.epoch >= self._epoch.get(key, 0):  # not a forward sent before the role changed
                    self.stale[key] = msg.epoch
            if self._queue and self._queue[0][2].HasField("spec"):
                self._wake_sender()  # a catch-up's next chunk: no push waits to send it, no linger
            self._acks.notify_all()  # a push still waiting sends the next batch

    def _refused(self, batch: list[Item], exc: PsclusterError) -> None:
        """A batch the backup refuses for good (resending it cannot help): updates are replaced by their shard's
        whole state; a refused whole state fails its waiters (`refused`) until the roles change."""
        log.error("replication to ps %d: the backup refused a batch of %d forwards for good: %s", self.backup,
                  len(batch), exc)
        with self._mutex:
            self._sending = False
            for key, _, msg, nbytes, _, _, _ in batch:
                self._queued_bytes -= nbytes
                if msg.HasField("spec"):
                    self.refused[key] = str(exc)
                elif key not in self.refused:
                    self._dirty.add(key)
            self._wake_sender()
            self._acks.notify_all()

    def _loop(self) -> None:
        """Catch-ups, resends after a back-off, and (after LINGER_S) forwards no waiting push has sent."""
        while not self._stop.is_set():
            with self._mutex:
                dirty, self._dirty = self._dirty, set()
                due, self._due = self._due, {}
                failures = self._failures
            for key, start in sorted(due.items()):
                if key not in dirty:
                    try:
                        self._resync(key, start)
                    except Exception:  # as below: that shard starts its catch-up again
                        log.exception("replication to ps %d: a catch-up chunk of %s failed", self.backup, name_of(key))
                        dirty.add(key)
            for key in sorted(dirty):
                try:
                    self._resync(key, 0)
                except Exception:  # one shard's failed snapshot must not end the sender of every shard
                    log.exception("replication to ps %d: the catch-up of %s failed; trying again", self.backup,
                                  name_of(key))
                    with self._mutex:
                        self._dirty.add(key)
                    self._stop.wait(0.5)
            if failures:
                self._stop.wait(min(0.01 * 2 ** min(failures, 6), 0.5))
            with self._mutex:
                if not failures and not self._wake and not self._dirty:
                    self._idle = not self._orphans
                    self._cond.wait(IDLE_S if self._idle else LINGER_S)
                    self._idle = False
                self._wake = False
                if not self._queue:
                    self._orphans = False
                if self._stop.is_set() or self._sending or not self._queue:
                    continue
                batch = self._pop()
                self._orphans = bool(self._queue)  # what did not fit the batch goes next
            self._send(batch, self._timeout)
            del batch  # a catch-up's arrays (a shard's whole state) must not wait here for the next batch
