"""Two real PS daemons on 127.0.0.1: variables, sharding, sparse rows, bad input, auth, kill + restore."""

import subprocess
import sys

import grpc
import numpy as np
import pytest
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc

import pscluster as ps
from pscluster import codec
from pscluster.errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    InvalidArgumentError,
    UnauthenticatedError,
    from_status,
)
from pscluster.net.rpc import TOKEN_KEY
from pscluster.ops.launcher import LocalCluster

TOKEN = "test-token-4f1c"
pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(2, 0, workdir=tmp_path_factory.mktemp("ps"), token=TOKEN, supervise=False)
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with ps.PSClient(cluster.settings()) as c:
        yield c


def raw_stub(cluster, ps_index=0, token=TOKEN, max_send=64 << 20):
    channel = grpc.insecure_channel(cluster.spec["ps"][ps_index],
                                    options=[("grpc.max_send_message_length", max_send)])
    return channel, pb_grpc.ParameterServerStub(channel), ((TOKEN_KEY, token),) if token else ()


def test_dense_variable_sharded_round_robin_over_both_ps(cluster, client):
    init = np.arange(40, dtype=np.float32).reshape(10, 4)
    w = client.create_variable("dense", initial_value=init, partitioner=ps.FixedShardsPartitioner(3),
                               optimizer=ps.SGD(0.5))
    assert [pl.ps for pl in w.shards] == [(pl.ordinal) % 2 for pl in w.shards]
    assert {pl.ps for pl in w.shards} == {0, 1}
    np.testing.assert_array_equal(client.pull([w])[0], init)
    client.push([(w, np.ones((10, 4)))])
    np.testing.assert_allclose(client.pull([w])[0], init - 0.5)
    per_ps = [{(s.spec.variable, s.spec.shard_index) for s in stub.ListShards(pb.ListShardsRequest(),
               metadata=((TOKEN_KEY, TOKEN),)).shards} for _, stub, _ in (raw_stub(cluster, i) for i in range(2))]
    assert ("dense", 1) in per_ps[1 - w.shards[0].ps] and ("dense", 0) in per_ps[w.shards[0].ps]


def test_every_numeric_dtype_round_trips(client):
    for dt in ["float16", "float32", "float64", "int8", "int32", "int64", "uint16"]:
        v = client.create_variable(f"dt_{dt}", initial_value=np.arange(6).astype(dt).reshape(2, 3))
        got = client.pull([v])[0]
        assert got.dtype == np.dtype(dt) and got.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_sparse_rows_only_touched_rows_change(client):
    emb = client.create_variable("emb", shape=(20, 3), sparse=True, partitioner=ps.FixedShardsPartitioner(2),
                                 optimizer=ps.Adagrad(0.1), initializer="ones")
    client.push_rows(emb, [3, 17, 17], np.ones((3, 3)))
    table = client.pull([emb])[0]
    changed = np.flatnonzero((table != 1).any(axis=1))
    assert changed.tolist() == [3, 17]
    np.testing.assert_array_equal(client.pull_rows(emb, [17, 0, 3]), table[[17, 0, 3]])


def test_create_is_idempotent_and_conflicts_are_clear(client):
    a = client.create_variable("idem", shape=(4,), optimizer=ps.SGD(1.0))
    assert client.create_variable("idem", shape=(4,), optimizer=ps.SGD(1.0)) == a
    with pytest.raises(AlreadyExistsError, match="cannot redefine"):
        client.create_variable("idem", shape=(5,))
    with pytest.raises(AlreadyExistsError, match="optimizer 'sgd'; cannot re-create it with 'adam'"):
        client.create_variable("idem", shape=(4,), optimizer=ps.Adam(0.1))
    # a second client (say a restarted coordinator) discovers the same variable and placement
    with ps.PSClient(client.settings) as other:
        assert other.discover()["idem"] == a
        with pytest.raises(AlreadyExistsError, match="optimizer 'sgd'; cannot re-create it with 'adam'"):
            other.create_variable("idem", shape=(4,), optimizer=ps.Adam(0.1))
        assert other.create_variable("idem", shape=(4,), optimizer=ps.SGD(0.5)) == a  # another rate: the same


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk-tcp", "grpc-streams"])
def test_large_variable_moves_whole(cluster, bulk):
    # 24 MiB shards: over the gRPC path they exceed the 16 MiB unary threshold and travel as streams
    with ps.PSClient(cluster.settings(bulk_transport=bulk)) as c:
        big = c.create_variable(f"big_{bulk}", shape=(2 * 6 * 1024 * 1024 // 4, 8), dtype="float32",
                                partitioner=ps.FixedShardsPartitioner(2), optimizer=ps.SGD(1.0), initializer="ones")
        grad = np.random.default_rng(0).random(big.shape, dtype=np.float32)
        c.push([(big, grad)])
        np.testing.assert_array_equal(c.pull([big])[0], 1 - grad)


def _state(client, name):
    var = client.variables()[name]
    versions = [info.version for ps_i in range(2) for info in
                client.stubs[ps_i].ListShards(pb.ListShardsRequest(), metadata=((TOKEN_KEY, TOKEN),)).shards
                if info.spec.variable == name]
    return client.pull([var])[0], versions


def _push(var, grad=None, ids=None, dtype="<f4", shape=(6, 2), data=None):
    g = pb.Tensor(dtype=dtype, shape=list(shape), data=data if data is not None else
                  (grad if grad is not None else np.ones(shape, np.dtype(dtype))).tobytes())
    item = pb.PushItem(ref=pb.ShardRef(variable=var, shard_index=0), grad=g)
    if ids is not None:
        item.ids.CopyFrom(codec.encode(np.asarray(ids, np.int64)))
    return pb.PushRequest(items=[item], push_id="bad")


BAD = {
    "wrong shape": (_push("target", shape=(5, 2)), grpc.StatusCode.INVALID_ARGUMENT, "shape"),
    "wrong dtype": (_push("target", dtype="<f8"), grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
    "unknown variable": (_push("nope"), grpc.StatusCode.NOT_FOUND, "unknown variable"),
    "negative row id": (_push("table", ids=[-1], shape=(1, 2)), grpc.StatusCode.INVALID_ARGUMENT, "row id -1"),
    "row id out of range": (_push("table", ids=[6], shape=(1, 2)), grpc.StatusCode.INVALID_ARGUMENT, "row id 6"),
    "nan gradient": (_push("target", grad=np.full((6, 2), np.nan, np.float32)), grpc.StatusCode.INVALID_ARGUMENT, "NaN"),
    "truncated tensor": (_push("target", data=b"\0" * 10), grpc.StatusCode.INVALID_ARGUMENT, "do not hold"),
    "non-numeric dtype": (_push("target", dtype="|O"), grpc.StatusCode.INVALID_ARGUMENT, "not numeric"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_push_gets_precise_status_and_changes_nothing(cluster, client, case):
    for name in ("target", "table"):  # both on PS 0: single-shard variables created first on a fresh client
        client.create_variable(name, shape=(6, 2), optimizer=ps.SGD(1.0), sparse=name == "table",
                               initializer="ones")
    request, code, text = BAD[case]
    target_ps = client.variables()[request.items[0].ref.variable].shards[0].ps \
        if request.items[0].ref.variable in client.variables() else 0
    before = [_state(client, n) for n in ("target", "table")]
    _, stub, md = raw_stub(cluster, target_ps)
    with pytest.raises(grpc.RpcError) as info:
        stub.Push(request, metadata=md, timeout=10)
    assert info.value.code() == code and text in info.value.details()
    after = [_state(client, n) for n in ("target", "table")]
    for (v0, ver0), (v1, ver1) in zip(before, after):
        np.testing.assert_array_equal(v0, v1)
        assert ver0 == ver1


def test_oversized_message_is_rejected_with_resource_exhausted(cluster, client):
    v = client.create_variable("sized", shape=(4,), optimizer=ps.SGD(1.0))
    _, stub, md = raw_stub(cluster, v.shards[0].ps, max_send=200 << 20)
    huge = pb.PushRequest(items=[pb.PushItem(ref=pb.ShardRef(variable="sized"),
                                             grad=pb.Tensor(dtype="<f4", shape=[17 << 20], data=bytes(68 << 20)))])
    with pytest.raises(grpc.RpcError) as info:
        stub.Push(huge, metadata=md, timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.pull([v])[0].tolist() == [0, 0, 0, 0]


def test_malformed_bytes_are_rejected(cluster):
    md = ((TOKEN_KEY, TOKEN),)
    raw = grpc.insecure_channel(cluster.spec["ps"][0]).unary_unary(
        "/pscluster.ParameterServer/Push", request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\xff\xff\xff\xff garbage", metadata=md, timeout=10)
    # grpcio rejects an undecodable request before any handler runs
    assert info.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)


def test_bad_partitioner_or_spec_is_rejected(cluster, client):
    with pytest.raises(InvalidArgumentError, match="num_shards must be >= 1"):
        client.create_variable("parts", shape=(4, 2), partitioner=ps.FixedShardsPartitioner(0))
    _, stub, md = raw_stub(cluster)
    spec = pb.ShardSpec(variable="evil", shard_index=3, num_shards=2, full_shape=[4], shape=[2], dtype="<f4",
                        optimizer=pb.OptimizerSpec(kind="sgd", learning_rate=0.1))
    with pytest.raises(grpc.RpcError) as info:
        stub.CreateShard(pb.CreateShardRequest(spec=spec), metadata=md, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "shard_index 3" in info.value.details()
    assert "evil" not in client.discover()


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_unauthenticated_calls_are_rejected_and_change_nothing(cluster, client, token):
    v = client.create_variable("guarded", shape=(3,), optimizer=ps.SGD(1.0))
    _, stub, md = raw_stub(cluster, v.shards[0].ps, token=token)
    push = pb.PushRequest(items=[pb.PushItem(ref=pb.ShardRef(variable="guarded"), grad=codec.encode(np.ones(3, np.float32)))])
    for method, request in [(stub.Push, push), (stub.ListShards, pb.ListShardsRequest()),
                            (stub.Save, pb.SaveRequest(step=1))]:
        with pytest.raises(grpc.RpcError) as info:
            method(request, metadata=md, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert client.pull([v])[0].tolist() == [0, 0, 0]



@pytest.mark.parametrize("bulk_transport", [True, False])
def test_a_client_with_the_wrong_token_gets_one_clear_error(cluster, client, bulk_transport):
    v = client.create_variable("guarded_too", shape=(3,), optimizer=ps.SGD(1.0))
    settings = cluster.settings(token="not-the-token", bulk_transport=bulk_transport)
    with ps.PSClient(settings) as wrong:
        with pytest.raises(UnauthenticatedError, match="PSCLUSTER_TOKEN_FILE, PSCLUSTER_TOKEN or token_file") as info:
            wrong.pull([v])
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no grpc internals in the traceback
    assert client.pull([v])[0].tolist() == [0, 0, 0]


def test_names_instead_of_variables_get_a_clear_error(client):
    v = client.create_variable("named_w", shape=(2,), optimizer=ps.SGD(1.0))
    with pytest.raises(InvalidArgumentError, match="pull: item 0 is str 'named_w', not a Variable"):
        client.pull(["named_w"])
    with pytest.raises(InvalidArgumentError, match="push: item 0 is str"):
        client.push([("named_w", np.ones(2, np.float32))])
    with pytest.raises(InvalidArgumentError, match="push: takes \\(Variable, gradient\\) pairs"):
        client.push([v])
    with pytest.raises(InvalidArgumentError, match="rows: item 0 is str"):
        client.pull_rows("named_w", [0])
    assert client.pull([v])[0].tolist() == [0, 0]

def test_sigkilled_ps_restarted_with_restore_serves_checkpointed_values(cluster, client, tmp_path):
    w = client.create_variable("ckpt", initial_value=np.arange(8, dtype=np.float32),
                               partitioner=ps.FixedShardsPartitioner(2), optimizer=ps.Momentum(0.1, 0.9))
    client.push([(w, np.ones(8))])
    saved = client.pull([w])[0]
    client.checkpoint(step=42)
    client.push([(w, np.ones(8))])  # applied after the checkpoint: lost with the PS
    victim = cluster.ps[1]
    cluster.kill(victim)
    cluster.restart(victim)
    status = client.status()[1]
    assert status.restored_step == 42 and status.global_step == 42
    after = client.pull([w])[0]
    on_victim = [pl for pl in w.shards if pl.ps == 1]
    on_other = [pl for pl in w.shards if pl.ps == 0]
    for pl in on_victim:
        rows = slice(pl.row_offset, pl.row_offset + pl.rows)
        np.testing.assert_array_equal(after[rows], saved[rows])
    for pl in on_other:
        rows = slice(pl.row_offset, pl.row_offset + pl.rows)
        assert (after[rows] < saved[rows]).all()
    # the momentum slot came back too: the next update uses it
    client.push([(w, np.zeros(8))])
    assert (client.pull([w])[0][on_victim[0].row_offset] != after[on_victim[0].row_offset])


def test_export_is_one_safetensors_file_readable_without_pscluster(client, tmp_path):
    client.create_variable("exported", initial_value=np.arange(6, dtype=np.float32).reshape(3, 2),
                           partitioner=ps.FixedShardsPartitioner(3))
    path = tmp_path / "model.safetensors"
    client.export(str(path))
    code = ("import sys; from safetensors.numpy import load_file; t = load_file(sys.argv[1]); "
            "assert not any(m.startswith('pscluster') for m in sys.modules); print(t['exported'].tolist())")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]"


# -- the bulk tensor port gets the same scrutiny as gRPC ------------------------------------------
def bulk_exchange(client, ps_index, request, payload=b"", token=TOKEN, raw_prefix=None, hello=False):
    """Send one frame to a PS's bulk port (after a hello frame if hello); return its BulkReply, or None
    if the PS hung up silently."""
    import socket
    import struct

    port = client.status()[ps_index].bulk_port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        if hello:
            first = pb.BulkRequest(token=token).SerializeToString()
            conn.sendall(struct.pack("<IQ", len(first), 0) + first)
        elif token is not None and request is not None:
            request.token = token
        header = request.SerializeToString() if request is not None else b"\x08\xff\xff garbage"
        conn.sendall(raw_prefix or struct.pack("<IQ", len(header), len(payload)))
        if raw_prefix is None:
            conn.sendall(header + payload)
        try:
            head = conn.recv(12, socket.MSG_WAITALL)
        except ConnectionResetError:
            return None
        if len(head) < 12:
            return None
        hlen, _ = struct.unpack("<IQ", head)
        reply = pb.BulkReply()
        reply.ParseFromString(conn.recv(hlen, socket.MSG_WAITALL))
        return reply


def bulk_push(var, grad, shape=None, dtype="<f4"):
    item = pb.PushItem(ref=pb.ShardRef(variable=var), grad=pb.Tensor(dtype=dtype, shape=list(shape or grad.shape)))
    return pb.BulkRequest(push=pb.PushRequest(items=[item], push_id="bulk-bad")), grad.tobytes()


@pytest.mark.parametrize("case", ["no token", "wrong token", "wrong shape", "wrong dtype", "unknown variable",
                                  "payload shorter than shapes", "nan", "malformed header", "shape overflowing int64",
                                  "oversized first frame",
                                  "oversized frame after the hello"])
def test_bad_bulk_requests_get_precise_codes_and_change_nothing(cluster, client, case):
    v = client.create_variable("bulk_target", shape=(4, 2), optimizer=ps.SGD(1.0), initializer="ones")
    before = _state(client, "bulk_target")
    ones = np.ones((4, 2), np.float32)
    code = grpc.StatusCode.INVALID_ARGUMENT
    kwargs = {}
    if case == "no token":
        request, payload = bulk_push("bulk_target", ones)
        kwargs["token"], code = "", grpc.StatusCode.UNAUTHENTICATED
    elif case == "wrong token":
        request, payload = bulk_push("bulk_target", ones)
        kwargs["token"], code = "nope", grpc.StatusCode.UNAUTHENTICATED
    elif case == "wrong shape":
        request, payload = bulk_push("bulk_target", np.ones((2, 4), np.float32))
    elif case == "wrong dtype":
        request, payload = bulk_push("bulk_target", np.ones((4, 2), np.float64), dtype="<f8")
    elif case == "unknown variable":
        request, payload = bulk_push("nope", ones)
        code = grpc.StatusCode.NOT_FOUND
    elif case == "payload shorter than shapes":
        request, payload = bulk_push("bulk_target", ones, shape=(8, 2))
    elif case == "nan":
        request, payload = bulk_push("bulk_target", np.full((4, 2), np.nan, np.float32))
    elif case == "malformed header":
        request, payload = None, b""
    elif case == "shape overflowing int64":
        request, payload = bulk_push("bulk_target", ones, shape=(1 << 40, 1 << 40))
    else:
        import struct

        request, payload = pb.BulkRequest(), b""
        kwargs["raw_prefix"] = struct.pack("<IQ", 1 << 30, 1 << 62)
        # unauthenticated, a header above 4 KiB is refused unread; after the hello, above the limits
        code = grpc.StatusCode.UNAUTHENTICATED if case == "oversized first frame" else grpc.StatusCode.RESOURCE_EXHAUSTED
        kwargs["hello"] = case == "oversized frame after the hello"
    reply = bulk_exchange(client, v.shards[0].ps, request, payload, **kwargs)
    assert reply is not None and reply.code == code.value[0], reply
    after = _state(client, "bulk_target")
    np.testing.assert_array_equal(before[0], after[0])
    assert before[1] == after[1]


def test_bulk_and_grpc_transports_agree(cluster):
    with ps.PSClient(cluster.settings(bulk_transport=False)) as grpc_client, \
            ps.PSClient(cluster.settings()) as bulk_client:
        v = bulk_client.create_variable("both", initial_value=np.arange(12.0).reshape(6, 2),
                                        partitioner=ps.FixedShardsPartitioner(2), optimizer=ps.SGD(1.0))
        grpc_client.push([(grpc_client.variables()["both"], np.ones((6, 2)))])
        bulk_client.push([(v, np.ones((6, 2)))])
        np.testing.assert_array_equal(grpc_client.pull([v])[0], bulk_client.pull([v])[0])
        np.testing.assert_array_equal(bulk_client.pull([v])[0], np.arange(12.0).reshape(6, 2) - 2)


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "grpc"])
def test_sparse_adam_on_two_ps_equals_one_shard_over_both_transports(cluster, bulk):
    with ps.PSClient(cluster.settings(bulk_transport=bulk)) as c:
        tag = "b" if bulk else "g"
        one = c.create_variable(f"adam1_{tag}", shape=(4, 1), sparse=True, optimizer=ps.Adam(0.1), initializer="ones")
        two = c.create_variable(f"adam2_{tag}", shape=(4, 1), sparse=True, optimizer=ps.Adam(0.1), initializer="ones",
                                partitioner=ps.FixedShardsPartitioner(2))
        assert {pl.ps for pl in two.shards} == {0, 1}
        for row in (0, 0, 3):  # the sequence: row 3 is the table's third update wherever it lives
            for var in (one, two):
                c.push_rows(var, [row], np.ones((1, 1)))
        np.testing.assert_allclose(c.pull([two])[0], c.pull([one])[0], rtol=0, atol=1e-6)
        np.testing.assert_allclose(c.pull([two])[0][:, 0], [0.8, 1.0, 1.0, 0.936], atol=5e-4)


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "grpc"])
def test_sync_tokens_travel_over_both_transports(cluster, bulk):
    with ps.PSClient(cluster.settings(bulk_transport=bulk), retry_for=0.3) as c:
        step = c.configure_sync("sync", replicas_to_aggregate=2, total_num_replicas=2)
        try:
            assert [c.take_token(cid, "w", 5.0) for cid in (101, 102)] == [(step, 0), (step, 1)]
            with pytest.raises(DeadlineExceededError):  # both replicas of this step are out
                c.take_token(103, "w", 0.2)
            c.step_done(101, step, "w")
        finally:
            c.configure_sync("async")


def test_a_shard_above_max_tensor_bytes_is_refused_before_anything_is_allocated(cluster, client):
    from pscluster.errors import ResourceExhaustedError

    with pytest.raises(ResourceExhaustedError, match=r"takes 8589934592 bytes, above max_tensor_bytes=4294967296"):
        client.create_variable("eight_gib", shape=(1 << 31, 1), dtype="float32", initializer="zeros")
    assert "eight_gib" not in client.variables()
    with pytest.raises(InvalidArgumentError, match="8 bytes do not hold shape"):  # 2^80 elements: no int64 wraps
        v = client.create_variable("small_target", shape=(2,), optimizer=ps.SGD(1.0))
        channel, stub, metadata = raw_stub(cluster, v.shards[0].ps)
        try:
            tensor = pb.Tensor(dtype="<f4", shape=[1 << 40, 1 << 40], data=b"\0" * 8)
            item = pb.PushItem(ref=pb.ShardRef(variable=v.name), grad=tensor)
            try:
                stub.Push(pb.PushRequest(items=[item], push_id="overflow"), metadata=metadata, timeout=10)
            except grpc.RpcError as exc:
                raise from_status(exc.code(), exc.details()) from None
        finally:
            channel.close()
    np.testing.assert_array_equal(client.pull([v])[0], [0, 0])
