"""`pscluster up`: token from the environment, fixed ports from --base-port, restore, Ctrl-C stops everything."""

import os
import signal
import subprocess

import numpy as np
import pytest
import yaml

import pscluster as ps
from pscluster.ops.launcher import PortPlan
from tests.cluster.procs import Procs, free_range, read_until

pytestmark = pytest.mark.cluster
TOKEN = "up-token-93ab"


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.close()


def start_up(procs, tmp_path, base):
    up = procs.start("up", "--ps", "2", "--workers", "2", "--base-port", str(base), "--checkpoint-dir",
                     str(tmp_path / "ckpt"), "--write-cluster", str(tmp_path / "cluster.yaml"),
                     env={"PSCLUSTER_TOKEN": TOKEN})
    ready = read_until(up, "READY up")[-1]
    children = subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True, text=True).stdout.split()
    return up, ready, children


def interrupt(up, children):
    up.send_signal(signal.SIGINT)  # what Ctrl-C sends
    out, _ = up.communicate(timeout=30)
    assert up.returncode == 0, out
    assert "Traceback" not in out and "WARNING" not in out, out
    assert "up: stopping" in out and out.rstrip().endswith("up: stopped"), out  # Ctrl-C is acknowledged
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}"), f"pid {pid} outlived pscluster up"


def test_up_with_the_token_in_the_environment_fixes_every_port_and_stops_on_ctrl_c(tmp_path, procs):
    plan = PortPlan(free_range(9), 2, 2)
    up, ready, children = start_up(procs, tmp_path, plan.base)
    assert len(children) == 4 and f"coordinator at 127.0.0.1:{plan.coordinator()}" in ready
    spec = yaml.safe_load((tmp_path / "cluster.yaml").read_text())["cluster"]
    assert spec == {"ps": [f"127.0.0.1:{plan.ps(0)}", f"127.0.0.1:{plan.ps(1)}"],
                    "coordinator": f"127.0.0.1:{plan.coordinator()}"}
    settings = ps.load_settings(tmp_path / "cluster.yaml", env={"PSCLUSTER_TOKEN": TOKEN})
    client = ps.RemoteCoordinator(settings)
    try:
        assert sorted(s.bulk_port for s in client.client.status()) == [plan.framed("ps", 0), plan.framed("ps", 1)]
        counter = client.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        values = [client.schedule(lambda: counter.push(np.array(-1, np.int64))) for _ in range(10)]
        client.join(timeout=60)
        assert int(counter.pull()) == 10 and all(v.done() for v in values)
        workers = sorted(w.address for w in client.status().workers)
        assert workers == [f"127.0.0.1:{plan.worker(0)}", f"127.0.0.1:{plan.worker(1)}"]
    finally:
        client.close()
    interrupt(up, children)


def test_up_a_second_time_on_the_same_checkpoint_dir_restores_it(tmp_path, procs):
    base = free_range(9)
    up, ready, children = start_up(procs, tmp_path, base)
    assert "global_step=0" in ready
    client = ps.RemoteCoordinator(ps.load_settings(tmp_path / "cluster.yaml", env={"PSCLUSTER_TOKEN": TOKEN}))
    try:
        counter = client.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        for _ in range(7):
            client.schedule(lambda: counter.push(np.array(-1, np.int64)))
        client.join(timeout=60)
        client.client.checkpoint(7)
    finally:
        client.close()
    interrupt(up, children)
    up, ready, children = start_up(procs, tmp_path, base)
    assert "global_step=7" in ready
    client = ps.RemoteCoordinator(ps.load_settings(tmp_path / "cluster.yaml", env={"PSCLUSTER_TOKEN": TOKEN}))
    try:
        counter = client.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        assert int(counter.pull()) == 7
    finally:
        client.close()
    interrupt(up, children)


def test_a_mutual_tls_cluster_in_three_commands(tmp_path, procs):
    """The README's "TLS in three commands", as printed (a token as well: TLS does not replace it)."""
    certs = procs.start("certs", "--ps", "2", "--workers", "2", "--out", str(tmp_path / "tls"))
    assert certs.wait(timeout=60) == 0
    plan = PortPlan(free_range(9), 2, 2)
    up = procs.start("up", "--ps", "2", "--workers", "2", "--base-port", str(plan.base), "--tls-dir",
                     str(tmp_path / "tls"), "--require-client-cert", "--write-cluster", str(tmp_path / "cluster.yaml"),
                     env={"PSCLUSTER_TOKEN": TOKEN})
    read_until(up, "READY up")
    children = subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True, text=True).stdout.split()
    status = procs.start("status", "--cluster", str(tmp_path / "cluster.yaml"), env={"PSCLUSTER_TOKEN": TOKEN})
    out, _ = status.communicate(timeout=60)
    assert status.returncode == 0, out
    assert f"127.0.0.1:{plan.ps(1)}" in out and out.count(" alive ") == 2, out  # status over mutual TLS
    settings = ps.load_settings(tmp_path / "cluster.yaml", env={"PSCLUSTER_TOKEN": TOKEN})
    assert settings.require_client_cert and settings.tls_dir == tmp_path / "tls"
    client = ps.RemoteCoordinator(settings)
    try:
        counter = client.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        for _ in range(5):
            client.schedule(lambda: counter.push(np.array(-1, np.int64)))
        client.join(timeout=60)
        assert int(counter.pull()) == 5
    finally:
        client.close()
    interrupt(up, children)
