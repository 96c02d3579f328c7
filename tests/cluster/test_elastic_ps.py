"""Elastic PS (docs/elastic.md): draining a PS and bringing it back under load moves shards with no lost or
double-applied update.

Three PS daemons with replicas: 2 hold six one-shard counters; async closures push +1 to every counter
(SGD(1.0) on a gradient of -1). While they run, PS 2 is drained (its primaries are frozen and switched to
other PS tasks, its backups move) with `pscluster scale --remove 2`, through the coordinator's gRPC
service, and then brought back with coord.add_ps(2) (it takes its share again). Oracle: every counter equals
exactly the number of completed closures, and lost_updates() is 0.
"""

import time

import numpy as np
import pytest

import pscluster as ps
from pscluster.errors import FailedPreconditionError, InvalidArgumentError
from pscluster.ops import cli
from pscluster.placement import SYNC_STATE_KEY
from pscluster.tables import TableConfig
from tests.cluster.replicas import increment, poll

pytestmark = pytest.mark.cluster

COUNTERS = 6


def holders(coord):
    table = coord.replica_table()
    return {ps_ for c in table.values() for ps_ in (c.primary, c.backup)}, table


def in_sync_counters(coord: ps.ClusterCoordinator) -> list:
    """COUNTERS one-shard int64 counters, once both workers are up and every counter's backup holds it."""
    coord.wait_for_workers(2)
    counters = [coord.create_variable(f"counter{i}", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
                for i in range(COUNTERS)]
    poll(lambda: len(t := coord.replica_table()) == COUNTERS + 1 and all(c.in_sync for c in t.values()),
         "every counter's backup to hold it")
    return counters


def test_draining_a_ps_and_bringing_it_back_under_load_counts_every_increment_once(fresh_cluster, capsys):
    cluster = fresh_cluster(3, 2, replicas=2)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        counters = in_sync_counters(coord)
        # bad input changes nothing
        before = coord.replica_table()
        with pytest.raises(InvalidArgumentError, match="unknown PS task 7"):
            coord.remove_ps(7)
        with pytest.raises(FailedPreconditionError, match="ps 1 is active already"):
            coord.add_ps(1)
        with pytest.raises(InvalidArgumentError, match="at least 2 active"):
            coord.scale_ps(1)
        assert cli.main(["scale", "--remove", "9", "--cluster", str(cluster.cluster_file)]) == 1
        assert "unknown PS task 9: this cluster has PS tasks 0..2" in capsys.readouterr().err
        assert coord.replica_table() == before

        values = [coord.schedule(increment, args=tuple(counters)) for _ in range(150)]
        poll(lambda: int(counters[0].pull()) >= 20, "pushes under way")
        assert cli.main(["scale", "--remove", "2", "--cluster", str(cluster.cluster_file)]) == 0  # under load
        assert "active PS tasks: 0, 1;" in capsys.readouterr().out
        assert 2 not in holders(coord)[0]
        assert coord.client.status()[2].num_shards == 0  # drained: it dropped every copy
        values += [coord.schedule(increment, args=tuple(counters)) for _ in range(150)]
        poll(lambda: int(counters[0].pull()) >= 170, "pushes under way again")
        grown = coord.add_ps(2)  # under load
        table = holders(coord)[1]
        assert sum(1 for c in table.values() if c.primary == 2) == 2  # six shards on three PS: its share
        coord.join(timeout=30)
        completed = sum(v.fetch() for v in values)
        assert completed == 300
        assert [int(c.pull()) for c in counters] == [completed] * COUNTERS
        assert coord.lost_updates == 0
        assert grown.active == [0, 1, 2] and grown.moved > 0 and len(grown.freezes_s) == 2
        coord.remove_ps(2)
        # a sync job: each move falls between two steps (the open step's gradients still land on the old
        # primary, the next step's go to the new one); every step applies its one update exactly once
        coord.configure_sync("sync", replicas_to_aggregate=2, total_num_replicas=2)
        values = [coord.schedule(increment, args=tuple(counters)) for _ in range(80)]
        poll(lambda: int(counters[0].pull()) >= completed + 5, "sync steps under way")
        assert len(coord.add_ps(2).freezes_s) == 2  # under sync training
        # the token queue's primary (PS 0, or its backup after a failover under load) drained under sync
        # training: the queue moves to another PS with its token calls frozen (a waiting TakeToken retries
        # there with its closure id)
        holder = coord.replica_table()[SYNC_STATE_KEY].primary
        assert coord.remove_ps(holder).active == sorted({0, 1, 2} - {holder})
        row = coord.replica_table()[SYNC_STATE_KEY]
        assert holder not in (row.primary, row.backup) and holder not in holders(coord)[0] and row.in_sync
        coord.join(timeout=60)
        assert sum(v.fetch() for v in values) == 80
        assert [int(c.pull()) for c in counters] == [completed + 40] * COUNTERS  # 40 steps of R = 2 closures
        assert coord.global_step == 40 and coord.lost_updates == 0
        completed += 40
        # a variable created while `holder` is drained places no shard on it (not `k mod P`)
        coord.create_variable("late", shape=(6,), dtype="int64", optimizer=ps.SGD(1.0),
                              partitioner=ps.FixedShardsPartitioner(3))
        poll(lambda: sum(k[0] == "late" and c.in_sync for k, c in coord.replica_table().items()) == 3,
             "the new variable's backups")
        assert all(holder not in (c.primary, c.backup) for k, c in coord.replica_table().items() if k[0] == "late")
        table = {key: (c.primary, c.backup) for key, c in coord.replica_table().items()}
        coord.configure_sync("async")
        coord.shutdown()
        # a restarted coordinator goes on from the table the PS tasks hold, not from the initial placement
        coord = ps.ClusterCoordinator(cluster.settings())
        poll(lambda: {key: (c.primary, c.backup) for key, c in coord.replica_table().items()} == table,
             "the new coordinator to take the PS tasks' table")
        counters = [coord.create_variable(f"counter{i}", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
                    for i in range(COUNTERS)]
        coord.wait_for_workers(2)
        values = [coord.schedule(increment, args=tuple(counters)) for _ in range(10)]
        coord.join(timeout=30)
        assert [int(c.pull()) for c in counters] == [completed + 10] * COUNTERS
    finally:
        coord.shutdown()


def test_a_ps_the_cluster_file_does_not_list_joins_takes_shards_under_load_then_leaves(fresh_cluster, capsys):
    cluster = fresh_cluster(2, 2, replicas=2)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        counters = in_sync_counters(coord)
        values = [coord.schedule(increment, args=tuple(counters)) for _ in range(100)]
        poll(lambda: int(counters[0].pull()) >= 20, "pushes under way")
        with pytest.raises(InvalidArgumentError, match="is not a host:port address"):
            coord.join_ps("127.0.0.1")  # bad input changes nothing
        joined = cluster.add_ps()  # `pscluster ps --join`: the coordinator gives it the next task index
        assert joined.index == 2
        grown = coord.add_ps(2)  # under load
        table = holders(coord)[1]
        assert grown.active == [0, 1, 2] and len(grown.freezes_s) == 2
        assert sum(1 for c in table.values() if c.primary == 2) == 2  # six shards on three PS: its share
        assert coord.client.num_ps == 3 and coord.client.status()[2].num_shards > 0
        # a variable created now is placed over the new list: one of its three shards on each PS
        wide = coord.create_variable("wide", shape=(6, 2), dtype="float32", optimizer=ps.SGD(1.0),
                                     partitioner=ps.FixedShardsPartitioner(3))
        poll(lambda: len(t := coord.replica_table()) == COUNTERS + 4 and all(c.in_sync for c in t.values()),
             "the new variable's backups")
        assert {c.primary for key, c in coord.replica_table().items() if key[0] == "wide"} == {0, 1, 2}
        capsys.readouterr()
        assert cli.main(["status", "--cluster", str(cluster.cluster_file)]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if cluster.address_of(joined) in line)
        assert "up (joined)" in row
        values += [coord.schedule(increment, args=tuple(counters)) for _ in range(100)]
        poll(lambda: int(counters[0].pull()) >= 120, "pushes under way on three PS")
        shrunk = cluster.scale(coord, 2)  # drained, it leaves the PS list and its process stops
        assert shrunk.active == [0, 1] and 2 not in holders(coord)[0] and coord.client.num_ps == 2
        assert joined.proc.poll() is not None
        coord.join(timeout=30)
        completed = sum(v.fetch() for v in values)
        assert completed == 200
        assert [int(c.pull()) for c in counters] == [completed] * COUNTERS
        assert coord.lost_updates == 0
        np.testing.assert_array_equal(wide.pull(), np.zeros((6, 2), np.float32))  # its PS 2 shard moved off
    finally:
        coord.shutdown()


def _model(coord):
    """A dense (Adam), a fixed sparse (Adagrad) and a dynamic table (Adam) variable, 3 shards each."""
    three = ps.FixedShardsPartitioner(3)
    return (coord.create_variable("w", shape=(6, 4), dtype="float32", optimizer=ps.Adam(0.1), partitioner=three),
            coord.create_variable("emb", shape=(30, 4), dtype="float32", optimizer=ps.Adagrad(0.5), sparse=True,
                                  partitioner=three),
            coord.create_variable("tab", shape=(None, 4), dtype="float32", optimizer=ps.Adam(0.05), sparse=True,
                                  table=TableConfig(dim=4, capacity=1_000), partitioner=three))


ROWS, KEYS = np.array([0, 7, 12, 23, 29]), np.array([-9, 4, 10**12, 77, 5], np.int64)


def _train(coord, model, n):
    """Push n fixed gradients (push ids from n: a retry applies once) to every variable."""
    w, emb, tab = model
    rng = np.random.default_rng(n)
    coord.client.push([(w, rng.standard_normal((6, 4)).astype(np.float32))], push_id=f"w{n}")
    coord.client.push_rows(emb, ROWS, rng.standard_normal((5, 4)).astype(np.float32))
    coord.client.push_rows(tab, KEYS, rng.standard_normal((5, 4)).astype(np.float32))


def _values(coord, model):
    w, emb, tab = model
    return [w.pull(), emb.pull(), coord.client.pull_rows(tab, KEYS)]


def _check_restored(coord, model, saved, after):
    """The restored values equal the saved ones, and the same gradient then gives what it gave after the save
    (so the optimizer slots came back too)."""
    for got, want in zip(_values(coord, model), saved):
        np.testing.assert_array_equal(got, want)
    _train(coord, model, 99)
    for got, want in zip(_values(coord, model), after):
        np.testing.assert_array_equal(got, want)


def _in_sync(coord, shards=10):
    poll(lambda: len(t := coord.replica_table()) == shards and all(c.in_sync for c in t.values()),
         "every shard's backup to hold it")


def test_a_checkpoint_after_moves_restores_values_and_slots_exactly_on_a_ps_restart_and_a_whole_restart(
        fresh_cluster, tmp_path):
    """After a drain, shard k's holders are not k mod P. A checkpoint then puts every shard back exactly,
    (a) in the running cluster when both holders of every shard restart and (b) in a whole new cluster with
    the file's P. The same gradient pushed after the save and after each restore gives the same values: the
    optimizer slots (Adam's m, v, step; Adagrad's accumulator; the table's rows and slots) came back too."""
    ckpt = tmp_path / "ckpt"
    cluster = fresh_cluster(3, 0, replicas=2, supervise=False, checkpoint_dir=ckpt)
    coord = ps.ClusterCoordinator(cluster.settings(auto_checkpoint=False))
    try:
        model = _model(coord)
        _in_sync(coord)
        for n in range(3):
            _train(coord, model, n)
        coord.remove_ps(2)  # PS 2's primaries and backups move to PS 0 and 1
        assert 2 not in holders(coord)[0]
        for n in range(3, 5):
            _train(coord, model, n)
        coord.checkpoint(5)
        saved = _values(coord, model)
        _train(coord, model, 99)
        after = _values(coord, model)
        # (a) both copies of every shard die: each comes back from the checkpoint on a holder, wherever it is
        for daemon in cluster.ps[:2]:
            cluster.kill(daemon)
        for daemon in cluster.ps[:2]:
            cluster.restart(daemon)
        poll(lambda: all(c.in_sync and not c.lost for c in coord.replica_table().values()),
             "the shards back from the checkpoint", timeout=30)
        _check_restored(coord, model, saved, after)
    finally:
        coord.shutdown()
    cluster.stop()
    # (b) the whole cluster restarts from the files with the cluster file's P
    again = fresh_cluster(3, 0, replicas=2, supervise=False, checkpoint_dir=ckpt, restore=True)
    coord = ps.ClusterCoordinator(again.settings(auto_checkpoint=False))
    try:
        model = _model(coord)
        _in_sync(coord)
        _check_restored(coord, model, saved, after)
    finally:
        coord.shutdown()


def test_a_joined_ps_holding_the_token_queues_backup_leaves_a_sync_job_with_every_step_exact(fresh_cluster):
    """PS 1, the sync state's backup, dies under a sync job: the row's new backup is the joined PS 2 (the only
    other active PS). Scaling back to 2 PS moves that backup to PS 1 (no freeze: PS 0 keeps granting tokens)
    and PS 2 leaves. Every step applies once: counters == global step == 20 (40 closures, R = 2)."""
    cluster = fresh_cluster(2, 2, replicas=2)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        counters = in_sync_counters(coord)
        coord.configure_sync("sync", replicas_to_aggregate=2, total_num_replicas=2)
        joined = cluster.add_ps()
        coord.add_ps(joined.index)  # it missed the mode's fan-out: add_ps gives it the mode (configure_sync_on)
        values = [coord.schedule(increment, args=tuple(counters)) for _ in range(40)]
        poll(lambda: int(counters[0].pull()) >= 5, "sync steps under way")
        cluster.kill(cluster.ps[1])  # the supervisor restarts it
        poll(lambda: (row := coord.replica_table()[SYNC_STATE_KEY]).backup == 2 and row.in_sync,
             "the token queue's new backup on the joined PS", timeout=30)
        deadline = time.monotonic() + 30
        while True:  # refused, changing nothing, until the keeper sees the restarted PS 1 answer
            try:
                shrunk = cluster.scale(coord, 2)
                break
            except FailedPreconditionError:
                assert time.monotonic() < deadline, "PS 1 did not come back"
                time.sleep(0.1)
        row = coord.replica_table()[SYNC_STATE_KEY]
        assert (row.primary, row.backup) == (0, 1) and shrunk.active == [0, 1]
        assert 2 not in holders(coord)[0] and joined.proc.poll() is not None  # it left the list and stopped
        coord.join(timeout=60)
        assert sum(v.fetch() for v in values) == 40
        assert [int(c.pull()) for c in counters] == [20] * COUNTERS
        assert coord.global_step == 20
        assert coord.lost_updates == 0
    finally:
        coord.shutdown()
