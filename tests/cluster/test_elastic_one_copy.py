"""Elastic PS with one copy (replicas: 1, elastic: true; docs/elastic.md): a drain and an add under async
training move shards through a temporary backup, with no lost or double-applied update, and a PS restarted
after the moves restores the shards the table gives it from the checkpoint.

Three PS daemons hold six one-shard counters with no backups; async closures on two workers push +1 to every
counter. PS 2 is drained under load, then added back under load. Oracle: every counter equals the closures
completed and lost_updates() is 0. Then a checkpoint, 10 more closures, and the PS holding a counter the moves
put there is killed and restarted: each of its counters comes back at the checkpoint, and lost_updates()
counts exactly the 10 closures each of them lost.
"""

import pytest

import pscluster as ps
from pscluster.errors import FailedPreconditionError, InvalidArgumentError
from tests.cluster.replicas import increment, poll

pytestmark = pytest.mark.cluster

COUNTERS = 6


def primaries(coord):
    return {key[0]: c.primary for key, c in coord.replica_table().items() if key[0].startswith("counter")}


def test_one_copy_drain_and_add_under_load_then_a_restart_restores_a_moved_shard(fresh_cluster, tmp_path):
    cluster = fresh_cluster(3, 2, elastic=True, supervise=False, checkpoint_dir=tmp_path / "ckpt")
    coord = ps.ClusterCoordinator(cluster.settings(auto_checkpoint=False))
    try:
        coord.wait_for_workers(2)
        counters = [coord.create_variable(f"counter{i}", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
                    for i in range(COUNTERS)]
        poll(lambda: len(coord.replica_table()) == COUNTERS + 1, "the table to hold every counter")
        assert all(c.backup is None for c in coord.replica_table().values())  # one copy: no backups
        placed = primaries(coord)
        before = coord.replica_table()
        with pytest.raises(InvalidArgumentError, match="at least 1 must be active"):
            coord.scale_ps(0)
        with pytest.raises(FailedPreconditionError, match="ps 1 is active already"):
            coord.add_ps(1)
        assert coord.replica_table() == before  # refusals change nothing

        values = [coord.schedule(increment, args=tuple(counters)) for _ in range(60)]
        poll(lambda: int(counters[0].pull()) >= 15, "pushes under way")
        drained = coord.remove_ps(2)  # under load
        assert drained.active == [0, 1] and len(drained.freezes_s) == 2
        table = coord.replica_table()
        assert all(c.primary in (0, 1) and c.backup is None for c in table.values())
        assert coord.client.status()[2].num_shards == 0  # it dropped every copy
        values += [coord.schedule(increment, args=tuple(counters)) for _ in range(60)]
        poll(lambda: int(counters[0].pull()) >= 75, "pushes under way again")
        grown = coord.add_ps(2)  # under load
        assert grown.active == [0, 1, 2] and len(grown.freezes_s) == 2
        assert sorted(primaries(coord).values()) == [0, 0, 1, 1, 2, 2]
        coord.join(timeout=30)
        completed = sum(v.fetch() for v in values)
        assert completed == 120
        assert [int(c.pull()) for c in counters] == [completed] * COUNTERS
        assert coord.lost_updates == 0

        # a restart after the moves restores the shards the table gives the PS, from its own file
        now = primaries(coord)
        moved = sorted(name for name in now if now[name] != placed[name])
        assert moved  # a drain and an add put some counter on a PS that was not its first
        victim = now[moved[0]]
        coord.checkpoint()
        values = [coord.schedule(increment, args=tuple(counters)) for _ in range(10)]
        coord.join(timeout=30)
        assert sum(v.fetch() for v in values) == 10
        cluster.kill(cluster.ps[victim])
        cluster.restart(cluster.ps[victim])
        poll(lambda: not any(c.lost for c in coord.replica_table().values()), "the shards back from the checkpoint")
        assert primaries(coord) == now  # the moved shards stay where the table has them
        on_victim = {name for name, holder in now.items() if holder == victim}
        poll(lambda: coord.lost_updates == 10 * len(on_victim), "the restart's losses to be counted")
        lost = coord.lost_updates_by_variable()
        for i, counter in enumerate(counters):
            name = f"counter{i}"
            expected = completed if name in on_victim else completed + 10
            assert (int(counter.pull()), lost.get(name, 0)) == (expected, 10 * (name in on_victim))
    finally:
        coord.shutdown()
