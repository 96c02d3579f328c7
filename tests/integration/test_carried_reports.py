"""A take that carries earlier closures' reports (TokenRequest.reports) over both transports: a real PS core
behind its bulk FrameServer and its gRPC servicer on 127.0.0.1; the reports count before the take, once."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc
from pscluster.server.bulk import BulkHandlers
from pscluster.server.ps import ParameterServerCore
from pscluster.server.servicer import ParameterServerServicer
from pscluster.server.sync_replicas import attach

from pscluster.config import load_settings
from pscluster.net import rpc
from pscluster.net.bulk import BulkCall, BulkClient


def _take(cid, worker, reports=()):
    return pb.TokenRequest(closure_id=cid, worker=worker, timeout_s=5.0,
                           reports=[pb.StepDoneRequest(closure_id=c, step=s, worker=w) for c, s, w in reports])


@pytest.fixture
def core():
    core = ParameterServerCore(0, 1)
    attach(core).configure("sync", 2, 2, 0)
    return core


def _check(take, core):
    assert (take(_take(1, "w1")).step, take(_take(2, "w2")).step) == (0, 0)
    reply = take(_take(3, "w1", [(1, 0, "w1"), (2, 0, "w2")]))  # step 0 is made by the carried reports
    assert (reply.step, reply.replica, core.global_step) == (1, 0, 1)
    reply = take(_take(3, "w1", [(1, 0, "w1"), (2, 0, "w2")]))  # the retry: same token, reports counted once
    assert (reply.step, reply.replica, core.global_step) == (1, 0, 1)


def test_the_bulk_path_carries_reports_with_a_take(core):
    frames = BulkHandlers(core).server("127.0.0.1", None, 1 << 16).start()
    pool = ThreadPoolExecutor(2)
    client = BulkClient(["127.0.0.1"], lambda _: frames.port, None, timeout=5.0, pool=pool, io_timeout=10.0)

    def take(request):
        call = BulkCall(0, pb.BulkRequest(take_token=request), wait_s=request.timeout_s)
        client.run([call])
        return call.reply.token

    try:
        _check(take, core)
    finally:
        client.close()
        frames.stop()
        pool.shutdown()


def test_the_grpc_path_carries_reports_with_a_take(core, tmp_path):
    (tmp_path / "c.yaml").write_text("cluster: {ps: ['127.0.0.1:1']}\n")
    servicer = ParameterServerServicer(core, 1 << 20)
    server, port = rpc.create_server(load_settings(tmp_path / "c.yaml", env={}),
                                     lambda s: pb_grpc.add_ParameterServerServicer_to_server(servicer, s),
                                     address="127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ParameterServerStub(channel)
    try:
        _check(lambda request: stub.TakeToken(request, timeout=10), core)
    finally:
        channel.close()
        server.stop(None).wait(5)
