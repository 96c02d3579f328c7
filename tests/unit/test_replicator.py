"""The primary's sender (server/replicator.py) against scripted backups: room, refusals, deadlines, configs.

Each test was written against a finding of a review of the sender and failed on the code before its fix.
tests/unit/test_replication.py runs the sender between two in-process PS cores.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server.replicator import Replicator

from pscluster.errors import InvalidArgumentError, UnavailableError

KEY = ("w", 0)
OTHER = ("v", 0)
BOUND_S = 10.0  # upper bound on waiting for a state; a healthy run needs milliseconds


class Backup:
    """A scripted backup: applies every forward, or fails each batch as `fail` says (None: it answers)."""

    def __init__(self) -> None:
        self.fail: Callable[[pb.ReplicateRequest], Exception | None] = lambda request: None
        self.delay = 0.0
        self.batches: list[pb.ReplicateRequest] = []
        self.timeouts: list[float] = []

    def replicate(self, request: pb.ReplicateRequest, arrays: list[np.ndarray], timeout: float) -> pb.ReplicateReply:
        self.timeouts.append(timeout)
        if self.delay:  # a slow backup: the caller's deadline bounds the call, as a socket timeout does
            time.sleep(min(self.delay, timeout))
            if self.delay > timeout:
                raise UnavailableError("timed out")
        exc = self.fail(request)
        if exc is not None:
            raise exc
        self.batches.append(request)
        return pb.ReplicateReply(outcomes=[pb.REPLICA_APPLIED] * len(request.forwards),
                                 versions=[f.version for f in request.forwards])

    def close(self) -> None:
        pass


def update(key: tuple[str, int], version: int) -> pb.ReplicaForward:
    return pb.ReplicaForward(ref=pb.ShardRef(variable=key[0], shard_index=key[1]), epoch=1, version=version)


def install(key: tuple[str, int], version: int) -> pb.ReplicaForward:
    msg = update(key, version)
    msg.spec.variable = key[0]
    return msg


def config(key: tuple[str, int], version: int) -> pb.ReplicaForward:
    msg = update(key, version)
    msg.optimizer.kind = "sgd"
    return msg


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"not reached within {BOUND_S} s: {what}"
        time.sleep(0.005)


def replicator(backup: Backup, resync: Callable[[tuple[str, int], int], None], room: int = 1 << 20,
               timeout: float = 2.0) -> Replicator:
    rep = Replicator(1, backup, 0, timeout, resync, max_queued_bytes=room)
    rep.keys.update({KEY, OTHER})
    return rep


def test_a_whole_state_larger_than_the_room_is_sent_and_not_snapshotted_again_while_the_backup_is_down() -> None:
    """Before: an install that did not fit was dropped and the shard re-snapshotted at each back-off (every
    0.5 s, CPU and memory churn) while the backup was down, and never sent while the queue was busy."""
    backup = Backup()
    down = threading.Event()
    down.set()
    backup.fail = lambda request: UnavailableError("backup down") if down.is_set() else None
    snapshots: list[tuple[str, int]] = []
    rep: Replicator

    def resync(key: tuple[str, int], start: int = 0) -> None:
        snapshots.append(key)
        rep.put(key, 5, install(key, 5), [np.zeros(1000, np.float32)])  # 4,000 bytes: 4 x the room

    rep = replicator(backup, resync, room=1000)
    try:
        rep.put(OTHER, 1, update(OTHER, 1), [np.zeros(10, np.float32)])  # queued, failing to send
        rep.put(KEY, 1, update(KEY, 1), [np.zeros(1000, np.float32)])  # no room: KEY is sent whole instead
        until(lambda: len(snapshots) >= 1, "the catch-up's snapshot")
        time.sleep(1.5)  # three back-offs of the thread while the backup is down
        assert snapshots == [KEY]
        down.clear()
        until(lambda: rep.acked.get(KEY) == 5, "the backup to confirm the whole state")
        assert [f.ref.variable for b in backup.batches for f in b.forwards if f.HasField("spec")] == ["w"]
    finally:
        rep.stop()


def test_a_batch_the_backup_refuses_for_good_is_not_resent_and_its_shard_is_sent_whole() -> None:
    """Before: a batch that failed for good (a non-retryable error) was resent forever."""
    backup = Backup()
    backup.fail = lambda request: InvalidArgumentError("bad forward") if not request.forwards[0].HasField("spec") \
        else None
    snapshots: list[tuple[str, int]] = []
    rep: Replicator

    def resync(key: tuple[str, int], start: int = 0) -> None:
        snapshots.append(key)
        rep.put(key, 3, install(key, 3), [np.zeros(4, np.float32)])

    rep = replicator(backup, resync)
    try:
        rep.put(KEY, 3, update(KEY, 3), [np.zeros(4, np.float32)])
        assert rep.wait(KEY, 3, time.monotonic() + BOUND_S)  # confirmed by the whole state sent instead
        assert snapshots == [KEY] and len(backup.timeouts) == 2  # refused once, then the install
        backup.fail = lambda request: InvalidArgumentError("state too large")
        rep.put(KEY, 4, install(KEY, 4), [np.zeros(4, np.float32)])
        with pytest.raises(UnavailableError, match="refused the shard's state"):
            rep.wait(KEY, 4, time.monotonic() + BOUND_S)  # at once, not after the deadline
        time.sleep(0.3)
        assert len(backup.timeouts) == 3  # a refused whole state is not sent again...
        rep.forget(KEY, 2)  # ...until the roles change
        backup.fail = lambda request: None
        rep.put(KEY, 4, install(KEY, 4), [np.zeros(4, np.float32)])
        assert rep.wait(KEY, 4, time.monotonic() + BOUND_S)
    finally:
        rep.stop()


def test_a_push_that_leads_a_batch_to_a_slow_backup_returns_by_its_own_deadline() -> None:
    """Before: a waiting push sent the queued batch with the replicator's whole timeout, past its deadline."""
    backup = Backup()
    backup.delay = 3.0
    rep = replicator(backup, lambda key, start: None, timeout=5.0)
    try:
        rep.put(KEY, 1, update(KEY, 1), [np.zeros(4, np.float32)])
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="in time"):
            rep.wait(KEY, 1, started + 0.2)
        assert time.monotonic() - started < 1.5
        assert backup.timeouts[0] <= 0.2
    finally:
        rep.stop()


def test_a_config_change_is_confirmed_only_once_the_backup_applied_it_or_a_whole_state_after_it() -> None:
    """Before: the wait ended on any answer to the change's place in the queue, GAP included, and a change
    skipped for a queued catch-up counted as the forward queued before it."""
    backup = Backup()
    gaps = threading.Event()
    gaps.set()

    plain = backup.replicate

    def replicate(request: pb.ReplicateRequest, arrays: list[np.ndarray], timeout: float) -> pb.ReplicateReply:
        reply = plain(request, arrays, timeout)
        if gaps.is_set():  # the backup lacks an update: it answers GAP for the change
            for i, f in enumerate(request.forwards):
                if f.HasField("optimizer"):
                    reply.outcomes[i] = pb.REPLICA_GAP
        return reply

    backup.replicate = replicate  # type: ignore[method-assign]
    snapshots: list[tuple[str, int]] = []
    rep: Replicator
    release = threading.Event()

    def resync(key: tuple[str, int], start: int = 0) -> None:
        snapshots.append(key)
        release.wait(BOUND_S)  # the catch-up (which carries the change in its spec) is slow to come
        rep.put(key, 2, install(key, 2), [np.zeros(4, np.float32)])

    rep = replicator(backup, resync)
    try:
        seq = rep.put(KEY, 2, config(KEY, 2), [])
        waited: list[BaseException | None] = []

        def wait() -> None:
            try:
                rep.wait_config(KEY, seq, time.monotonic() + BOUND_S)
                waited.append(None)
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                waited.append(exc)

        waiter = threading.Thread(target=wait, name="test-config-waiter")
        waiter.start()
        until(lambda: snapshots == [KEY], "the GAP's catch-up")
        time.sleep(0.2)
        assert waited == []  # the GAP answer did not confirm the change
        gaps.clear()
        release.set()
        waiter.join(BOUND_S)
        assert waited == [None]
        # a change skipped while its shard's whole state is due waits for that state, not the forward before it
        rep.put(OTHER, 1, update(OTHER, 1), [np.zeros(4, np.float32)])
        rep.wait(OTHER, 1, time.monotonic() + BOUND_S)
        with rep._cond:
            rep._dirty.add(KEY)
            rep._sending = True  # hold the thread off the dirty shard for a moment
        seq = rep.put(KEY, 2, config(KEY, 2), [])
        with pytest.raises(UnavailableError, match="did not confirm a config change"):
            rep.wait_config(KEY, seq, time.monotonic() + 0.2)
        with rep._cond:
            rep._sending = False
            rep._wake_sender()
        rep.wait_config(KEY, seq, time.monotonic() + BOUND_S)
        assert snapshots == [KEY, KEY]
    finally:
        release.set()
        rep.stop()


def _thread_wakeups(rep: Replicator) -> int:
    """Voluntary context switches of rep's thread so far (it sleeps on a condition between wake-ups)."""
    tid = rep._thread.native_id
    with open(f"/proc/self/task/{tid}/status") as f:
        text = f.read()
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("voluntary_ctxt_switches")))


def test_an_idle_sender_sleeps_and_forwards_no_push_waits_for_still_leave_within_the_linger() -> None:
    backup = Backup()
    rep = replicator(backup, lambda key, start: None)
    try:
        # a push sends its own forward: the thread has nothing to do and stays asleep (it woke every LINGER_S,
        # ~50 times a second, before)
        rep.put(KEY, 1, update(KEY, 1), [])
        assert rep.wait(KEY, 1, time.monotonic() + BOUND_S)
        before = _thread_wakeups(rep)
        time.sleep(0.3)
        assert _thread_wakeups(rep) - before <= 2
        # a table pull's forward has no waiter: the thread sends it, long before IDLE_S
        pulled = update(KEY, 1)
        pulled.pulled = True
        start = time.monotonic()
        rep.put(KEY, 1, pulled, [])
        until(lambda: len(backup.batches) == 2, "the pull's forward sent by the thread")
        assert time.monotonic() - start < 0.25
        # a push that gave up (deadline passed before it sent) leaves its forward to the thread
        rep.put(KEY, 2, update(KEY, 2), [])
        with pytest.raises(UnavailableError):
            rep.wait(KEY, 2, time.monotonic() - 1)
        start = time.monotonic()
        until(lambda: rep.acked.get(KEY) == 2, "the given-up push's forward sent by the thread")
        assert time.monotonic() - start < 0.25
    finally:
        rep.stop()


@pytest.mark.parametrize("batch_bytes", [1 << 20, 5000])
def test_a_batch_stays_within_the_bytes_one_frame_of_the_backup_takes(batch_bytes: int) -> None:
    """Before: batches grouped up to 16 MiB whatever the backup's frame limit (max_tensor_bytes may be 1 MiB):
    a larger batch was refused and its shards sent whole."""
    backup = Backup()
    down = threading.Event()
    down.set()
    backup.fail = lambda request: UnavailableError("backup down") if down.is_set() else None
    rep = Replicator(1, backup, 0, 2.0, lambda key, start=0: None, max_queued_bytes=1 << 20, batch_bytes=batch_bytes)
    rep.keys.update({KEY, OTHER})
    try:
        for version in (1, 2, 3):  # 4,000 bytes each, queued while the backup is down
            rep.put(KEY, version, update(KEY, version), [np.zeros(1000, np.float32)])
        down.clear()
        until(lambda: rep.acked.get(KEY) == 3, "the backup to confirm all three")
        sizes = [len(b.forwards) for b in backup.batches]
        assert sizes == ([3] if batch_bytes > 12000 else [1, 1, 1])  # one forward alone may exceed it
    finally:
        rep.stop()
