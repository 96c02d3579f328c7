"""Operations: Prometheus metrics scraped from live daemons; `pscluster status`; `pscluster up`."""

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

import pscluster as ps

pytestmark = pytest.mark.cluster


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def metric(text, name, labels=""):
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name}{labels} not in scrape"
    return float(m.group(1))


def ready_field(daemon, key):
    for line in daemon.log_path.read_text().splitlines():
        if line.startswith(("READY", "SERVING")):  # a worker's metrics port is on both
            return re.search(rf"{key}=(\d+)", line).group(1)
    raise AssertionError("no READY line")


def test_metrics_of_live_ps_worker_and_coordinator(fresh_cluster):
    cluster = fresh_cluster(1, 2, supervise=False, env={"PSCLUSTER_METRICS_PORT": "0"})
    coord = ps.ClusterCoordinator(cluster.settings(metrics_port=0))
    try:
        coord.wait_for_workers(2)
        w = coord.create_variable("w", initial_value=np.zeros(1000, np.float32), optimizer=ps.SGD(0.1))

        def step():
            w.pull()
            w.push(np.ones(1000))

        def bad_step():  # a gradient holding NaN: skipped on the worker, never sent
            ps.push([(w, np.full(1000, np.nan, np.float32))], nonfinite="skip")

        for _ in range(20):
            coord.schedule(step)
        for _ in range(3):
            coord.schedule(bad_step)
        coord.join(timeout=60)
        ps_text = scrape(ready_field(cluster.ps[0], "metrics"))
        assert metric(ps_text, "pscluster_ps_rejected_nonfinite_pushes") == 0
        skipped = sum(metric(scrape(ready_field(d, "metrics")), "pscluster_worker_nonfinite_pushes_total",
                             '{action="skipped"}') for d in cluster.workers)
        assert skipped == 3
        assert metric(ps_text, "pscluster_ps_requests_total", '{op="push",transport="bulk"}') == 20
        assert metric(ps_text, "pscluster_ps_tensor_bytes_total", '{op="pull"}') >= 20 * 4000
        assert metric(ps_text, "pscluster_ps_shards") == 1
        assert metric(ps_text, "pscluster_ps_request_seconds_count", '{op="push"}') == 20
        runs = sum(metric(scrape(ready_field(d, "metrics")), "pscluster_worker_closures_total", '{outcome="ok"}')
                   for d in cluster.workers)
        assert runs == 23
        co_text = scrape(coord.metrics_port)
        assert metric(co_text, "pscluster_coordinator_closures_done_total") == 23
        assert metric(co_text, "pscluster_coordinator_workers_alive") == 2
        assert metric(co_text, "pscluster_coordinator_closures_queued") == 0
        rates = re.findall(r'^pscluster_coordinator_worker_steps_per_second\{worker="[^"]+"\} ([0-9.e+-]+)$',
                           co_text, re.M)
        assert len(rates) == 2 and sum(float(r) for r in rates) == pytest.approx(23 / 10.0)
    finally:
        coord.shutdown()


def test_status_command_shows_ps_variables_and_workers(fresh_cluster, capsys):
    from pscluster.ops import cli
    from pscluster.ops.launcher import free_port

    cluster = fresh_cluster(2, 1, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(1)
        coord.create_variable("embedding", shape=(100, 8), sparse=True, partitioner=ps.FixedShardsPartitioner(2))
        out = subprocess.run([sys.executable, "-m", "pscluster.ops.cli", "status", "--cluster", str(cluster.cluster_file)],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
        assert out.returncode == 0, out.stderr
        for text in ("parameter servers", "embedding", "1/2", "2/2", "(50, 8)", "sgd sparse", "workers", "alive"):
            assert text in out.stdout, text
        # a PS joining a replicas: 1 cluster is refused in one line (it printed a traceback)
        argv = ["ps", "--join", "--port", str(free_port()), "--cluster", str(cluster.cluster_file)]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and len(err.splitlines()) == 1
        assert "a PS joining (--join) needs the replica table (replicas: 2, or elastic: true)" in err
    finally:
        coord.shutdown()
    cluster.kill(cluster.ps[1])
    out = subprocess.run([sys.executable, "-m", "pscluster.ops.cli", "status", "--cluster", str(cluster.cluster_file)],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 1 and "unreachable" in out.stdout


def test_up_runs_a_supervised_cluster_and_leaves_nothing_behind(tmp_path):
    spec = tmp_path / "cluster.yaml"
    proc = subprocess.Popen([sys.executable, "-m", "pscluster.ops.cli", "up", "--ps", "1", "--workers", "1",
                             "--checkpoint-dir", str(tmp_path / "up"), "--write-cluster", str(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while "READY up" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, line
            line = proc.stdout.readline()
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 2  # one PS, one worker
        client = ps.RemoteCoordinator(ps.load_settings(spec))
        counter = client.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        values = [client.schedule(lambda: counter.push(np.array(-1, np.int64))) for _ in range(10)]
        client.join(timeout=60)
        assert int(counter.pull()) == 10 and len(client.fetch(values)) == 10
        client.close()
        os.kill(int(children[0]), signal.SIGKILL)  # the supervisor restarts it
        time.sleep(1.5)
        children_after = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children_after) == 2 and children[0] not in children_after
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        proc.stdout.close()
    for pid in children + children_after:
        assert not os.path.exists(f"/proc/{pid}"), f"pid {pid} outlived pscluster up"


def test_tensorflow_guide_examples_run():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, os.path.join(root, "examples", "from_tensorflow.py")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    for section in ("ParameterServerStrategy:", "ClusterCoordinator:", "SyncReplicasOptimizer: 5 global steps",
                    "replica_device_setter:", "TF_CONFIG: task coordinator"):
        assert section in out.stdout, section
    assert "w = [7.5 7.5]" in out.stdout  # five steps of mean(1, 2) with lr 1
