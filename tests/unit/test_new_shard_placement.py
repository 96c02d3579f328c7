"""A variable created while a scale has drained PS tasks places no shard on them (pscluster/placement.py's
ps_for_new_shard): the coordinator's table names the drained tasks (coordinator/replica_keeper.py), every PS
keeps that list from SetRoles and returns it with GetRoles (server/ps.py), and a client reads it before it
places a new variable (pscluster/client/routes.py). No sockets: stubs answer from memory."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
from pscluster.coordinator.replica_keeper import ReplicaKeeper
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server.replication import Role

from pscluster.client.routes import Routes
from pscluster.errors import InvalidArgumentError
from pscluster.placement import ps_for_new_shard
from tests.unit.test_replica_keeper import Ps, sent
from tests.unit.test_replication import make_core


def test_new_shards_go_round_robin_over_the_ps_tasks_not_drained() -> None:
    assert [ps_for_new_shard(k, 3) for k in range(6)] == [0, 1, 2, 0, 1, 2]  # nothing drained: k mod P
    assert [ps_for_new_shard(k, 3, {2}) for k in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [ps_for_new_shard(k, 4, frozenset({0, 2})) for k in range(4)] == [1, 3, 1, 3]
    assert [ps_for_new_shard(k, 2, {0, 1}) for k in range(3)] == [0, 1, 0]  # all drained: cannot be; k mod P
    with pytest.raises(InvalidArgumentError, match="at least one PS task"):
        ps_for_new_shard(0, 0)


def test_the_keeper_sends_the_drained_tasks_with_the_table() -> None:
    empty = pb.SetRolesRequest()
    stubs = [Ps(0, [("a", 0)], empty), Ps(1, [], empty), Ps(2, [], empty)]
    keeper = ReplicaKeeper(stubs)
    try:
        keeper.set_inactive({2})
        keeper._round()
        sent(keeper)
        assert all(list(s.table.drained) == [2] for s in stubs)
    finally:
        keeper.stop()


def test_a_ps_keeps_the_newest_tables_drained_tasks_for_get_roles() -> None:
    core = make_core(0, {}, {})
    try:
        key = ("w", 0)
        core.take_roles(3, [Role(key, 1, 0, -1)], [], 0, [2])
        assert core.drained() == [2]
        core.take_roles(2, [Role(key, 1, 0, -1)], [], 0, [])  # an older table, late: changes nothing
        assert core.drained() == [2]
        core.take_roles(4, [Role(key, 1, 0, -1)], [], 0, [])  # PS 2 added back
        assert core.drained() == []
    finally:
        core.replication.stop()


class Stub:
    """GetRoles.future of one PS, answered from memory."""

    def __init__(self, table: pb.SetRolesRequest) -> None:
        self.GetRoles = self
        self.table = table

    def future(self, request: pb.GetRolesRequest, timeout: float) -> Future[Any]:
        done: Future[Any] = Future()
        done.set_result(self.table)
        return done


def test_a_client_learns_the_drained_tasks_from_the_newest_table() -> None:
    old = pb.SetRolesRequest(version=3, drained=[1])
    new = pb.SetRolesRequest(version=5, drained=[2], roles=[
        pb.ShardRole(ref=pb.ShardRef(variable="a", shard_index=0), epoch=2, primary=0, backup=1)])
    routes = Routes(lambda: [Stub(old), Stub(new)])
    assert routes.refresh() and routes.drained == {2}
    assert [ps_for_new_shard(k, 3, routes.drained) for k in (1, 2)] == [1, 0]
