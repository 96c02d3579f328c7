"""Every error class round-trips over both transports, mapped once at each server's boundary.

A handler raises; the framed server (bulk tensors, closures, sync tokens) and the gRPC interceptor
each turn it into a status code, and the client turns the code back into the same class. An
unexpected exception becomes INTERNAL with its message, and the framed connection stays usable.
"""

import logging
import socket
from concurrent import futures

import grpc
import pytest
from pscluster.proto import pscluster_pb2 as pb

from pscluster import errors
from pscluster.net import framing, rpc
from pscluster.net.frame_server import FrameServer

CLASSES = sorted(set(errors.ERRORS_BY_CODE.values()), key=lambda c: c.__name__)


class Boom(Exception):
    pass


def _raising(request_kinds):
    def handler(conn, request, payload_len, state):
        framing.refuse_payload(conn, payload_len, "test")
        name = request.pull.items[0].ref.variable
        if name == "ok":
            framing.send_frame(conn, pb.BulkReply(pull=pb.PullReply()).SerializeToString())
            return
        cls = Boom if name == "Boom" else getattr(errors, name)
        raise cls(f"raised {name}")
    return {kind: handler for kind in request_kinds}


@pytest.fixture
def frame_server():
    server = FrameServer("127.0.0.1", None, _raising(["pull"]), 1 << 16, name="test").start()
    yield server
    server.stop()


def _framed_call(conn, name, payload=b""):
    request = pb.BulkRequest(pull=pb.PullRequest(items=[pb.PullItem(ref=pb.ShardRef(variable=name))]))
    framing.send_frame(conn, request.SerializeToString(), len(payload))
    conn.sendall(payload)
    reply, payload_len = framing.read_reply(conn)
    assert payload_len == 0
    if not reply.code:
        return None
    return errors.from_status(framing.STATUS_BY_VALUE[reply.code], reply.message)


def test_every_error_class_round_trips_over_the_framed_transport(frame_server, caplog):
    with socket.create_connection(("127.0.0.1", frame_server.port), timeout=10) as conn:
        for cls in CLASSES:
            err = _framed_call(conn, cls.__name__)
            assert type(err) is cls and f"raised {cls.__name__}" in str(err)
        with caplog.at_level(logging.ERROR, logger="pscluster.net.frame_server"):
            err = _framed_call(conn, "Boom")
        assert type(err) is errors.InternalError and "Boom: raised Boom" in str(err)
        assert "test pull request failed" in caplog.text
        # a payload where none belongs is drained and refused; the stream stays in step
        err = _framed_call(conn, "ok", payload=b"x" * 1000)
        assert type(err) is errors.InvalidArgumentError and "carries no payload" in str(err)
        assert _framed_call(conn, "ok") is None  # the same connection still serves
    assert frame_server.connections in (0, 1)


@pytest.fixture
def grpc_channel():
    def raise_named(request, context):
        name = request.decode()
        raise (Boom if name == "Boom" else getattr(errors, name))(f"raised {name}")

    handler = grpc.method_handlers_generic_handler("test.Errors", {
        "Raise": grpc.unary_unary_rpc_method_handler(raise_named, request_deserializer=bytes,
                                                     response_serializer=bytes)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[rpc.ErrorInterceptor(None)],
                         handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel.unary_unary("/test.Errors/Raise", request_serializer=bytes, response_deserializer=bytes)
    channel.close()
    server.stop(None).wait(5)


def _grpc_call(call, name):
    with pytest.raises(grpc.RpcError) as info:
        call(name.encode(), timeout=10)
    return errors.from_status(info.value.code(), info.value.details())


def test_every_error_class_round_trips_over_grpc(grpc_channel, caplog):
    for cls in CLASSES:
        err = _grpc_call(grpc_channel, cls.__name__)
        assert type(err) is cls and f"raised {cls.__name__}" in str(err)
    with caplog.at_level(logging.ERROR, logger="pscluster.net.rpc"):
        err = _grpc_call(grpc_channel, "Boom")
    assert type(err) is errors.InternalError and "Boom: raised Boom" in str(err)
