"""replicas: 2: a primary PS SIGKILLed mid-push loses no acknowledged update (docs/ps_failures.md).

Async training increments a counter (SGD(1.0) on a gradient of -1, one push per closure). The primary
of the counter is SIGKILLed while closures push; its in-sync backup is promoted, workers retry their
in-flight pushes with the same ids there, and the restarted PS rejoins as backup (catch-up); then the
new primary is killed too and the rejoined PS is promoted. Oracle: the counter equals exactly the
number of completed closures, and lost_updates() is 0.
"""

import contextlib
import signal
import time

import numpy as np
import pytest

import pscluster as ps
from pscluster.placement import SYNC_STATE_KEY
from tests.cluster.replicas import CallLoop, increment, poll, primary_of, sigstopped, wait_rejoined_as_backup

pytestmark = pytest.mark.cluster


def test_killing_the_primary_twice_mid_push_loses_no_acknowledged_increment(fresh_cluster):
    cluster = fresh_cluster(2, 2, supervise=True, replicas=2)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(2)
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        key = ("counter", 0)
        poll(lambda: (c := primary_of(coord, key)) is not None and c.in_sync, "the backup to hold the counter")
        values = []
        for kill in range(2):
            before = primary_of(coord, key)
            values += [coord.schedule(increment, args=(counter,)) for _ in range(100)]
            poll(lambda: int(counter.pull()) >= 30 + 100 * kill, "pushes under way")
            cluster.kill(cluster.ps[before.primary], signal.SIGKILL)  # mid-push: closures are in flight
            poll(lambda: primary_of(coord, key).primary != before.primary, "the backup's promotion")
            coord.join(timeout=20)
            if kill == 0:
                # the killed PS restarts (supervisor), catches up and rejoins as backup before the next kill
                poll(lambda: (c := primary_of(coord, key)).backup == before.primary and c.in_sync,
                     "the restarted PS to rejoin as backup")
        completed = sum(v.fetch() for v in values)
        assert completed == 200
        assert int(counter.pull()) == completed
        assert coord.lost_updates == 0
    finally:
        coord.shutdown()


def test_killing_the_backup_mid_push_holds_no_push_back_and_it_rejoins(fresh_cluster):
    cluster = fresh_cluster(2, 2, supervise=True, replicas=2)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(2)
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        key = ("counter", 0)
        poll(lambda: (c := primary_of(coord, key)) is not None and c.in_sync, "the backup to hold the counter")
        before = primary_of(coord, key)
        values = [coord.schedule(increment, args=(counter,)) for _ in range(100)]
        poll(lambda: int(counter.pull()) >= 30, "pushes under way")
        cluster.kill(cluster.ps[before.backup], signal.SIGKILL)  # pushes waiting for it are released
        coord.join(timeout=20)
        assert primary_of(coord, key).primary == before.primary  # the primary stays; one copy meanwhile
        assert int(counter.pull()) == sum(v.fetch() for v in values) == 100
        poll(lambda: (c := primary_of(coord, key)).backup == before.backup and c.in_sync,
             "the restarted backup to catch up")
        assert coord.lost_updates == 0
    finally:
        coord.shutdown()


def test_sync_training_survives_a_kill_of_a_primary_other_than_ps0(fresh_cluster):
    # the counter is put on PS 1: its kill moves a shard's primary but not the token queue (PS 0's)
    cluster = fresh_cluster(2, 2, supervise=True, replicas=2)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(2)
        coord.create_variable("first", shape=(), dtype="int64", optimizer=ps.SGD(1.0))  # ordinal 0: PS 0
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        key = ("counter", 0)
        poll(lambda: (c := primary_of(coord, key)) is not None and c.in_sync and c.primary == 1,
             "the backup to hold the counter")
        coord.configure_sync("sync", replicas_to_aggregate=2, total_num_replicas=2)
        values = [coord.schedule(increment, args=(counter,)) for _ in range(100)]  # 50 steps of 2 replicas
        poll(lambda: int(counter.pull()) >= 10, "steps under way")
        cluster.kill(cluster.ps[1], signal.SIGKILL)
        coord.join(timeout=30)
        assert sum(v.fetch() for v in values) == 100
        # sync_stats asks every PS: wait until the killed one is back (as the counter's backup)
        poll(lambda: (c := primary_of(coord, key)).backup == 1 and c.in_sync, "ps 1 to rejoin as backup")
        steps = coord.sync_stats()["global_step"]
        assert int(counter.pull()) == steps == 50  # each step's averaged -1 applied exactly once
        assert coord.lost_updates == 0
    finally:
        coord.shutdown()


def test_a_dynamic_tables_rows_made_by_pulls_survive_a_primary_kill_and_are_counted_once(fresh_cluster, tmp_path):
    from pscluster.tables import TableConfig, shard_of

    cluster = fresh_cluster(2, 0, supervise=True, replicas=2)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        client = coord.client
        cfg = TableConfig(dim=2, capacity=40, initializer="uniform", init_value=0.5)  # admission "always"
        emb = client.create_variable("dyn", shape=(None, 2), sparse=True, optimizer=ps.Adagrad(0.1), table=cfg)
        keys = [("dyn", pl.shard_index) for pl in emb.shards]
        poll(lambda: all((c := primary_of(coord, k)) is not None and c.in_sync for k in keys), "backups in sync")
        ids = np.arange(-200, 200, dtype=np.int64)
        client.push_rows(emb, ids[:60], np.ones((60, 2), np.float32))
        client.pull_rows(emb, ids[60:110])  # creates rows, and evicts some at the 40-row capacity
        client.push_rows(emb, ids[:5], np.ones((5, 2), np.float32))  # acknowledged once the backups hold it
        (tmp_path / "before").mkdir()
        before = [np.load(p) for p in client.export_table(emb, tmp_path / "before")]
        stats = client.table_stats(emb)
        assert stats["live_keys"] == before[0].size == 80 and stats["evicted_keys"] >= 30  # each shard once
        victim = primary_of(coord, keys[0]).primary
        cluster.kill(cluster.ps[victim], signal.SIGKILL)
        poll(lambda: primary_of(coord, keys[0]).primary != victim, "the backup's promotion")
        (tmp_path / "after").mkdir()
        after = [np.load(p) for p in client.export_table(emb, tmp_path / "after")]
        assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])  # pulls' rows too
        assert shard_of(before[0], 2).min() == 0 and shard_of(before[0], 2).max() == 1
    finally:
        coord.shutdown()


def test_pushes_to_a_sigstopped_primary_go_to_the_new_one_long_before_the_socket_timeout(fresh_cluster):
    """A stopped primary answers nothing: a push waiting on it re-reads the replica table every 0.1 s and
    is retried on the promoted backup once the table moved (it waited socket_timeout_s, 30 s, before)."""
    cluster = fresh_cluster(2, 0, supervise=True, replicas=2)
    coord = ps.ClusterCoordinator(cluster.settings())
    pushes = None
    try:
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        key = ("counter", 0)
        poll(lambda: (c := primary_of(coord, key)) is not None and c.in_sync, "the backup to hold the counter")
        pushes = CallLoop(lambda: coord.client.push([(counter, np.array(-1, np.int64))]), "test-pusher").start()
        poll(lambda: len(pushes.acked) > 20, "pushes under way")
        before = primary_of(coord, key)
        with sigstopped(cluster.ps[before.primary].pid) as t0:
            # replies sent before the stop arrive within 20 ms; none come after it from the stopped PS
            poll(lambda: pushes.acked[-1] > t0 + 0.02 or pushes.errors, "a push acknowledged by the new primary")
            assert not pushes.errors, pushes.errors
            assert pushes.acked[-1] - t0 < 5.0 and primary_of(coord, key).primary != before.primary
        wait_rejoined_as_backup(coord, key, before.primary)
        pushes.stop()
        assert not pushes.errors, pushes.errors
        assert int(counter.pull()) == len(pushes.acked)
        assert coord.lost_updates == 0
    finally:
        if pushes is not None:
            pushes.stop()
        coord.shutdown()


def _kill_ps0_under(mode, fresh_cluster, **sync):
    """Train `mode` on 2 PS + 2 workers with the counter and the token queue on PS 0, SIGKILL PS 0 mid-run;
    returns (closures completed, counter, global step) once the restarted PS 0 is back as both backups."""
    cluster = fresh_cluster(2, 2, supervise=True, replicas=2)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(2)
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))  # on PS 0
        keys = [("counter", 0), SYNC_STATE_KEY]
        poll(lambda: all((c := primary_of(coord, k)) is not None and c.in_sync and c.primary == 0 for k in keys),
             "the backups of the counter and of the token queue")
        coord.configure_sync(mode, **sync)
        values = [coord.schedule(increment, args=(counter,)) for _ in range(100)]
        poll(lambda: int(counter.pull()) >= 10, "steps under way")
        cluster.kill(cluster.ps[0], signal.SIGKILL)  # mid-step: tokens out, reports and pushes in flight
        poll(lambda: primary_of(coord, SYNC_STATE_KEY).primary == 1, "the token queue's failover")
        coord.join(timeout=30)
        completed = sum(v.fetch() for v in values)
        poll(lambda: all((c := primary_of(coord, k)).backup == 0 and c.in_sync for k in keys),
             "the restarted PS 0 to rejoin as backup of both")
        steps = coord.sync_stats()["global_step"]  # from the token queue's primary, PS 1 now
        assert coord.lost_updates == 0
        return completed, int(counter.pull()), steps
    finally:
        coord.shutdown()


def test_sync_training_survives_a_kill_of_ps0_holding_the_token_queue(fresh_cluster):
    completed, counter, steps = _kill_ps0_under("sync", fresh_cluster, replicas_to_aggregate=2,
                                                total_num_replicas=2)
    assert completed == 100
    assert counter == steps == 50  # every step's averaged -1 applied once, G went on on PS 1 without a gap


def test_bounded_training_survives_a_kill_of_ps0_holding_the_clocks(fresh_cluster):
    completed, counter, steps = _kill_ps0_under("bounded", fresh_cluster, staleness=1)
    assert completed == 100
    assert counter == steps == 100  # each closure's increment once, each report counted once


def test_a_shard_whose_copies_both_die_counts_every_update_its_primaries_acknowledged_since_the_checkpoint(
        fresh_cluster, tmp_path):
    # PS P acknowledges 21..50 after the checkpoint (at 20), dies; its backup B, promoted, acknowledges 51..75 and
    # dies too; the shard comes back from the checkpoint on B. Every one of the 55 is lost, not only B's 25.
    cluster = fresh_cluster(2, 1, supervise=False, replicas=2, checkpoint_dir=tmp_path / "ckpt")
    coord = ps.ClusterCoordinator(cluster.settings(auto_checkpoint=False))
    try:
        coord.wait_for_workers(1)
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        key = ("counter", 0)
        poll(lambda: (c := primary_of(coord, key)) is not None and c.in_sync, "the backup to hold the counter")
        first = primary_of(coord, key)

        def run(n):
            values = [coord.schedule(increment, args=(counter,)) for _ in range(n)]
            coord.join(timeout=30)
            return sum(v.fetch() for v in values)

        completed = run(20)
        coord.checkpoint()
        completed += run(30)
        cluster.kill(cluster.ps[first.primary], signal.SIGKILL)
        poll(lambda: primary_of(coord, key).primary == first.backup, "the backup's promotion")
        completed += run(25)
        cluster.kill(cluster.ps[first.backup], signal.SIGKILL)
        poll(lambda: primary_of(coord, key).lost, "the table to say both copies are gone")
        cluster.restart(cluster.ps[first.primary])  # not a holder any more: the shard waits for its last primary
        cluster.restart(cluster.ps[first.backup])
        poll(lambda: coord.lost_updates_by_variable().get("counter"), "the restore to be accounted", timeout=30)
        assert completed == 75 and int(counter.pull()) == 20
        assert coord.lost_updates_by_variable() == {"counter": 55}
        assert coord.lost_updates == 55
    finally:
        coord.shutdown()


@pytest.mark.parametrize("stop", ["sigkill", "sigstop"])
def test_a_checkpoint_completes_from_the_live_copies_while_a_ps_is_down(fresh_cluster, stop):
    from pscluster.server import checkpoint
    from pscluster.server.store import VariableStore

    cluster = fresh_cluster(3, 0, supervise=False, replicas=2)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        w = coord.create_variable("w", shape=(6, 2), dtype="float32", optimizer=ps.SGD(1.0),
                                  partitioner=ps.FixedShardsPartitioner(3))
        w.push(-np.ones((6, 2), np.float32))
        keys = [("w", i) for i in range(3)]
        poll(lambda: all((c := primary_of(coord, k)) is not None and c.in_sync for k in keys), "backups in sync")
        with contextlib.ExitStack() as stack:  # the step is checked while ps 1 is still stopped or gone
            if stop == "sigkill":
                cluster.kill(cluster.ps[1], signal.SIGKILL)
            else:  # a frozen PS answers nothing: its save is given up once the table no longer lists it
                stack.enter_context(sigstopped(cluster.ps[1].pid))
            poll(lambda: all(primary_of(coord, k).primary != 1 for k in keys), "ps 1's shards failed over")
            started = time.monotonic()
            coord.checkpoint(7)  # failed on 'ps 1 ... Save' before: the step lacked ps 1's file
            # a stopped PS's save waited rpc_timeout_s (60 s) before
            assert time.monotonic() - started < 30
            assert [s for s, _ in checkpoint.complete_steps(cluster.checkpoint_dir)] == [7]
        stores = [VariableStore() for _ in range(3)]
        for task, store in enumerate(stores):  # the whole cluster restarting from that step gets every shard
            checkpoint.restore(store, cluster.checkpoint_dir, task, 3, held=True)
        got = {sh.spec.shard_index: sh.value for s in stores for sh in s.shards()}
        assert sorted(got) == [0, 1, 2] and all((v == 1).all() for v in got.values())
    finally:
        coord.shutdown()


def test_sync_reports_ride_the_closures_replies_and_are_forgotten_once_the_backup_holds_them(fresh_cluster):
    # A StepDone's reply does not wait for the token queue's backup; the closure's reply carries where it was
    # counted, and the coordinator keeps it until PS 0's Status says the backup confirmed it (then a failover
    # needs no resend). tests/unit/test_sync_state_replication.py covers the resend after a failover.
    cluster = fresh_cluster(2, 1, supervise=False, replicas=2)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(1)
        counter = coord.create_variable("counter", shape=(), dtype="int64", optimizer=ps.SGD(1.0))
        poll(lambda: (c := primary_of(coord, SYNC_STATE_KEY)) is not None and c.in_sync,
             "the token queue's backup")
        coord.configure_sync("sync", replicas_to_aggregate=1, total_num_replicas=1)
        assert sum(coord.schedule(increment, args=(counter,)).fetch() for _ in range(5)) == 5
        reports = coord._watch.reports
        assert reports is not None and reports.received == 5 and reports.resent == 0
        poll(lambda: reports.held == 0, "the keeper's rounds to see every report confirmed")
        assert coord.sync_stats()["global_step"] == 5 and int(counter.pull()) == 5
    finally:
        coord.shutdown()
