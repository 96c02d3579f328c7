"""Bulk pulls and pushes mixing small and large tensors in one request: bytes land in the right place.

Small parts travel together with the frame's head (one send); a part that does not fit the PS's 1 MiB
copy buffer is sent piece by piece, and small parts after it are staged again. Real sockets, in-process PS;
both with payloads on the socket and through a same-host shared-memory segment.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server.bulk import BulkHandlers
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.ps import ParameterServerCore
from pscluster.server.store import ShardSpec

from pscluster import codec
from pscluster.net.bulk import BulkCall, BulkClient

SHAPES = {"a": (3,), "big": (768, 1024), "b": (5, 4), "huge": (1024, 600), "c": ()}  # 3 MiB, 2.3 MiB


@pytest.mark.parametrize("shared_memory", [False, True])
def test_a_pull_and_a_push_mixing_small_and_large_shards_and_rows_move_every_byte_in_order(shared_memory):
    core = ParameterServerCore(0, 1)
    rng = np.random.default_rng(0)
    values = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    for name, value in values.items():
        core.create(ShardSpec(name, 0, 1, value.shape, value.shape, 0, "<f4", OptimizerConfig("sgd", 1.0)),
                    value.copy(), "zeros", 0.0, 0)
    frames = BulkHandlers(core).server("127.0.0.1", None, 1 << 20).start()
    pool = ThreadPoolExecutor(2)
    client = BulkClient(["127.0.0.1"], lambda ps: frames.port, None, timeout=5.0, pool=pool, io_timeout=20.0,
                        shared_memory=shared_memory)
    try:
        ids = np.array([700, 3, 3, 511], np.int64)
        items = [pb.PullItem(ref=pb.ShardRef(variable=name)) for name in SHAPES]
        items.insert(2, pb.PullItem(ref=pb.ShardRef(variable="big"), ids=codec.encode(ids)))
        targets = [np.empty(shape, np.float32) for shape in SHAPES.values()]
        targets.insert(2, np.empty((4, 1024), np.float32))
        client.run([BulkCall(0, pb.BulkRequest(pull=pb.PullRequest(items=items)), targets=targets)])
        for name, got in zip(SHAPES, targets[:2] + targets[3:]):
            np.testing.assert_array_equal(got, values[name])
        np.testing.assert_array_equal(targets[2], values["big"][ids])

        grads = {name: np.full(shape, 0.5, np.float32) for name, shape in SHAPES.items()}
        push = pb.PushRequest(push_id="p1", items=[pb.PushItem(ref=pb.ShardRef(variable=name),
                                                              grad=codec.header(g.dtype, g.shape))
                                                   for name, g in grads.items()])
        call = BulkCall(0, pb.BulkRequest(push=push), payloads=list(grads.values()))
        client.run([call])
        assert call.reply is not None and list(call.reply.push.applied) == [True] * len(SHAPES)
        for name in SHAPES:
            np.testing.assert_array_equal(core.store.get((name, 0)).value, values[name] - 0.5)
        segments = [conn.segment for conn in client._free[0]]
        assert all(s is not None for s in segments) if shared_memory else segments == [None]
    finally:
        client.close()
        frames.stop()
        pool.shutdown()


def test_an_error_reply_with_a_payload_is_skipped_through_the_reader_and_the_stream_stays_in_step():
    import socket
    import threading

    from pscluster.net.bulk import READ_BUFFER_BYTES, _Conn
    from pscluster.net.framing import send_frame

    ours, theirs = socket.socketpair()
    conn = _Conn(ours, local=False)
    junk = 3 * READ_BUFFER_BYTES + 17  # more than one buffer: skipped a buffer's worth at a time
    sender = threading.Thread(target=lambda: (theirs.sendall(b"x" * junk),
                                              send_frame(theirs, pb.BulkReply(message="next").SerializeToString())))
    sender.start()
    conn.skip(junk)
    reply, payload_len = conn.read_reply()
    sender.join(timeout=5)
    assert reply.message == "next" and payload_len == 0
    conn.close()
    theirs.close()
