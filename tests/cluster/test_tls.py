"""TLS and mutual TLS on every channel: certificates made at test time by `pscluster certs`, real daemons.

A TLS cluster trains over the framed (bulk, closures) and the gRPC transports; plaintext and foreign
certificates are refused; with mutual TLS each certificate's role bounds what its holder may call.
"""

import os
import socket
import stat
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc

import pscluster as ps
from pscluster.config import validate
from pscluster.errors import PermissionDeniedError, UnavailableError
from pscluster.net import framing, tls
from pscluster.net.rpc import open_channel
from pscluster.ops.certs import hosts_of, task_names, write_certs
from pscluster.ops.launcher import LocalCluster

pytestmark = pytest.mark.cluster


@pytest.fixture
def tls_cluster(tmp_path, request):
    bulk, replicas = (lambda p: p if isinstance(p, tuple) else (p, 1))(getattr(request, "param", True))
    cluster = LocalCluster(2, 2, workdir=tmp_path / "c", supervise=False, replicas=replicas,
                           extra={"tls_dir": str(tmp_path / "tls"), "require_client_cert": True,
                                  "bulk_transport": bulk})
    # the spec lists no workers: they join with the shared `worker` certificate
    write_certs(tmp_path / "tls", task_names(cluster.spec), hosts_of(cluster.spec))
    with cluster:
        yield cluster


def push_and_read(v):
    v.push(np.ones(4, np.float32))
    return float(v.pull()[0])


@pytest.mark.parametrize("tls_cluster", [True, False], ids=["framed", "grpc"], indirect=True)
def test_a_mutual_tls_cluster_trains_over_both_transports(tls_cluster):
    coord = ps.ClusterCoordinator(tls_cluster.settings())
    try:
        coord.wait_for_workers(2)
        v = coord.create_variable("v", shape=(4,), optimizer=ps.SGD(1.0))
        values = [coord.schedule(push_and_read, args=(v,)) for _ in range(20)]
        coord.join(timeout=60)
        assert all(x.fetch() < 0 for x in values)
        np.testing.assert_array_equal(v.pull(), -20 * np.ones(4))
    finally:
        coord.shutdown()


@pytest.mark.parametrize("tls_cluster", [(True, 2)], ids=["replicas-2"], indirect=True)
def test_a_mutual_tls_primary_forwards_to_its_backup_over_the_bulk_port(tls_cluster):
    # a PS certificate opens the backup's bulk port and sends replicate batches there
    coord = ps.ClusterCoordinator(tls_cluster.settings())
    try:
        coord.wait_for_workers(2)
        v = coord.create_variable("v", shape=(4,), optimizer=ps.SGD(1.0))
        deadline = time.monotonic() + 20
        while not ((c := coord.replica_table().get(("v", 0))) is not None and c.in_sync):
            assert time.monotonic() < deadline, "the backup never caught up over TLS"
            time.sleep(0.01)
        values = [coord.schedule(push_and_read, args=(v,)) for _ in range(20)]  # each acknowledged by the backup
        coord.join(timeout=60)
        assert all(x.fetch() < 0 for x in values)
        np.testing.assert_array_equal(v.pull(), -20 * np.ones(4))
    finally:
        coord.shutdown()


@pytest.mark.parametrize("tls_cluster", [(True, 2)], ids=["replicas-2"], indirect=True)
def test_a_third_ps_joins_a_mutual_tls_cluster_with_the_shared_ps_certificate(tls_cluster):
    # `pscluster certs` wrote ps-0, ps-1 and `ps`: the joining PS has no ps-2 and presents `ps` for JoinPs, its
    # replication links and its servers; it takes its share of the shards under load, no update lost
    assert not (tls_cluster.workdir.parent / "tls" / "ps-2.pem").exists()
    coord = ps.ClusterCoordinator(tls_cluster.settings())
    try:
        coord.wait_for_workers(2)
        counters = [coord.create_variable(f"c{i}", shape=(), dtype="int64", optimizer=ps.SGD(1.0)) for i in range(4)]
        deadline = time.monotonic() + 20
        while not (len(t := coord.replica_table()) == 4 + 1 and  # + PS 0's sync state row
                all(c.in_sync for c in t.values())):
            assert time.monotonic() < deadline, "the backups never caught up over TLS"
            time.sleep(0.01)
        values = [coord.schedule(increment, args=tuple(counters)) for _ in range(60)]
        joined = tls_cluster.add_ps()
        assert joined.index == 2
        coord.add_ps(2)  # under load
        assert sum(1 for c in coord.replica_table().values() if c.primary == 2) >= 1
        values += [coord.schedule(increment, args=tuple(counters)) for _ in range(60)]
        coord.join(timeout=60)
        assert sum(v.fetch() for v in values) == 120
        assert [int(c.pull()) for c in counters] == [120] * 4
        assert coord.client.status()[2].num_shards >= 1
        assert coord.lost_updates == 0
    finally:
        coord.shutdown()


def increment(*counters):
    for counter in counters:
        counter.push(np.array(-1, np.int64))
    return 1


def test_plaintext_and_foreign_certificates_are_refused_with_a_clear_error(tls_cluster, tmp_path):
    plain = validate({"cluster": tls_cluster.spec})
    with pytest.raises(UnavailableError, match="if the cluster uses TLS, this program needs the same CA"):
        with ps.PSClient(plain, retry_for=0.5) as client:
            client.variables()
    write_certs(tmp_path / "other", ["client"], ["127.0.0.1"])  # a CA the cluster does not trust
    foreign = validate({"cluster": tls_cluster.spec, "tls_dir": str(tmp_path / "other")})
    with pytest.raises(UnavailableError):
        with ps.PSClient(foreign, retry_for=0.5) as client:
            client.variables()
    # the framed port: a plaintext hello is not a TLS handshake; the connection is dropped unserved
    port = ps.PSClient(tls_cluster.settings()).status()[0].bulk_port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        framing.send_hello(conn, None)
        try:
            answer = conn.recv(16)
        except ConnectionResetError:
            answer = b""
        assert answer == b""


def test_a_worker_certificate_cannot_submit_closures_nor_run_them_on_workers(tls_cluster, tmp_path):
    certs = tmp_path / "tls"
    as_worker = validate({"cluster": tls_cluster.spec, "tls_ca_file": str(certs / "ca.pem"),
                          "tls_cert_file": str(certs / "worker.pem"), "tls_key_file": str(certs / "worker.key"),
                          "require_client_cert": True})
    channel = open_channel(tls_cluster.spec["coordinator"], as_worker)
    coord = ps.ClusterCoordinator(tls_cluster.settings())  # the cluster's coordinator, embedded
    try:
        coord.wait_for_workers(2)
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.CoordinatorStub(channel).OpenJob(pb.JobRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "a worker peer may not call it (allowed: client, coordinator)" in info.value.details()
        # a worker's framed closure port serves only a coordinator or client certificate
        worker = coord.snapshot().workers[0]
        address = coord._state.workers[worker.wid].closure_address
        host, _, port = address.rpartition(":")
        context = tls.client_context(tls.files(as_worker))
        with framing.connect(host, int(port), 10, context) as conn:
            reply, _ = framing.read_reply(conn)
        assert reply.code == grpc.StatusCode.PERMISSION_DENIED.value[0] and "a worker peer may not" in reply.message
        with pytest.raises(PermissionDeniedError):  # the same through the client library
            with ps.PSClient(as_worker.model_copy(update={"tls_cert_file": certs / "ps-0.pem",
                                                          "tls_key_file": certs / "ps-0.key"})) as client:
                client.variables()
    finally:
        channel.close()
        coord.shutdown()


def test_certs_command_writes_a_ca_and_role_certificates_with_the_cluster_addresses(tmp_path):
    from cryptography import x509

    (tmp_path / "c.yaml").write_text("ps: ['10.0.0.5:7001', 'ps-1.example:7002']\ncoordinator: '10.0.0.4:7000'\n")
    out = subprocess.run([sys.executable, "-m", "pscluster.ops.cli", "certs", "--cluster", str(tmp_path / "c.yaml"),
                          "--out", str(tmp_path / "tls"), "--workers", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    names = {p.name for p in (tmp_path / "tls").iterdir()}
    assert names == {f"{n}.{e}" for n in ("ca", "ps-0", "ps-1", "ps", "worker-0", "worker-1", "worker", "coordinator",
                                          "client") for e in ("pem", "key")}
    assert all(stat.S_IMODE(os.stat(tmp_path / "tls" / n).st_mode) == 0o600 for n in names if n.endswith(".key"))
    cert = x509.load_pem_x509_certificate((tmp_path / "tls" / "worker-1.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} >= {"10.0.0.5", "10.0.0.4", "127.0.0.1"}
    assert "ps-1.example" in san.get_values_for_type(x509.DNSName)
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["pscluster://role/worker"]
    again = subprocess.run([sys.executable, "-m", "pscluster.ops.cli", "certs", "--cluster", str(tmp_path / "c.yaml"),
                            "--out", str(tmp_path / "tls")], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists; choose an empty --out directory" in again.stderr


def test_listening_beyond_loopback_needs_a_token_or_tls(tmp_path):
    write_certs(tmp_path / "tls", ["ps-0", "client"], ["127.0.0.1"])
    spec = {"ps": ["127.0.0.1:1"]}
    assert validate({"cluster": spec, "bind_host": "0.0.0.0", "tls_dir": str(tmp_path / "tls")}).uses_tls
    with pytest.raises(Exception, match="neither a token nor TLS"):
        validate({"cluster": spec, "bind_host": "0.0.0.0"})
    with pytest.raises(Exception, match="require_client_cert needs TLS"):
        validate({"cluster": spec, "require_client_cert": True})
