"""A PS restarted from a checkpoint older than some variables gets them again (client.recreate_missing), but
only the shards that live there now (pscluster/client/variables.py `missing_here`).

Before: a shard was made again on its placement PS (ordinal mod P) even when a scale had moved it elsewhere: an
empty stray copy, never routed to or saved, holding the shard's memory on a PS that does not own it.
"""

from __future__ import annotations

import threading

from pscluster.coordinator.ps_monitor import PsMonitor
from pscluster.coordinator.replicas import Copies
from pscluster.proto import pscluster_pb2 as pb

from pscluster.client.variables import missing_here
from tests.unit.test_ps_monitor import FakeClient, run_until


def create(variable: str, index: int) -> pb.CreateShardRequest:
    return pb.CreateShardRequest(spec=pb.ShardSpec(variable=variable, shard_index=index))


CALLS = [(0, "CreateShard", create("a", 0)), (1, "CreateShard", create("a", 1)), (0, "CreateShard", create("b", 0))]


def keys(calls):
    return [(ps, c.spec.variable, c.spec.shard_index) for ps, _, c in calls]


def test_without_a_replica_table_a_restarted_ps_gets_its_placed_shards_it_lacks():
    assert keys(missing_here(0, CALLS, {("b", 0)}, None)) == [(0, "a", 0)]


def test_a_shard_a_scale_moved_off_the_restarted_ps_is_not_made_again_there():
    primaries = {("a", 0): 2, ("a", 1): 0, ("b", 0): 0}  # a[0] moved to PS 2, a[1] moved onto PS 0
    assert keys(missing_here(0, CALLS, set(), primaries)) == [(0, "a", 1), (0, "b", 0)]
    assert keys(missing_here(2, CALLS, set(), primaries)) == [(2, "a", 0)]
    assert keys(missing_here(0, CALLS, set(), {})) == [(0, "a", 0), (0, "b", 0)]  # no row yet: its placement


def test_the_monitor_passes_the_replica_tables_primaries_when_it_accounts_a_restart():
    client = FakeClient([1, 2])
    asked: list = []
    accounted = threading.Event()

    def recreate_missing(ps, primaries=None):
        asked.append((ps, primaries))
        accounted.set()
        return 0

    client.recreate_missing = recreate_missing
    monitor = PsMonitor(client, on_down=lambda: None, on_up=lambda: None, interval=0.01,
                        replicated=True,
                        table=lambda: {("w", 0): Copies(1, 0, 3), ("w", 1): Copies(0, None, 2)})
    client.incarnations[0] = 5  # PS 0 restarted
    run_until(monitor, accounted)
    assert asked[0] == (0, {("w", 0): 1, ("w", 1): 0})
