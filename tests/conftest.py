"""Shared fixtures: real daemons on 127.0.0.1, always stopped by pid."""

import os

import pytest

os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
# Read once, when ray is first imported: every address Ray derives for this machine is then loopback
# (with a node_ip_address of 127.0.0.1 its servers bind there), so Ray tests never listen beyond it.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Compile the dynamic tables' kernels into their disk cache once, before any test: in a fresh
    checkout the first PS daemon to create a table would otherwise compile them (seconds, more on 2
    busy cores) while its client waits on a deadline; with the cache every process loads them.
    tryfirst: under `-n 2` (pytest-xdist) this runs in the controller before pytest-xdist's own
    sessionstart starts the workers, so the two workers load the cache instead of both compiling."""
    from pscluster.server import table_kernels

    table_kernels.load()


@pytest.fixture
def fresh_cluster(tmp_path):
    """Factory for LocalClusters that are stopped at the end of the test."""
    from pscluster.ops.launcher import LocalCluster

    started = []

    def make(*args, **kwargs):
        cluster = LocalCluster(*args, workdir=kwargs.pop("workdir", tmp_path / f"c{len(started)}"), **kwargs)
        started.append(cluster)
        return cluster.start()

    yield make
    for cluster in started:
        cluster.stop()
