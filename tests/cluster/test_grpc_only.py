"""A cluster with `bulk_transport: false`: tensors, sync tokens and closures all travel over gRPC.

The gRPC implementations behind both transport seams (GrpcTensors, GrpcDispatcher) carry a whole
run, including a user error and a worker SIGKILLed mid-run, with the same exact accounting.
"""

import signal
import time

import numpy as np
import pytest

import pscluster as ps
from pscluster.errors import ClosureError

pytestmark = pytest.mark.cluster


def count(counter, pause):
    time.sleep(pause)
    counter.push(np.array(-1, np.int64))
    return 1


def fail():
    raise ValueError("bad batch")


def test_a_grpc_only_cluster_runs_closures_survives_a_worker_kill_and_reports_errors(fresh_cluster):
    cluster = fresh_cluster(1, 2, supervise=False, extra={"bulk_transport": False})
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(2)
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        values = [coord.schedule(count, args=(counter, 0.02)) for _ in range(60)]
        deadline = time.monotonic() + 60
        while coord.status().done < 10:
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.005)
        assert len(coord._sender._grpc._stubs) == 2 and not coord._sender._framed._attempts.workers()  # closures over gRPC
        before = coord.status().retried
        cluster.kill(cluster.workers[0], signal.SIGKILL)
        coord.join(timeout=90)
        assert sum(v.fetch() for v in values) == 60
        assert coord.status().retried > before  # the victim was busy: its closure ran again elsewhere
        assert int(counter.pull()) == 60  # SGD(1.0) on -1 per closure: every push applied exactly once
        bad = coord.schedule(fail)
        with pytest.raises(ValueError, match="bad batch") as info:
            coord.join(timeout=30)
        assert isinstance(info.value.__cause__, ClosureError) and info.value.__cause__.closure_id == bad.closure_id
    finally:
        coord.shutdown()
