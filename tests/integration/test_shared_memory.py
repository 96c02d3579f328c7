"""Same-host bulk payloads through shared memory: used when it can be, refused precisely when it cannot.

A real PS core behind a real FrameServer on 127.0.0.1; raw framed connections send the offers and
requests a confused or hostile client could send. Every refusal leaves the shard as it was and the
connection in step, and no segment outlives its connection.
"""

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server.bulk import BulkHandlers
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.ps import ParameterServerCore
from pscluster.server.store import ShardSpec

from pscluster import codec
from pscluster.net import framing, shm
from pscluster.net.bulk import BulkCall, BulkClient

pytestmark = pytest.mark.skipif(not shm.available(), reason="this host has no writable /dev/shm")
SHAPE = (392, 128)  # W2's w1 shard: 200 KB


@pytest.fixture
def ps():
    core = ParameterServerCore(0, 1)
    core.create(ShardSpec("w", 0, 1, SHAPE, SHAPE, 0, "<f4", OptimizerConfig("sgd", 1.0)),
                np.ones(SHAPE, np.float32), "zeros", 0.0, 0)
    frames = BulkHandlers(core).server("127.0.0.1", None, 1 << 16, max_payload_bytes=3 << 19).start()
    yield core, frames
    frames.stop()


def _mapped_segments():
    with open(f"/proc/{os.getpid()}/maps") as maps:
        return sum(f"/{shm.PREFIX}" in line for line in maps)


def _push(name="w", shape=SHAPE):
    return pb.PushRequest(push_id="p1", return_values=True,
                          items=[pb.PushItem(ref=pb.ShardRef(variable=name), grad=codec.header(np.float32, shape))])


def _call(conn, request, payload=b""):
    framing.send_frame(conn, request.SerializeToString(), len(payload))
    conn.sendall(payload)
    reply, payload_len = framing.read_reply(conn)
    if payload_len:
        framing.drain(conn, payload_len)
    return reply


def test_a_fused_push_pull_goes_through_the_segment_and_nothing_outlives_the_connection(ps):
    core, frames = ps
    before = _mapped_segments()
    pool = ThreadPoolExecutor(1)
    client = BulkClient(["127.0.0.1"], lambda _: frames.port, None, timeout=5.0, pool=pool, io_timeout=10.0)
    target = np.empty(SHAPE, np.float32)
    call = BulkCall(0, pb.BulkRequest(push=_push()), payloads=[np.full(SHAPE, 0.25, np.float32)], targets=[target])
    client.run([call])
    assert call.reply is not None and call.reply.shm_bytes == target.nbytes  # the values came back shared
    np.testing.assert_array_equal(target, np.full(SHAPE, 0.75, np.float32))
    np.testing.assert_array_equal(core.store.get(("w", 0)).value, target)
    assert list(call.reply.pull.versions) == [1] and list(call.reply.push.applied) == [True]
    target[:] = 0
    again = BulkCall(0, pb.BulkRequest(push=_push()), payloads=[np.full(SHAPE, 0.25, np.float32)], targets=[target])
    client.run([again])  # the same push id again (a retry): not applied twice, the current values come back
    assert again.reply is not None and list(again.reply.push.applied) == [False]
    np.testing.assert_array_equal(target, np.full(SHAPE, 0.75, np.float32))
    assert _mapped_segments() == before + 2  # this client's mapping and the PS's
    assert not [n for n in os.listdir(shm.DIRECTORY) if n.startswith(f"{shm.PREFIX}{os.getpid()}-")]
    client.close()
    pool.shutdown()
    deadline = time.monotonic() + 5
    while _mapped_segments() != before and time.monotonic() < deadline:
        time.sleep(0.02)  # the PS's connection thread sees the hang-up and unmaps
    assert _mapped_segments() == before


def test_an_offer_the_ps_refuses_leaves_the_connection_carrying_its_payloads(ps):
    core, frames = ps
    pool = ThreadPoolExecutor(1)
    client = BulkClient(["127.0.0.1"], lambda _: frames.port, None, timeout=5.0, pool=pool, io_timeout=10.0)
    try:
        shape = (600, 512)  # 1.2 MB: its segment (2 MiB) exceeds this PS's 1.5 MiB payload limit
        core.create(ShardSpec("big", 0, 1, shape, shape, 0, "<f4", OptimizerConfig("sgd", 1.0)),
                    np.zeros(shape, np.float32), "zeros", 0.0, 0)
        target = np.empty(shape, np.float32)
        call = BulkCall(0, pb.BulkRequest(push=_push("big", shape)), payloads=[np.ones(shape, np.float32)],
                        targets=[target])
        client.run([call])
        assert call.reply is not None and call.reply.shm_bytes == 0
        np.testing.assert_array_equal(target, -np.ones(shape, np.float32))
        assert [(c.local, c.segment) for c in client._free[0]] == [(False, None)]  # not offered again
    finally:
        client.close()
        pool.shutdown()


def test_bad_offers_and_shared_payloads_without_a_segment_are_refused_and_change_nothing(ps):
    core, frames = ps
    with socket.create_connection(("127.0.0.1", frames.port), timeout=10) as conn:
        framing.send_hello(conn, None)
        # a name outside pscluster's segments, and a real file that holds another nonce
        reply = _call(conn, pb.BulkRequest(shm_attach=pb.ShmAttach(name="../../etc/passwd", nonce=bytes(16),
                                                                   size=shm.size_for(1))))
        assert framing.STATUS_BY_VALUE[reply.code].name == "FAILED_PRECONDITION"
        segment, nonce = shm.Segment.create(shm.size_for(1))
        try:
            offer = pb.ShmAttach(name=segment.name, nonce=bytes(16), size=shm.HEADER_BYTES + segment.capacity)
            reply = _call(conn, pb.BulkRequest(shm_attach=offer))
            assert framing.STATUS_BY_VALUE[reply.code].name == "FAILED_PRECONDITION"
            assert "another host" in reply.message
        finally:
            shm.unlink(segment.name)
            segment.close()
        # a push that says its payload is shared, on a connection without a segment
        reply = _call(conn, pb.BulkRequest(push=_push(), shm_bytes=SHAPE[0] * SHAPE[1] * 4))
        assert framing.STATUS_BY_VALUE[reply.code].name == "INVALID_ARGUMENT"
        assert "attached segment" in reply.message
        # ... and one that sends bytes on the socket too: drained, refused, the stream stays in step
        reply = _call(conn, pb.BulkRequest(push=_push(), shm_bytes=8), payload=bytes(SHAPE[0] * SHAPE[1] * 4))
        assert framing.STATUS_BY_VALUE[reply.code].name == "INVALID_ARGUMENT"
        reply = _call(conn, pb.BulkRequest(pull=pb.PullRequest(items=[pb.PullItem(ref=pb.ShardRef(variable="w"))])))
        assert reply.code == 0 and reply.pull.versions[0] == 0
    shard = core.store.get(("w", 0))
    assert shard.version == 0
    np.testing.assert_array_equal(shard.value, np.ones(SHAPE, np.float32))


def test_a_segment_that_cannot_be_allocated_leaves_the_connection_on_the_socket(ps, tmp_path, monkeypatch):
    core, frames = ps
    pool = ThreadPoolExecutor(1)
    client = BulkClient(["127.0.0.1"], lambda _: frames.port, None, timeout=5.0, pool=pool, io_timeout=10.0)
    monkeypatch.setattr(shm, "DIRECTORY", str(tmp_path / "missing"))  # as full or absent as /dev/shm gets
    try:
        target = np.empty(SHAPE, np.float32)
        call = BulkCall(0, pb.BulkRequest(push=_push()), payloads=[np.full(SHAPE, 0.5, np.float32)],
                        targets=[target])
        client.run([call])
        assert call.reply is not None and call.reply.shm_bytes == 0
        np.testing.assert_array_equal(target, np.full(SHAPE, 0.5, np.float32))
        assert [(c.local, c.segment) for c in client._free[0]] == [(False, None)]
    finally:
        client.close()
        pool.shutdown()
