"""The framed ports' TLS contexts: a client's idle connection wakes only for data the server sent."""

import select
import socket
import threading

from pscluster.net import tls
from pscluster.ops.certs import write_certs


def test_an_idle_tls_client_connection_is_not_woken_by_post_handshake_messages(tmp_path):
    # The coordinator keeps one reader per closure connection, polling for the next reply; TLS 1.3
    # session tickets sent after the handshake would wake it with nothing to read (a timed recv follows,
    # which failed a closure dispatched there later). The server context sends none.
    write_certs(tmp_path, ["ps-0", "client"], ["127.0.0.1"])
    server = tls.server_context(tls.TlsFiles(tmp_path / "ca.pem", tmp_path / "ps-0.pem", tmp_path / "ps-0.key", True))
    client = tls.client_context(tls.TlsFiles(tmp_path / "ca.pem", tmp_path / "client.pem", tmp_path / "client.key",
                                             True))
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve():
        conn, _ = listener.accept()
        with server.wrap_socket(conn, server_side=True):
            done.wait(10)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with client.wrap_socket(socket.create_connection(("127.0.0.1", listener.getsockname()[1]), timeout=10),
                                server_hostname="127.0.0.1") as conn:
            poller = select.poll()
            poller.register(conn, select.POLLIN)
            assert poller.poll(500) == [] and conn.pending() == 0
    finally:
        done.set()
        thread.join(timeout=10)
        listener.close()


def test_a_worker_the_cluster_file_does_not_list_uses_the_shared_worker_certificate(tmp_path):
    import pytest

    from pscluster.config import validate
    from pscluster.errors import ConfigError
    from pscluster.ops.certs import task_names

    spec = {"ps": ["127.0.0.1:7001"], "coordinator": "127.0.0.1:7000"}  # no workers listed
    names = task_names(spec)
    assert names == ["ps-0", "ps", "worker", "coordinator", "client"]
    write_certs(tmp_path / "tls", names, ["127.0.0.1"])
    settings = validate({"cluster": spec, "task_type": "worker", "task_index": 3, "tls_dir": str(tmp_path / "tls")})
    files = tls.files(settings)
    assert files is not None and files.cert.name == "worker.pem" and files.key.name == "worker.key"
    tls.client_context(files)  # a usable certificate and key
    write_certs(tmp_path / "old", ["ps-0", "coordinator", "client"], ["127.0.0.1"])  # made before the shared one
    with pytest.raises(ConfigError, match=r"worker-3.pem does not exist .*worker.pem/.key for any worker"):
        tls.files(validate({"cluster": spec, "task_type": "worker", "task_index": 3, "tls_dir": str(tmp_path / "old")}))


def test_a_ps_that_joined_uses_the_shared_ps_certificate_whose_role_is_ps(tmp_path):
    import pytest
    from cryptography import x509

    from pscluster.config import validate
    from pscluster.errors import ConfigError
    from pscluster.ops.certs import task_names

    spec = {"ps": ["127.0.0.1:7001"], "coordinator": "127.0.0.1:7000"}
    write_certs(tmp_path / "tls", task_names(spec), ["127.0.0.1"])
    grown = {**spec, "ps": [*spec["ps"], "127.0.0.1:7002"]}  # the coordinator's list once PS 1 joined
    files = tls.files(validate({"cluster": grown, "task_type": "ps", "task_index": 1, "tls_dir": str(tmp_path / "tls")}))
    assert files is not None and files.cert.name == "ps.pem" and files.key.name == "ps.key"
    san = x509.load_pem_x509_certificate(files.cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [tls.ROLE_URI + "ps"]  # JoinPs checks it
    tls.server_context(files)  # a usable certificate and key
    listed = tls.files(validate({"cluster": grown, "task_type": "ps", "task_index": 0, "tls_dir": str(tmp_path / "tls")}))
    assert listed is not None and listed.cert.name == "ps-0.pem"  # a listed PS keeps its own
    write_certs(tmp_path / "old", ["ps-0", "coordinator", "client"], ["127.0.0.1"])  # made before the shared one
    with pytest.raises(ConfigError, match=r"ps-1.pem does not exist .*ps.pem/.key for any ps"):
        tls.files(validate({"cluster": grown, "task_type": "ps", "task_index": 1, "tls_dir": str(tmp_path / "old")}))
