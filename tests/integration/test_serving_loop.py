"""The bulk port's serving loop: small shared-memory requests are served from one thread, and nothing
a client does there can hold up another client.

A real PS core behind a real FrameServer on 127.0.0.1. A connection whose requests go through its
segment is served by the loop (no thread of its own); one that stops reading its replies is handed
to a thread of its own while another client goes on being served; idle and stopped connections end.
"""

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server.bulk import BulkHandlers
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.ps import ParameterServerCore
from pscluster.server.store import ShardSpec
from pscluster.server.sync_replicas import attach

from pscluster import codec
from pscluster.errors import UnavailableError
from pscluster.net import framing, shm
from pscluster.net.bulk import BulkCall, BulkClient

pytestmark = pytest.mark.skipif(not shm.available(), reason="this host has no writable /dev/shm")
SHAPE = (256, 128)  # 128 KB: served inline


def _server(**limits):
    core = ParameterServerCore(0, 1)
    core.create(ShardSpec("w", 0, 1, SHAPE, SHAPE, 0, "<f4", OptimizerConfig("sgd", 1.0)),
                np.zeros(SHAPE, np.float32), "zeros", 0.0, 0)
    return core, BulkHandlers(core).server("127.0.0.1", None, 1 << 16, **limits).start()


def _conn_threads():
    return [t for t in threading.enumerate() if t.name == "bulk-conn"]


_ids = iter(range(1 << 30))


def _push_pull(client, value):
    target = np.empty(SHAPE, np.float32)
    push = pb.PushRequest(push_id=f"p{next(_ids)}", return_values=True,
                          items=[pb.PushItem(ref=pb.ShardRef(variable="w"), grad=codec.header(np.float32, SHAPE))])
    call = BulkCall(0, pb.BulkRequest(push=push), payloads=[np.full(SHAPE, value, np.float32)], targets=[target])
    client.run([call])
    return target


def _wait(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def pool():
    pool = ThreadPoolExecutor(2)
    yield pool
    pool.shutdown()


def test_shared_memory_requests_are_served_by_the_loop_without_a_thread_per_connection(pool):
    core, frames = _server()
    clients = [BulkClient(["127.0.0.1"], lambda _: frames.port, None, timeout=5.0, pool=pool, io_timeout=10.0)
               for _ in range(3)]
    try:
        for step in range(1, 6):
            for client in clients:
                got = _push_pull(client, 1.0)
        np.testing.assert_array_equal(got, np.full(SHAPE, -15.0, np.float32))  # 15 pushes of 1.0, lr 1
        assert frames.connections == 3
        assert _wait(lambda: not _conn_threads())  # each went back to the loop after its segment offer
        assert [t for t in threading.enumerate() if t.name == "bulk-loop"]
    finally:
        for client in clients:
            client.close()
        frames.stop()
    assert _wait(lambda: frames.connections == 0)
    assert not [t for t in threading.enumerate() if t.name in ("bulk-loop", "bulk-conn")]


def test_a_connection_that_stops_reading_gets_its_own_thread_and_the_others_go_on(pool):
    core, frames = _server(io_timeout_s=30.0)
    segment, nonce = shm.Segment.create(shm.size_for(SHAPE[0] * SHAPE[1] * 4))
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # its replies back up after a few dozen
    stalled.connect(("127.0.0.1", frames.port))
    client = BulkClient(["127.0.0.1"], lambda _: frames.port, None, timeout=5.0, pool=pool, io_timeout=10.0)
    try:
        framing.send_hello(stalled, None)
        offer = pb.ShmAttach(name=segment.name, nonce=nonce, size=shm.HEADER_BYTES + segment.capacity)
        framing.send_frame(stalled, pb.BulkRequest(shm_attach=offer).SerializeToString())
        assert framing.read_reply(stalled)[0].code == 0
        shm.unlink(segment.name)
        pull = pb.BulkRequest(pull=pb.PullRequest(items=[pb.PullItem(ref=pb.ShardRef(variable="w"))]),
                              shm_reply=True)
        frame = framing.PREFIX.pack(pull.ByteSize(), 0) + pull.SerializeToString()
        stalled.settimeout(0.5)
        try:
            for _ in range(1_000_000):  # pull after pull, never reading a reply, until the PS stops taking them
                stalled.sendall(frame)
        except TimeoutError:
            pass
        assert _wait(lambda: len(_conn_threads()) == 1)  # the stalled reader's own thread, blocked on its send
        started = time.monotonic()
        for step in range(20):
            got = _push_pull(client, 0.5)
        assert time.monotonic() - started < 5.0  # the loop never waited on the stalled reader
        np.testing.assert_array_equal(got, np.full(SHAPE, -10.0, np.float32))
    finally:
        stalled.close()
        segment.close()
        client.close()
        frames.stop()


def test_a_connection_idle_in_the_loop_is_closed_after_idle_timeout(pool):
    core, frames = _server(idle_timeout_s=0.5)
    client = BulkClient(["127.0.0.1"], lambda _: frames.port, None, timeout=5.0, pool=pool, io_timeout=10.0)
    try:
        _push_pull(client, 1.0)
        _push_pull(client, 1.0)
        assert _wait(lambda: not _conn_threads()) and frames.connections == 1
        assert _wait(lambda: frames.connections == 0, seconds=4.0)
    finally:
        client.close()
        frames.stop()


def test_a_connection_that_takes_sync_tokens_keeps_its_own_thread(pool):
    core, frames = _server()
    attach(core).configure("bounded", 1, 1, 100)
    client = BulkClient(["127.0.0.1"], lambda _: frames.port, None, timeout=5.0, pool=pool, io_timeout=10.0)
    try:
        _push_pull(client, 1.0)
        assert _wait(lambda: not _conn_threads())  # loop-served so far
        call = BulkCall(0, pb.BulkRequest(take_token=pb.TokenRequest(closure_id=1, worker="w", timeout_s=5.0)))
        client.run([call])
        assert call.reply is not None
        for _ in range(3):
            _push_pull(client, 1.0)
        assert len(_conn_threads()) == 1  # a token wait must never hold the loop: this connection stays off it
    finally:
        client.close()
        frames.stop()


def test_a_table_connection_alternating_row_pulls_and_pushes_keeps_one_thread(pool):
    core, frames = _server()
    rows = (100_000, 16)
    core.create(ShardSpec("emb", 0, 1, rows, rows, 0, "<f4", OptimizerConfig("sgd", 1.0), sparse=True),
                np.zeros(rows, np.float32), "zeros", 0.0, 0)
    handoffs = []
    handoff = frames._handoff
    frames._handoff = lambda served: (handoffs.append(served), handoff(served))  # a spy: counts new threads
    client = BulkClient(["127.0.0.1"], lambda _: frames.port, None, timeout=5.0, pool=pool, io_timeout=10.0)
    ids = np.arange(0, 100_000, 50, dtype=np.int64)  # 2,000 rows of 64 bytes: the segment path
    try:
        for step in range(1, 6):
            got = np.empty((ids.size, 16), np.float32)
            pull = pb.PullRequest(items=[pb.PullItem(ref=pb.ShardRef(variable="emb"), ids=codec.encode(ids))])
            client.run([BulkCall(0, pb.BulkRequest(pull=pull), targets=[got])])
            np.testing.assert_array_equal(got, np.full(got.shape, 1 - step, np.float32))
            push = pb.PushRequest(push_id=f"t{step}", items=[pb.PushItem(
                ref=pb.ShardRef(variable="emb"), ids=codec.encode(ids), grad=codec.header(np.float32, got.shape))])
            client.run([BulkCall(0, pb.BulkRequest(push=push), payloads=[np.ones(got.shape, np.float32)])])
        assert len(_conn_threads()) == 1 and len(handoffs) <= 1  # not a new thread for every pull
    finally:
        client.close()
        frames.stop()


class _HeldLink:
    """Replicate to an in-process core through the wire format, once `release` is set (a backup that has not
    answered yet)."""

    def __init__(self, target: ParameterServerCore) -> None:
        self.target = target
        self.release = threading.Event()

    def replicate(self, request, arrays, timeout):
        from pscluster.server.replica_links import payload_views

        if not self.release.wait(timeout):
            raise UnavailableError("backup did not answer (held by the test)")
        parsed = pb.ReplicateRequest.FromString(request.SerializeToString())
        payload = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]) \
            if arrays else np.empty(0, np.uint8)
        return self.target.replication.receive(parsed, payload_views(parsed, payload))

    def close(self) -> None:
        pass


def test_a_push_on_the_loop_that_finds_a_moves_new_backup_answers_unavailable_at_once_not_after_the_timeout(pool):
    """Elastic, one copy: the loop took a push while its shard had no backup, and a move's temporary backup
    appeared before it applied. Waiting for that backup on the loop would stall every connection on the port for
    up to the replication timeout (5 s here); the push answers a retryable UNAVAILABLE instead, and its retry
    (same id, on a thread) is acknowledged once the backup holds it, applied once."""
    from pscluster.server.replication import Replication, Role

    key = ("w", 0)
    backup = ParameterServerCore(1, 2)
    backup.replication = Replication(backup.store, 1, lambda ps: None, timeout=5.0)
    link = _HeldLink(backup)
    core = ParameterServerCore(0, 2)
    core.replication = Replication(core.store, 0, lambda ps: link, timeout=5.0)
    core.create(ShardSpec("w", 0, 1, SHAPE, SHAPE, 0, "<f4", OptimizerConfig("sgd", 1.0)),
                np.zeros(SHAPE, np.float32), "zeros", 0.0, 0)
    for c in (backup, core):
        c.replication.set_roles(1, [Role(key, 1, 0)])  # one copy on PS 0: pushes are served by the loop
    frames = BulkHandlers(core).server("127.0.0.1", None, 1 << 16).start()
    applied = core.store.on_applied
    moved = threading.Event()

    def move_under_the_push(*args):  # the move's SetRoles lands between the loop's check and the apply
        if not moved.is_set():
            moved.set()
            for c in (backup, core):
                c.replication.set_roles(2, [Role(key, 2, 0, 1)])
        applied(*args)

    client = BulkClient(["127.0.0.1"], lambda _: frames.port, None, timeout=10.0, pool=pool, io_timeout=10.0)
    other = BulkClient(["127.0.0.1"], lambda _: frames.port, None, timeout=10.0, pool=pool, io_timeout=10.0)

    def push(push_id: str) -> None:
        request = pb.PushRequest(push_id=push_id, items=[pb.PushItem(ref=pb.ShardRef(variable="w"),
                                                                     grad=codec.header(np.float32, SHAPE))])
        client.run([BulkCall(0, pb.BulkRequest(push=request), payloads=[np.full(SHAPE, 1.0, np.float32)])])

    try:
        push("warm")  # the segment offer, then the loop serves this connection
        _pull(other)
        assert _wait(lambda: not _conn_threads())
        core.store.on_applied = move_under_the_push
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="retry it with the same id"):
            push("p1")
        assert time.monotonic() - started < 2.0  # the old code held the loop for the whole 5 s timeout
        assert moved.is_set() and core.store.get(key).version == 2  # applied, not acknowledged
        link.release.set()  # the backup answers: its catch-up lands
        push("p1")  # the retry: on a thread (the shard has a backup), held by the push record, acknowledged
        assert core.store.get(key).version == 2 and backup.store.get(key).version == 2
        np.testing.assert_array_equal(backup.store.get(key).value, np.full(SHAPE, -2.0, np.float32))
    finally:
        link.release.set()
        client.close()
        other.close()
        frames.stop()
        core.replication.stop()
        backup.replication.stop()


def _pull(client):
    target = np.empty(SHAPE, np.float32)
    pull = pb.BulkRequest(pull=pb.PullRequest(items=[pb.PullItem(ref=pb.ShardRef(variable="w"))]), shm_reply=True)
    client.run([BulkCall(0, pull, targets=[target])])
    return target
