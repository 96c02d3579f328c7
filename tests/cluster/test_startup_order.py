"""Daemons start in any order: each waits for what it needs, or gives up with one line and exit code 3."""

import socket

import numpy as np
import pytest
import yaml

import pscluster as ps
from pscluster.ops.launcher import free_port
from tests.cluster.procs import Procs, read_until

pytestmark = pytest.mark.cluster


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.close()


def write_spec(tmp_path, num_ps):
    spec = {"ps": [f"127.0.0.1:{free_port()}" for _ in range(num_ps)], "coordinator": f"127.0.0.1:{free_port()}"}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_coordinator_and_worker_started_before_the_ps_wait_for_it_then_train(tmp_path, procs):
    spec = write_spec(tmp_path, 2)
    env = {"PSCLUSTER_TOKEN": "order-token"}
    coord = procs.start("coordinator", "--cluster", str(spec), env=env)
    worker = procs.start("worker", "--cluster", str(spec), env=env)
    waiting = read_until(coord, "waiting for ps 0")  # says what it waits for, and keeps waiting
    early = read_until(worker, "waiting for the coordinator")
    for i in range(2):
        read_until(procs.start("ps", "--cluster", str(spec), "--index", str(i), env=env), "READY ps")
    read_until(coord, "READY coordinator")
    late = read_until(worker, "READY worker")  # READY only once registered: a launcher may rely on it
    assert not any("READY" in line for line in early)
    assert any("registered as worker 0" in line for line in late[:-1]), late
    client = ps.RemoteCoordinator(ps.load_settings(spec, env=env))
    try:
        counter = client.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        values = [client.schedule(lambda: counter.push(np.array(-1, np.int64))) for _ in range(20)]
        client.join(timeout=60)
        assert int(counter.pull()) == 20 and all(v.done() for v in values)
    finally:
        client.close()
    assert len([line for line in waiting if "waiting for" in line]) == 1  # one line, not one per attempt


def test_coordinator_whose_ps_never_comes_exits_with_one_line(tmp_path, procs):
    spec = write_spec(tmp_path, 1)
    coord = procs.start("coordinator", "--cluster", str(spec), env={"PSCLUSTER_STARTUP_TIMEOUT_S": "1.5"})
    out, _ = coord.communicate(timeout=60)
    assert coord.returncode == 3, out
    assert "Traceback" not in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("pscluster coordinator: gave up after 1.5 s waiting for ps 0 at 127.0.0.1:"), last
    assert sum("waiting for ps 0" in line and "retrying" in line for line in out.splitlines()) == 1


def test_worker_whose_coordinator_never_comes_exits_with_one_line(tmp_path, procs):
    spec = write_spec(tmp_path, 1)
    worker = procs.start("worker", "--cluster", str(spec), env={"PSCLUSTER_STARTUP_TIMEOUT_S": "1.5"})
    out, _ = worker.communicate(timeout=60)
    assert worker.returncode == 3, out
    assert "Traceback" not in out
    assert "gave up after 1.5 s waiting for the coordinator at 127.0.0.1:" in out.strip().splitlines()[-1]


def test_coordinator_refused_by_the_ps_says_so_at_once(tmp_path, procs):
    spec = write_spec(tmp_path, 1)
    read_until(procs.start("ps", "--cluster", str(spec), "--index", "0", env={"PSCLUSTER_TOKEN": "right"}), "READY")
    coord = procs.start("coordinator", "--cluster", str(spec), env={"PSCLUSTER_TOKEN": "wrong"})
    out, _ = coord.communicate(timeout=60)  # no startup timeout: a wrong token is not worth waiting for
    assert coord.returncode == 3 and "Traceback" not in out, out
    assert "ps 0 at 127.0.0.1:" in out and "refused us (UnauthenticatedError" in out


def test_worker_refused_by_the_coordinator_exits_before_ready(tmp_path, procs):
    spec = write_spec(tmp_path, 1)
    right = {"PSCLUSTER_TOKEN": "right"}
    read_until(procs.start("ps", "--cluster", str(spec), "--index", "0", env=right), "READY ps")
    read_until(procs.start("coordinator", "--cluster", str(spec), env=right), "READY coordinator")
    worker = procs.start("worker", "--cluster", str(spec), env={"PSCLUSTER_TOKEN": "wrong"})
    out, _ = worker.communicate(timeout=60)
    assert worker.returncode == 3 and "Traceback" not in out, out
    assert "READY" not in out  # nothing told a launcher this worker was usable
    assert "the coordinator at 127.0.0.1:" in out and "refused us (UnauthenticatedError" in out


@pytest.mark.parametrize("role, flags, which", [("ps", ["--index", "0"], "grpc"), ("ps", ["--index", "0"], "framed"),
                                                ("worker", ["--port", "{busy}"], "grpc"),
                                                ("coordinator", [], "grpc")])  # at once, not after the PS wait
def test_a_daemon_given_a_busy_port_names_it_and_exits_2(tmp_path, procs, role, flags, which):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        spec = {"ps": [f"127.0.0.1:{busy if which == 'grpc' and role == 'ps' else free_port()}"],
                "coordinator": f"127.0.0.1:{busy if role == 'coordinator' else free_port()}"}
        path = tmp_path / "cluster.yaml"
        path.write_text(yaml.safe_dump(spec))
        extra = ["--framed-port", str(busy)] if which == "framed" else []
        flags = [f.format(busy=busy) for f in flags]
        proc = procs.start(role, "--cluster", str(path), *flags, *extra,
                           env={"PSCLUSTER_STARTUP_TIMEOUT_S": "30"})
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    lines = out.strip().splitlines()  # one line: no raw gRPC log line, no traceback
    assert len(lines) == 1 and lines[0].startswith(f"pscluster {role}: port {busy} on 127.0.0.1 is in use ("), out
    assert lines[0].endswith("another process listens there; stop it, or give this task another port"), out
