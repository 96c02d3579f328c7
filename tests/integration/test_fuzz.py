"""Property-based tests of every decoder a peer can feed: tensors, framed headers and streams,
protobuf requests into the PS core. Whatever arrives, the answer is a status code (a PsclusterError)
or a closed connection, never a crashed thread, and nothing changes unless the request was valid.

Bounded: a few hundred examples in all, no per-example deadline (2 shared cores), well under 20 s.
"""

import socket
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server.bulk import BulkHandlers
from pscluster.server.ps import ParameterServerCore
from pscluster.server.servicer import ParameterServerServicer

from pscluster import codec
from pscluster.errors import PsclusterError
from pscluster.net.framing import PREFIX, read_reply, send_hello
from pscluster.specs import OptimizerConfig, ShardSpec

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
DTYPES = st.sampled_from(["<f4", "<f8", "<i8", "|u1", ">f4", "bool", "object", "", "<U3", "f4", "garbage"])
SHAPES = st.lists(st.one_of(st.integers(-3, 9), st.integers(-(1 << 63), (1 << 63) - 1)), max_size=4)
TOKEN = "fuzz-token"


def _core():
    core = ParameterServerCore(0, 1, max_tensor_bytes=1 << 30)
    core.create(ShardSpec("w", 0, 1, (4, 2), (4, 2), 0, "<f4", OptimizerConfig("sgd", 1.0)), None, "ones", 0.0, 0)
    core.create(ShardSpec("t", 0, 1, (8, 2), (8, 2), 0, "<f4", OptimizerConfig("sgd", 1.0), sparse=True),
                None, "ones", 0.0, 0)
    return core


def _state(core):
    return {k: (s.value.copy(), s.version) for k, s in ((("w", 0), core.store.get(("w", 0))),
                                                         (("t", 0), core.store.get(("t", 0))))}


@FUZZ
@given(dtype=DTYPES, shape=SHAPES, data=st.binary(max_size=64))
def test_tensor_decoding_returns_a_matching_array_or_invalid_argument(dtype, shape, data):
    msg = pb.Tensor(dtype=dtype, data=data)
    msg.shape.extend(shape)
    try:
        arr = codec.decode(msg)
    except PsclusterError as err:
        assert err.code.name == "INVALID_ARGUMENT"
        return
    assert arr.nbytes == len(data) and list(arr.shape) == shape


@st.composite
def push_requests(draw):
    items = []
    for _ in range(draw(st.integers(0, 3))):
        grad = pb.Tensor(dtype=draw(DTYPES), data=draw(st.binary(max_size=80)))
        grad.shape.extend(draw(SHAPES))
        item = pb.PushItem(ref=pb.ShardRef(variable=draw(st.sampled_from(["w", "t", "nope", ""])),
                                           shard_index=draw(st.integers(-1, 2))), grad=grad)
        if draw(st.booleans()):
            ids = pb.Tensor(dtype=draw(st.sampled_from(["<i8", "<i4", "<f8"])), data=draw(st.binary(max_size=32)))
            ids.shape.extend(draw(SHAPES))
            item.ids.CopyFrom(ids)
        items.append(item)
    return pb.PushRequest(items=items, push_id=draw(st.text(max_size=12)), step=draw(st.integers(-2, 2)),
                          final_below=draw(st.integers(0, 1 << 62)))


@pytest.fixture(scope="module")
def servicer():
    return ParameterServerServicer(_core(), 1 << 20)


@FUZZ
@given(request=push_requests())
def test_push_requests_into_the_ps_core_apply_whole_or_change_nothing(servicer, request):
    core = servicer.core
    before = _state(core)
    try:
        reply = servicer.Push(request, None)
    except PsclusterError:
        after = _state(core)
        for key in before:  # a refused request changed nothing at all
            np.testing.assert_array_equal(after[key][0], before[key][0])
            assert after[key][1] == before[key][1]
        return
    assert len(reply.versions) == len(request.items)


@FUZZ
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes_as_a_pull_request_are_refused_or_served(servicer, raw):
    request = pb.PullRequest()
    try:
        request.ParseFromString(raw)
    except Exception:  # noqa: BLE001 - grpcio answers an unparsable message itself
        return
    try:
        servicer.Pull(request, None)
    except PsclusterError:
        pass


@pytest.fixture(scope="module")
def bulk_port():
    frames = BulkHandlers(_core()).server("127.0.0.1", TOKEN, 1 << 16, io_timeout_s=0.2, auth_timeout_s=0.2).start()
    yield frames
    frames.stop()


def _exchange(port, frames_bytes, hello):
    """Send bytes on a fresh connection (after a hello if asked); the first reply, or None if it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        try:
            if hello:
                send_hello(conn, TOKEN)
            conn.sendall(frames_bytes)
            conn.shutdown(socket.SHUT_WR)
            return read_reply(conn)[0]
        except (ConnectionError, struct.error, OSError):  # the server may answer and close before we finish
            return None


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=300), hello=st.booleans(),
       header_len=st.one_of(st.none(), st.integers(0, (1 << 32) - 1)), payload_len=st.integers(0, (1 << 64) - 1))
def test_framed_streams_of_any_bytes_get_a_status_or_a_close_and_the_port_stays_up(bulk_port, raw, hello,
                                                                                     header_len, payload_len):
    prefix = PREFIX.pack(header_len if header_len is not None else len(raw), payload_len) if hello else b""
    reply = _exchange(bulk_port.port, prefix + raw, hello)
    if reply is not None:
        assert reply.code != 0 or reply.HasField("pull") or reply.HasField("push")
    # the port still serves a real client, and the shard is untouched by anything unauthenticated
    good = pb.BulkRequest(pull=pb.PullRequest(items=[pb.PullItem(ref=pb.ShardRef(variable="w"))]))
    raw_good = good.SerializeToString()
    with socket.create_connection(("127.0.0.1", bulk_port.port), timeout=5) as conn:
        send_hello(conn, TOKEN)
        conn.sendall(PREFIX.pack(len(raw_good), 0) + raw_good)
        answer, payload_len = read_reply(conn)
        assert answer.code == 0 and payload_len == 32
