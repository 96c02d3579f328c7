"""Peers without the token cannot exhaust a framed port, and authenticated ones cannot make it allocate
what they merely announce: real sockets against an in-process PS (server/bulk.py over frame_server.FrameServer).
"""

import logging
import socket
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server.bulk import BulkHandlers
from pscluster.server.ps import ParameterServerCore

from pscluster import errors
from pscluster.net import rpc
from pscluster.net.admission import ConnectionBudget
from pscluster.net.bulk import BulkCall, BulkClient
from pscluster.net.framing import PREFIX, STATUS_BY_VALUE, read_reply, send_hello
from pscluster.net.refusals import RefusalLog
from pscluster.specs import OptimizerConfig, ShardSpec

TOKEN = "s3cret"
BOUND_S = 20.0


def _core() -> ParameterServerCore:
    core = ParameterServerCore(0, 1)
    core.create(ShardSpec("w", 0, 1, (4, 2), (4, 2), 0, "<f4", OptimizerConfig("sgd", 1.0)), None, "ones", 0.0, 0)
    return core


def _wait_until(condition, what):
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"not reached within {BOUND_S} s: {what}"
        threading.Event().wait(0.005)


def _client(port, token=TOKEN):
    pool = futures.ThreadPoolExecutor(2)
    return BulkClient(["127.0.0.1"], lambda _: port, token, 5.0, pool, io_timeout=5.0), pool


def _pull(client):
    call = BulkCall(0, pb.BulkRequest(pull=pb.PullRequest(items=[pb.PullItem(ref=pb.ShardRef(variable="w"))])),
                    targets=[np.empty((4, 2), np.float32)])
    client.run([call])
    return call.targets[0]


def _rss_mib():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024


def test_idle_unauthenticated_connections_are_refused_beyond_the_budget_and_time_out():
    budget = ConnectionBudget(max_connections=64, per_peer=64, unauthenticated=4)
    frames = BulkHandlers(_core()).server("127.0.0.1", TOKEN, 1 << 20, budget=budget, auth_timeout_s=1.0).start()
    client, pool = _client(frames.port)
    idle = [socket.create_connection(("127.0.0.1", frames.port), timeout=BOUND_S) for _ in range(4)]
    try:
        _wait_until(lambda: budget.counts()[1] == 4, "4 connections waiting to authenticate")
        with socket.create_connection(("127.0.0.1", frames.port), timeout=BOUND_S) as fifth:
            reply, _ = read_reply(fifth)  # refused at once, without a thread
        assert STATUS_BY_VALUE[reply.code] == grpc.StatusCode.UNAVAILABLE
        assert "too many connections still authenticating (4)" in reply.message
        with pytest.raises(errors.UnavailableError) as info:
            _pull(client)  # the answer, or a reset when the refusal closes on the client's bytes in flight
        assert info.value.retryable  # either way retryable: callers back off and try again
        # the idle ones get auth_timeout_s to send a token, then their slots are free again
        _wait_until(lambda: budget.counts() == (0, 0, 0), "the idle connections to be closed")
        np.testing.assert_array_equal(_pull(client), np.ones((4, 2), np.float32))
        assert budget.counts()[:2] == (1, 0)  # the client's one authenticated connection
    finally:
        for sock in idle:
            sock.close()
        client.close()
        pool.shutdown()
        frames.stop()


def test_an_unauthenticated_64_mib_header_is_refused_unread():
    frames = BulkHandlers(_core()).server("127.0.0.1", TOKEN, 64 << 20).start()
    before = _rss_mib()
    try:
        conns = [socket.create_connection(("127.0.0.1", frames.port), timeout=BOUND_S) for _ in range(8)]
        replies = []
        for conn in conns:
            conn.sendall(PREFIX.pack(64 << 20, 0) + b"\0" * 4096)
        for conn in conns:
            replies.append(read_reply(conn)[0])
            conn.close()
        assert {STATUS_BY_VALUE[r.code] for r in replies} == {grpc.StatusCode.UNAUTHENTICATED}
        assert "first frame must authenticate within 4096 header bytes" in replies[0].message
        assert _rss_mib() - before < 32  # 8 x 64 MiB announced, nothing of it allocated
    finally:
        frames.stop()


def test_an_announced_payload_is_not_allocated_before_it_arrives():
    frames = BulkHandlers(_core()).server("127.0.0.1", TOKEN, 1 << 20, io_timeout_s=0.5).start()
    before = _rss_mib()
    try:
        with socket.create_connection(("127.0.0.1", frames.port), timeout=BOUND_S) as conn:
            send_hello(conn, TOKEN)
            raw = pb.BulkRequest(pull=pb.PullRequest()).SerializeToString()
            conn.sendall(PREFIX.pack(len(raw), 2 << 30) + raw + b"\0" * (1 << 20))  # 2 GiB announced, 1 MiB sent
            _wait_until(lambda: frames.connections == 0, "the stalled sender's connection to be closed")
        assert _rss_mib() - before < 64
    finally:
        frames.stop()


def test_an_idle_authenticated_connection_is_closed_after_idle_timeout_and_the_client_reconnects():
    frames = BulkHandlers(_core()).server("127.0.0.1", TOKEN, 1 << 20, idle_timeout_s=0.3).start()
    client, pool = _client(frames.port)
    try:
        _pull(client)
        _wait_until(lambda: frames.connections == 0, "the idle connection to be closed")
        with pytest.raises(errors.UnavailableError):
            _pull(client)  # the pooled connection is gone: a retryable failure ...
        np.testing.assert_array_equal(_pull(client), np.ones((4, 2), np.float32))  # ... then a fresh one
    finally:
        client.close()
        pool.shutdown()
        frames.stop()


def test_refusals_are_logged_once_per_interval_with_a_count(caplog):
    log = logging.getLogger("test.refusals")
    refusals = RefusalLog(log, every_s=3600)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        for _ in range(1000):
            refusals.note("bulk connection", "missing or wrong token")
        refusals.note("/pscluster.ParameterServer/Push", "missing or wrong token")
    assert [r.getMessage() for r in caplog.records] == [
        "refused bulk connection: missing or wrong token",
        "refused /pscluster.ParameterServer/Push: missing or wrong token"]


def test_grpc_calls_without_the_token_are_refused_unparsed_in_one_line(caplog, tmp_path):
    from pscluster.proto import pscluster_pb2_grpc as pb_grpc
    from pscluster.server.servicer import ParameterServerServicer

    from pscluster.config import load_settings

    (tmp_path / "c.yaml").write_text("cluster: {ps: ['127.0.0.1:1']}\n")
    settings = load_settings(tmp_path / "c.yaml", env={"PSCLUSTER_TOKEN": TOKEN})
    servicer = ParameterServerServicer(_core(), 1 << 20)
    server, port = rpc.create_server(settings, lambda s: pb_grpc.add_ParameterServerServicer_to_server(servicer, s),
                                     address="127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    garbage = channel.unary_unary("/pscluster.ParameterServer/Push", request_serializer=None,
                                  response_deserializer=None)
    try:
        with caplog.at_level(logging.DEBUG):
            for _ in range(50):
                with pytest.raises(grpc.RpcError) as info:
                    garbage(b"\x08\xff\xff\xff garbage \x00" * 100, timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(lines) == 1 and "refused /pscluster.ParameterServer/Push" in lines[0].getMessage()
        assert not any(r.exc_info for r in caplog.records)
    finally:
        channel.close()
        server.stop(None).wait(5)
