"""`pscluster status` against live daemons: a token problem is named as such, --wait waits for a restart."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster


def status(cluster, *extra, token=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSCLUSTER_TOKEN")}
    if token:
        env["PSCLUSTER_TOKEN"] = token
    return subprocess.run([sys.executable, "-P", "-m", "pscluster.ops.cli", "status", "--cluster",
                           str(cluster.cluster_file), *extra], capture_output=True, text=True, timeout=60, env=env)


def test_status_with_a_wrong_or_missing_token_says_unauthenticated(fresh_cluster):
    cluster = fresh_cluster(1, 0, supervise=False, token="right-token")
    for token in ("wrong-token", None):
        out = status(cluster, token=token)
        assert out.returncode == 1
        row = next(line for line in out.stdout.splitlines() if cluster.spec["ps"][0] in line)
        assert "unauthenticated: wrong or missing token" in row and "unreachable" not in row, out.stdout
    out = status(cluster, token="right-token")
    assert "up" in out.stdout and "coordinator unreachable" in out.stdout  # no coordinator runs: that one is


def test_status_wait_waits_for_a_restarted_ps(fresh_cluster):
    import pscluster as ps

    cluster = fresh_cluster(1, 0, supervise=False)
    with ps.ClusterCoordinator(cluster.settings()):
        cluster.kill(cluster.ps[0])
        cluster.restart(cluster.ps[0], wait=0)
        out = status(cluster, "--wait", "60")
    assert out.returncode == 0, out.stdout
    assert "unreachable" not in out.stdout and "up" in out.stdout


def test_status_of_a_stopped_cluster_is_one_line_and_wait_says_it_ran_out(fresh_cluster):
    cluster = fresh_cluster(2, 0, supervise=False)
    cluster.stop()
    out = status(cluster, "--wait", "1")
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout
    assert lines[0].startswith("no task answered: unreachable") and cluster.spec["ps"][1] in lines[0]
    assert lines[1] == "--wait 1 s ran out: 0 of 3 tasks answered"
