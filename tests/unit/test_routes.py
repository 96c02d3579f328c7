"""Client routing with replicas: 2 (pscluster/client/routes.py): plans follow each shard's primary."""

from __future__ import annotations

import time
from concurrent.futures import Future

import grpc
import numpy as np
import pytest
from pscluster.proto import pscluster_pb2 as pb

from pscluster.client.routes import RETRY_CAP_S, ROUTED_RETRY_CAP_S, Routes, retry_wait
from pscluster.errors import UnavailableError


class Down(grpc.RpcError):
    pass


class Stub:
    """A PS's GetRoles: answers with its table, or fails as a dead PS."""

    def __init__(self, table: pb.SetRolesRequest | None) -> None:
        self.table = table
        self.GetRoles = self

    def future(self, request: pb.GetRolesRequest, timeout: float) -> Future:
        fut: Future = Future()
        if self.table is None:
            fut.set_exception(Down())
        else:
            fut.set_result(self.table)
        return fut


def table(version: int, primaries: dict[tuple[str, int], int]) -> pb.SetRolesRequest:
    return pb.SetRolesRequest(version=version, roles=[
        pb.ShardRole(ref=pb.ShardRef(variable=v, shard_index=i), epoch=version, primary=p, backup=-1)
        for (v, i), p in primaries.items()])


def item(name: str, shard: int) -> pb.PushItem:
    return pb.PushItem(ref=pb.ShardRef(variable=name, shard_index=shard))


def test_a_plan_is_left_alone_until_a_shard_moved() -> None:
    routes = Routes(lambda: [Stub(None), Stub(None)])
    plan = {0: [(item("w", 0), np.zeros(2))], 1: [(item("w", 1), np.zeros(2))]}
    assert routes.route(plan)[0] is plan


def test_the_newest_table_of_the_live_ps_wins_and_items_follow_their_primary() -> None:
    stubs = [Stub(None), Stub(table(3, {("w", 0): 1, ("w", 1): 1})), Stub(table(2, {("w", 0): 2}))]
    routes = Routes(lambda: stubs)
    assert routes.refresh() and routes.version == 3
    assert not routes.refresh()  # nothing newer
    a, b, c = np.zeros(1), np.ones(1), np.full(1, 2.0)
    plan = {0: [(item("w", 0), a), (item("v", 0), b)], 1: [(item("w", 1), c)]}
    targets = {0: ["ta", "tb"], 1: ["tc"]}
    routed, routed_targets = routes.route(plan, targets)
    assert {ps: [(i.ref.variable, i.ref.shard_index) for i, _ in items] for ps, items in routed.items()} == \
        {1: [("w", 0), ("w", 1)], 0: [("v", 0)]}
    assert routed_targets == {1: ["ta", "tc"], 0: ["tb"]}  # the fused reply's targets stay aligned


class Stopped:
    """A SIGSTOPped PS's GetRoles: never answers (its future only ends when cancelled)."""

    def __init__(self) -> None:
        self.GetRoles = self
        self.cancelled: list[Future] = []

    def future(self, request: pb.GetRolesRequest, timeout: float) -> Future:
        fut: Future = Future()
        self.cancelled.append(fut)
        return fut


def test_a_ps_that_never_answers_delays_a_refresh_by_the_grace_not_the_timeout() -> None:
    stopped = Stopped()
    routes = Routes(lambda: [stopped, Stub(table(4, {("w", 0): 1}))], timeout=5.0)
    started = time.monotonic()
    assert routes.refresh() and routes.primary == {("w", 0): 1}
    assert time.monotonic() - started < 1.0  # the grace past the live PS's answer (was: the 5 s timeout)
    assert all(f.cancelled() for f in stopped.cancelled)


def test_a_retry_goes_at_once_when_the_table_moved_and_backs_off_briefly_while_it_did_not() -> None:
    assert retry_wait(0.08, moved=True, routed=True) == (0.0, 0.08)
    waits, backoff = [], 0.02
    for _ in range(6):
        wait, backoff = retry_wait(backoff, moved=False, routed=True)
        waits.append(wait)
    # a failover takes ~0.1 s after a kill: doubling to 0.5 s would put the retry that finds the new primary
    # up to 300 ms after the first failure (B15's p50 was 335 ms)
    assert max(waits) <= ROUTED_RETRY_CAP_S and sum(waits[:4]) < 0.2
    assert retry_wait(0.4, moved=False, routed=False) == (0.4, RETRY_CAP_S)


def test_a_newer_ps_list_is_handed_on_before_the_table_and_a_ps_that_left_gets_nothing() -> None:
    grown = table(5, {("w", 0): 2})
    grown.ps_addresses[:] = ["h:1", "h:2", "h:3"]
    grown.ps_epoch = 1
    stubs = [Stub(grown), Stub(grown)]
    lists: list[list[str]] = []

    def follow(addresses: list[str]) -> None:  # the client opens channels to the PS that joined
        lists.append(addresses)
        stubs[len(stubs):] = [Stub(grown) for _ in addresses[len(stubs):]]
        del stubs[len(addresses):]

    routes = Routes(lambda: stubs, on_ps_list=follow)
    assert routes.refresh() and lists == [["h:1", "h:2", "h:3"]] and len(stubs) == 3
    plan = {0: [(item("w", 0), np.zeros(1))]}
    assert list(routes.route(plan)[0]) == [2]  # onto the PS that joined
    shrunk = table(6, {("w", 0): 1})
    shrunk.ps_addresses[:] = ["h:1", "h:2"]
    shrunk.ps_epoch = 2
    stale = Routes(lambda: stubs[:2])  # a client that saw ps 2 leave, with a handle placed there
    with pytest.raises(UnavailableError, match="ps 2 left the PS list"):
        stale.route({2: [(item("w", 0), np.zeros(1))]})
    for stub in stubs:
        stub.table = shrunk
    assert routes.refresh() and lists[-1] == ["h:1", "h:2"] and len(stubs) == 2
    assert list(routes.route({2: [(item("w", 0), np.zeros(1))]})[0]) == [1]  # the retry goes where it is now


def test_a_clients_channels_follow_the_ps_list_as_it_grows_moves_and_shrinks() -> None:
    from pscluster.config import validate
    from pscluster.net.channels import Channels

    net = Channels(validate({"cluster": {"ps": ["127.0.0.1:1", "127.0.0.1:2"]}, "replicas": 2}),
                   ["127.0.0.1:1", "127.0.0.1:2"])
    try:
        first = list(net.stubs)
        assert net.resize(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]) == [2]  # ps 2 joined
        assert len(net.stubs) == 3 and net.stubs[:2] == first and net.what(2, "Push") == "ps 2 (127.0.0.1:3) Push"
        assert net.resize(["127.0.0.1:1", "127.0.0.1:2"]) == [] and len(net.stubs) == 2  # it left
        # another PS joined as ps 2 while this client looked away: a new channel, at its address
        assert net.resize(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:4"]) == [2] and net.addresses[2] == "127.0.0.1:4"
        assert net.resize(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:5"]) == [2] and net.addresses[2] == "127.0.0.1:5"
        assert net.stubs[:2] == first
    finally:
        net.close()


class Silent:
    """A gRPC future of a call to a SIGSTOPped PS: no reply until cancelled."""

    def __init__(self) -> None:
        self.cancelled = False

    def result(self, timeout: float | None = None) -> object:
        time.sleep(timeout or 0)
        raise grpc.FutureTimeoutError()

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_a_grpc_push_to_a_silent_ps_the_table_moved_its_shard_off_is_given_up_at_the_next_check() -> None:
    """bulk_transport: false: the same bound as the bulk path's (tests/integration/test_stalled_reader.py);
    before, the call waited rpc_timeout_s (60 s)."""
    from pscluster.config import ClusterSpec, Settings
    from pscluster.errors import UnavailableError
    from pscluster.net.channels import Channels

    silent = Silent()

    class SilentPs:
        class Push:
            @staticmethod
            def future(request: pb.PushRequest, timeout: float) -> Silent:
                return silent

    net = Channels(Settings(cluster=ClusterSpec(ps=["127.0.0.1:1"])), ["127.0.0.1:1"])
    try:
        net.stubs = [SilentPs()]  # type: ignore[list-item]
        routes = Routes(lambda: [Stub(table(2, {("w", 0): 1}))])
        net.stalled = routes.moved_off
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="replica table moved"):
            net.gather([(0, "Push", pb.PushRequest(items=[item("w", 0)]))])
        assert time.monotonic() - started < 2 and silent.cancelled
    finally:
        net.pool.shutdown()
