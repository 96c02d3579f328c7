"""Replication over a backup's real framed bulk port (server/replica_links.py FrameLink -> server/bulk.py).

Two in-process PS cores on 127.0.0.1: the primary's forwards reach the backup as a header plus the
arrays' bytes; a catch-up of a shard whose state (value and Adam slots) is larger than max_message_bytes
goes through; a connection the backup closed is replaced without losing the batch; a peer that is not
a PS cannot send a replicate; a malformed batch is refused and changes nothing. On one host the batches'
bytes go through a shared-memory segment and the backup applies them on its frame loop.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server import replica_links, replica_wire, sync_replicas
from pscluster.server.bulk import BulkHandlers
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.ps import ParameterServerCore
from pscluster.server.push_record import push_key
from pscluster.server.replica_links import FrameLink
from pscluster.server.replication import Replication, Role
from pscluster.server.store import PushItem, ShardSpec

from pscluster import codec
from pscluster.config import ClusterSpec, Settings
from pscluster.errors import InvalidArgumentError, UnavailableError
from pscluster.net import framing

KEY = ("w", 0)
SHAPE = (512, 1024)  # 2 MiB of float32; with Adam's two slots, 6 MiB of state per catch-up
HEADER_LIMIT = 1 << 20  # the backup's max header: a catch-up in one protobuf message would not fit


@pytest.fixture
def pair():
    backup = ParameterServerCore(1, 2)
    sync_replicas.attach(backup)
    backup.replication = Replication(backup.store, 1, lambda ps: pytest.fail("the backup forwards nothing"))
    frames = BulkHandlers(backup).server("127.0.0.1", "secret", HEADER_LIMIT).start()
    settings = Settings(cluster=ClusterSpec(ps=["127.0.0.1:1", "127.0.0.1:2"]), token="secret")
    links: list[FrameLink] = []

    def connect(ps: int) -> FrameLink:
        links.append(FrameLink(settings.cluster.ps[ps], settings, port_of=lambda timeout: frames.port))
        return links[-1]

    primary = ParameterServerCore(0, 2)
    sync_replicas.attach(primary)
    primary.replication = Replication(primary.store, 0, connect, timeout=10.0)
    yield primary, backup, frames, links
    primary.replication.stop()
    backup.replication.stop()
    frames.stop()


def create_and_replicate(primary: ParameterServerCore, backup: ParameterServerCore) -> None:
    spec = ShardSpec("w", 0, 1, SHAPE, SHAPE, 0, "<f4", OptimizerConfig("adam", 0.01))
    primary.create(spec, np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE), "zeros", 0, 0)
    for core in (backup, primary):
        core.replication.set_roles(1, [Role(KEY, 1, 0, 1)])
    primary.replication.wait([(KEY, primary.store.get(KEY).version)])


def same(a: ParameterServerCore, b: ParameterServerCore) -> None:
    sa, sb = a.store.get(KEY), b.store.get(KEY)
    assert sa.version == sb.version
    np.testing.assert_array_equal(sa.value, sb.value)
    for name in sa.slots:
        np.testing.assert_array_equal(sa.slots[name], sb.slots[name])


def test_a_catch_up_larger_than_a_message_and_every_push_reach_the_backup_over_the_bulk_port(pair):
    primary, backup, _, _ = pair
    create_and_replicate(primary, backup)
    same(primary, backup)
    rng = np.random.default_rng(0)
    for i in range(5):
        primary.push(f"p{i}", 0, [PushItem(KEY, rng.standard_normal(SHAPE).astype(np.float32))])
    same(primary, backup)  # each push was answered only once the backup held it
    assert backup.store.get(KEY).record.seen_key(push_key("p4"))


def test_a_connection_the_backup_closed_is_replaced_and_the_push_is_acknowledged(pair):
    primary, backup, frames, links = pair
    create_and_replicate(primary, backup)
    frames.stop()  # closes every connection, the link's included; a new server on the same port serves on
    restarted = BulkHandlers(backup).server("127.0.0.1", "secret", HEADER_LIMIT, port=frames.port).start()
    try:
        primary.push("after", 0, [PushItem(KEY, np.ones(SHAPE, np.float32))])
        same(primary, backup)
    finally:
        restarted.stop()


def test_a_malformed_batch_is_refused_and_changes_nothing(pair):
    primary, backup, frames, _ = pair
    create_and_replicate(primary, backup)
    before = backup.store.get(KEY).value.copy()
    forward = pb.ReplicaForward(ref=pb.ShardRef(variable="w", shard_index=0), epoch=1,
                                version=backup.store.get(KEY).version + 1, grad=codec.header(np.float32, SHAPE))
    request = pb.BulkRequest(replicate=pb.ReplicateRequest(forwards=[forward], from_ps=0))
    sock = framing.connect("127.0.0.1", frames.port, 5.0, None)
    try:
        framing.send_hello(sock, "secret")
        framing.send_frame(sock, request.SerializeToString(), 8)  # 8 bytes for a 2 MiB gradient
        framing.send_buffer(sock, b"\0" * 8)
        reply, _ = framing.read_reply(sock)
    finally:
        sock.close()
    assert reply.code == InvalidArgumentError("").code.value[0]
    assert "fewer bytes than the shapes announce" in reply.message
    np.testing.assert_array_equal(backup.store.get(KEY).value, before)


def test_pushes_travel_in_the_compact_form_and_a_malformed_one_changes_nothing(pair, monkeypatch):
    primary, backup, frames, _ = pair
    create_and_replicate(primary, backup)
    dense = []
    receive_dense = backup.replication.receive_dense
    monkeypatch.setattr(backup.replication, "receive_dense", lambda *a: dense.append(1) or receive_dense(*a))
    primary.push("d0", 0, [PushItem(KEY, np.ones(SHAPE, np.float32))])
    same(primary, backup)
    assert dense == [1]  # the dense update went as replica_wire bytes, not a ReplicateRequest
    before = backup.store.get(KEY).value.copy()
    const = replica_wire.const_part("w", 0, np.dtype(np.float32), SHAPE)
    body = replica_wire.request([replica_wire.forward(const, 1, backup.store.get(KEY).version + 1, 0, "x") or b""])
    sock = framing.connect("127.0.0.1", frames.port, 5.0, None)
    try:
        framing.send_hello(sock, "secret")
        framing.send_frame(sock, pb.BulkRequest(replicate_dense=body).SerializeToString(), 8)
        framing.send_buffer(sock, b"\0" * 8)  # 8 bytes for a 2 MiB gradient
        reply, _ = framing.read_reply(sock)
    finally:
        sock.close()
    assert reply.code == InvalidArgumentError("").code.value[0]
    assert "payload of 8 bytes, shapes announce 2097152" in reply.message
    np.testing.assert_array_equal(backup.store.get(KEY).value, before)


SMALL, SMALL_SHAPE = ("s", 0), (256, 128)  # 128 KiB: within what the backup's loop applies (INLINE_BYTES)


def add_small_shard(primary: ParameterServerCore, backup: ParameterServerCore, monkeypatch) -> list[str]:
    """Create and replicate SMALL beside KEY; returns the names of the backup's threads that apply dense batches
    from now on, in order."""
    spec = ShardSpec("s", 0, 1, SMALL_SHAPE, SMALL_SHAPE, 0, "<f4", OptimizerConfig("sgd", 0.1))
    primary.create(spec, np.zeros(SMALL_SHAPE, np.float32), "zeros", 0, 0)
    for core in (backup, primary):
        core.replication.set_roles(2, [Role(KEY, 1, 0, 1), Role(SMALL, 1, 0, 1)])
    primary.replication.wait([(SMALL, primary.store.get(SMALL).version)])
    threads: list[str] = []
    receive_dense = backup.replication.receive_dense
    monkeypatch.setattr(backup.replication, "receive_dense",
                        lambda *a: threads.append(threading.current_thread().name) or receive_dense(*a))
    return threads


def test_on_one_host_batches_go_through_a_segment_and_the_backup_applies_them_on_its_loop(pair, monkeypatch):
    primary, backup, _, links = pair
    create_and_replicate(primary, backup)  # the catch-up (a whole state) went through the segment, on a thread
    small, shape = SMALL, SMALL_SHAPE
    threads = add_small_shard(primary, backup, monkeypatch)
    rng = np.random.default_rng(2)
    for i in range(4):
        primary.push(f"s{i}", 0, [PushItem(small, rng.standard_normal(shape).astype(np.float32))])
        np.testing.assert_array_equal(primary.store.get(small).value, backup.store.get(small).value)
    assert links[0]._segment is not None
    # the first batch's thread hands the link to the loop: no thread per batch after it
    assert len(threads) == 4 and threads[1:] == ["bulk-loop"] * 3
    primary.push("big", 0, [PushItem(KEY, np.ones(SHAPE, np.float32))])  # 2 MiB: applied on a thread
    same(primary, backup)
    # once a batch was too large for the loop, the link keeps its thread (no thread per batch as sizes vary)
    for i in range(2):
        primary.push(f"small-again{i}", 0, [PushItem(small, np.ones(shape, np.float32))])
        np.testing.assert_array_equal(primary.store.get(small).value, backup.store.get(small).value)
    assert threads[-2:] == ["bulk-conn", "bulk-conn"]


def test_a_batch_larger_than_a_links_segment_may_be_rides_the_socket(pair, monkeypatch):
    monkeypatch.setattr(replica_links, "SEGMENT_MAX_BYTES", 1 << 20)
    primary, backup, _, links = pair
    create_and_replicate(primary, backup)  # a 6 MiB whole state: on the socket
    same(primary, backup)
    assert links[0]._segment is None
    small, shape = SMALL, SMALL_SHAPE
    threads = add_small_shard(primary, backup, monkeypatch)
    for i in range(2):
        primary.push(f"a{i}", 0, [PushItem(small, np.ones(shape, np.float32))])
    assert threads[-1] == "bulk-loop" and links[0]._segment is not None
    primary.push("big", 0, [PushItem(KEY, np.full(SHAPE, 0.25, np.float32))])  # 2 MiB: on the socket
    same(primary, backup)
    assert links[0]._segment.capacity < SHAPE[0] * SHAPE[1] * 4
    for i in range(2):  # the link keeps the thread the socket's batch took (no thread per batch)
        primary.push(f"b{i}", 0, [PushItem(small, np.ones(shape, np.float32))])
    np.testing.assert_array_equal(primary.store.get(small).value, backup.store.get(small).value)
    assert threads[-2:] == ["bulk-conn", "bulk-conn"]


def test_without_shared_memory_the_bytes_ride_the_socket(pair, monkeypatch):
    monkeypatch.setattr(replica_links.shm, "available", lambda: False)
    primary, backup, _, links = pair
    create_and_replicate(primary, backup)
    primary.push("n0", 0, [PushItem(KEY, np.full(SHAPE, 0.5, np.float32))])
    same(primary, backup)
    assert links[0]._segment is None


def test_a_connection_whose_hello_fails_is_closed(monkeypatch):
    """Found by review: a socket whose hello failed was neither kept nor closed (one leaked per attempt)."""
    listener = socket.create_server(("127.0.0.1", 0))
    opened: list[socket.socket] = []
    connect = framing.connect

    def recording(*args, **kwargs):
        opened.append(connect(*args, **kwargs))
        return opened[-1]

    def failing(sock, token):
        raise OSError("the peer reset the connection")

    monkeypatch.setattr(framing, "connect", recording)
    monkeypatch.setattr(framing, "send_hello", failing)
    settings = Settings(cluster=ClusterSpec(ps=["127.0.0.1:1", "127.0.0.1:2"]))
    link = FrameLink("127.0.0.1:2", settings, port_of=lambda timeout: listener.getsockname()[1])
    try:
        with pytest.raises(UnavailableError):
            link.replicate(pb.ReplicateRequest(), [], timeout=5.0)
        assert len(opened) == 1 and opened[0].fileno() == -1
    finally:
        link.close()
        listener.close()


def test_a_reply_that_does_not_parse_drops_the_connection_and_the_next_batch_gets_a_new_one():
    """Found by review: a DecodeError left the out-of-step socket in place for the next batch."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def backup() -> None:  # the first connection answers garbage, the second a proper reply
        for n in range(2):
            conn, _ = listener.accept()
            accepted.append(conn)
            conn.settimeout(10)
            for _ in range(2):  # the hello, then the batch
                header_len, payload_len = framing.PREFIX.unpack(framing.recv_exact(conn, framing.PREFIX.size))
                framing.recv_exact(conn, header_len + payload_len)
            reply = b"\xff\xff\xff\xff" if n == 0 else pb.BulkReply(replicate=pb.ReplicateReply()).SerializeToString()
            conn.sendall(framing.PREFIX.pack(len(reply), 0) + reply)

    thread = threading.Thread(target=backup, name="test-garbling-backup")
    thread.start()
    settings = Settings(cluster=ClusterSpec(ps=["127.0.0.1:1", "127.0.0.1:2"]))
    link = FrameLink("127.0.0.1:2", settings, port_of=lambda timeout: listener.getsockname()[1])
    try:
        with pytest.raises(UnavailableError, match="broken reply"):
            link.replicate(pb.ReplicateRequest(), [], timeout=5.0)
        assert link.replicate(pb.ReplicateRequest(), [], timeout=5.0) == pb.ReplicateReply()
        assert len(accepted) == 2
    finally:
        link.close()
        thread.join(10)
        for conn in accepted:
            conn.close()
        listener.close()


@pytest.mark.parametrize("sizes", [[0, 3, 401_408, 512], [5 << 20, 7], [1] * 300])
def test_a_batch_arrives_byte_for_byte_whether_gathered_in_sendmsg_calls_or_sent_piecewise(sizes):
    # sendmsg's partial sends, a buffer larger than a CHUNK, and more buffers than GATHER_BUFFERS (piecewise)
    rng = np.random.default_rng(1)
    views = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    header = b"h" * 37
    a, b = socket.socketpair()
    a.settimeout(10)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # small: sendmsg sends part of a batch at a time
    got = bytearray()
    want = framing.PREFIX.pack(len(header), sum(sizes)) + header + b"".join(v.tobytes() for v in views)

    def read() -> None:
        while len(got) < len(want):
            chunk = b.recv(1 << 16)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        replica_links._send_batch(a, header, views)
        reader.join(10)
    finally:
        a.close()
        b.close()
        reader.join(10)
    assert bytes(got) == want
