"""A coordinator that runs for days: state bounded in the closures run and in workers churned, other
threads reading a snapshot, long polls that leave threads for heartbeats, no background thread dying
unnoticed. Real PS and worker daemons on 127.0.0.1."""

import signal
import sys
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from pscluster.coordinator.remote import RemoteCoordinator
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc

import pscluster as ps
from pscluster.errors import InternalError, PsclusterError
from pscluster.net import rpc

pytestmark = pytest.mark.cluster


def until(condition, what, timeout=60.0):
    """Poll condition until true (progress, not time, is what the tests wait for)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def identity(i):
    return i


def fails(i):
    raise ValueError(f"closure {i} fails on purpose")


def internal_sizes(coord):
    """The length of every container the coordinator, its scheduler state and its senders hold."""
    sizes = {}
    sender = getattr(coord, "_sender", None)
    owners = [("", coord), ("state.", coord._state), ("queues.", getattr(coord._state, "queue", None)),
              ("rates.", getattr(coord, "_rates", None)),
              ("sender.", sender), ("framed.", getattr(sender, "_framed", None))]
    for prefix, owner in owners:
        if owner is None:
            continue
        for name, attr in vars(owner).items():
            if hasattr(attr, "__len__") and not isinstance(attr, (str, bytes, tuple)):  # tuple: immutable records
                sizes[prefix + name] = len(attr)
    return sizes


def test_coordinator_maps_stay_bounded_after_20000_closures(fresh_cluster):
    cluster = fresh_cluster(1, 2, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(2)
        kept = []
        for batch in range(10):
            for i in range(2000):
                value = coord.schedule(identity, args=(batch * 2000 + i,))
                if i == 0:
                    kept.append(value)  # the caller keeps one value per batch and drops the rest
            if batch == 4:
                coord.schedule(fails, args=(batch,))  # queued behind the batch; join reports it
                with pytest.raises(ValueError, match="fails on purpose"):
                    coord.join(timeout=120)
            coord.join(timeout=120)
        del value  # the loop variable: the last closure's value
        assert [v.fetch() for v in kept] == [b * 2000 for b in range(10)]
        status = coord.status()
        assert status.done == 20_000 and status.failed == 1 and status.running == 0
        sizes = internal_sizes(coord)
        assert sizes["_values"] == len(kept), sizes  # only what the caller still holds
        # per-worker maps hold the 2 workers (a few connections each); nothing holds closures
        assert max(v for k, v in sizes.items() if k != "_values") <= 4, sizes
    finally:
        coord.shutdown()


def test_per_job_state_is_dropped_when_client_jobs_end(fresh_cluster):
    cluster = fresh_cluster(1, 1, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())  # serves remote clients too
    try:
        coord.wait_for_workers(1)
        for n in range(20):
            client = RemoteCoordinator(cluster.settings())  # each client program is one job
            values = [client.schedule(identity, args=(i,)) for i in range(5)]
            client.join(timeout=60)
            assert client.fetch(values) == list(range(5))
            client.shutdown()  # ends the job
        until(lambda: len(coord._state.queue.jobs) == 1, "the ended jobs to be dropped")
        sizes = internal_sizes(coord)
        assert sizes["_joins"] == 1 and sizes["queues.jobs"] == 1 and sizes["_retained"] == 0, sizes
        assert sizes.pop("state.ended_jobs") == 8  # status shows the last 8 ended jobs, no more
        assert max(sizes.values()) <= 4, sizes
        jobs = coord.status().jobs
        assert [j.job for j in jobs if not j.ended] == ["main"]
        assert [j.done for j in jobs if j.ended] == [5] * 8 and all(j.ended == "its client shut down" for j in jobs if j.ended)
    finally:
        coord.shutdown()


def test_status_from_other_threads_while_submitting_never_sees_the_loop_mid_change(fresh_cluster):
    cluster = fresh_cluster(1, 2, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    errors, reads, stop = [], [0], threading.Event()

    def read():
        while not stop.is_set():
            try:
                coord.status()
                coord.num_workers()
                coord.worker_rates()
                coord._metrics_snapshot()
                reads[0] += 1
            except Exception as exc:  # noqa: BLE001 - collected and asserted on below
                errors.append(exc)
                return

    reader = threading.Thread(target=read, name="test-status-reader")
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # switch threads often, so reads land in the middle of the loop's updates
    try:
        coord.wait_for_workers(2)
        reader.start()
        for i in range(10_000):
            coord.schedule(identity, args=(i,))
        coord.join(timeout=120)
        stop.set()
        reader.join(timeout=30)
        assert errors == [] and reads[0] > 0
        assert coord.status().done == 10_000 and coord.num_workers() == 2
    finally:
        sys.setswitchinterval(switch)
        stop.set()
        coord.shutdown()


def test_maps_keyed_by_worker_forget_workers_that_died(fresh_cluster):
    cluster = fresh_cluster(1, 1, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(1)
        for round_ in range(3):  # each round: a new worker joins, runs closures, the old one is killed
            cluster.add_worker()
            until(lambda: coord.num_workers() == 2, "the new worker to register")
            values = [coord.schedule(identity, args=(i,)) for i in range(200)]
            coord.join(timeout=60)
            assert [v.fetch() for v in values] == list(range(200))
            until(lambda: len(coord._rates._samples) == 2, "a rate sample of both workers")
            victim = cluster.workers[round_]
            cluster.kill(victim, signal.SIGKILL)
            victim.proc.wait(timeout=30)
            until(lambda: coord.num_workers() == 1, "the dead worker to be declared gone")
        until(lambda: len(coord._rates._samples) == 1, "rate samples of the dead workers to go")
        live = {w.wid for w in coord.snapshot().workers}
        assert len(live) == 1
        assert set(coord._rates._samples) == live and set(coord.worker_rates()) == live
        assert coord._sender._framed._attempts.workers() <= live
        assert set(coord._sender._grpc._stubs) <= live
    finally:
        coord.shutdown()


def hold_until_released(gate):
    while int(gate.pull()) == 0:  # the test releases the gate once it has seen what it checks
        time.sleep(0.01)
    return 1


def test_many_long_polls_leave_threads_for_heartbeats_and_status(fresh_cluster):
    cluster = fresh_cluster(1, 0, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    remote = RemoteCoordinator(cluster.settings())
    polls = 32  # twice the coordinator's 16 server threads
    results = []
    pollers = [threading.Thread(target=lambda: results.append(remote.join(timeout=120)), name=f"test-join-{i}")
               for i in range(polls)]
    try:
        gate = coord.create_variable("gate", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        cluster.add_worker()
        coord.wait_for_workers(1)
        worker = coord.snapshot().workers[0]
        value = remote.schedule(hold_until_released, args=(gate,))  # the remote job's join waits for it
        until(lambda: coord.snapshot().running == 1, "the gated closure to start")
        for poller in pollers:
            poller.start()
        until(lambda: coord.long_polls.waiting == coord.long_polls.limit, "the long polls to fill every slot")
        start = coord.snapshot().workers[0].last_seen
        timeout = coord.settings.heartbeat_timeout_s
        stub = pb_grpc.CoordinatorStub(rpc.open_channel(cluster.settings().cluster.coordinator, cluster.settings()))
        # heartbeats keep arriving for twice the heartbeat timeout while the polls wait
        while coord.snapshot().workers[0].last_seen < start + 2 * timeout:
            status = stub.Status(pb.CoordinatorStatusRequest(), timeout=10.0)  # never queued behind a poll
            assert [w.worker_id for w in status.workers] == [worker.wid]
            time.sleep(0.05)
        assert coord.snapshot().workers[0].wid == worker.wid and coord.status().retried == 0
        gate.push(np.array(-1, np.int64))
        assert value.fetch(timeout=60) == 1
        for poller in pollers:
            poller.join(timeout=60)
        assert results == [None] * polls
    finally:
        remote.close()
        coord.shutdown()


class GarbagePs:
    """Stands in for a restarted PS on its port: answers Status with a new incarnation, ListShards with garbage."""

    def __init__(self, address):
        handlers = {
            "Status": grpc.unary_unary_rpc_method_handler(
                lambda request, context: pb.PsStatus(ps_index=0, num_ps=1, incarnation=424242),
                request_deserializer=pb.PsStatusRequest.FromString, response_serializer=pb.PsStatus.SerializeToString),
            "ListShards": grpc.unary_unary_rpc_method_handler(
                lambda request, context: b"\xff\xff\xff\xff", request_deserializer=pb.ListShardsRequest.FromString,
                response_serializer=bytes),
        }
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("pscluster.ParameterServer",
                                                                                   handlers)])
        assert self.server.add_insecure_port(address) != 0
        self.server.start()


def test_a_monitor_that_cannot_account_a_restart_fails_join_with_the_cause(fresh_cluster):
    cluster = fresh_cluster(1, 1, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    impostor = None
    try:
        coord.wait_for_workers(1)
        assert coord.schedule(identity, args=(1,)).fetch(timeout=60) == 1
        victim = cluster.ps[0]
        cluster.kill(victim, signal.SIGKILL)
        victim.proc.wait(timeout=30)
        impostor = GarbagePs(cluster.settings().cluster.ps[0])
        until(lambda: coord.snapshot().paused, "the monitor to pause dispatch")
        coord.schedule(identity, args=(2,))
        with pytest.raises(InternalError, match="ps-monitor") as info:
            coord.join(timeout=120)  # the monitor gives up after its retries; join must not hang
        assert isinstance(info.value.__cause__, PsclusterError)
        with pytest.raises(InternalError):
            coord.done()
    finally:
        coord.shutdown()
        if impostor is not None:
            impostor.server.stop(0)
