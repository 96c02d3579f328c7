"""Checkpoints of a replicas: 2 cluster after elastic moves: shard k's holders are no longer `k mod P`.

Each PS writes the shards it holds (primary or backup copies, each saved at its own instant); a restore
must put back every shard's newest saved copy (values, optimizer slots, version, push record), whether
one PS restarts in the running cluster (it may be named to bring back a shard whose two copies died) or
the whole cluster restarts with the cluster file's P. In-process: the restore logic is plain Python.
"""

import json

import numpy as np
import pytest
from pscluster.server import checkpoint
from pscluster.server import table_state as ts
from pscluster.server.ps import ParameterServerCore
from pscluster.server.replication import Replication, Role
from pscluster.server.store import PushItem, ShardSpec, VariableStore, ensure_created
from pscluster.server.tensor_files import TensorFile, write

from pscluster.optimizers import Adagrad, Adam
from pscluster.tables import TableConfig

P = 3
TABLE = TableConfig(dim=2, capacity=64, increments=2)
# ordinal -> (spec, primary, backup) after PS 2 was drained and added back: no shard sits on k mod 3 alone
SPECS = [ShardSpec("w", i, 3, (6, 2), (2, 2), 2 * i, "<f4", Adam(0.1), False, i) for i in range(3)] + \
    [ShardSpec("emb", i, 3, (12, 4), (4, 4), 4 * i, "<f4", Adagrad(0.5), True, 3 + i) for i in range(3)] + \
    [ShardSpec("tab", i, 2, (0, 2), (0, 2), 0, "<f4", Adam(0.05), True, 6 + i, TABLE.to_json()) for i in range(2)]
HOLDERS = {0: (1, 2), 1: (2, 0), 2: (0, 1), 3: (1, 2), 4: (2, 0), 5: (0, 1), 6: (2, 1), 7: (0, 2)}


def push(store: VariableStore, spec: ShardSpec, n: int) -> None:
    """The n-th acknowledged push of a shard: the same on every copy (a backup applies its primary's)."""
    rng = np.random.default_rng(100 * spec.ordinal + n)
    if spec.table:
        ids = rng.integers(-50, 50, 5).astype(np.int64)
        item = PushItem(spec.key, rng.standard_normal((5, 2)).astype(np.float32), ids)
    elif spec.sparse:
        ids = np.unique(rng.integers(spec.row_offset, spec.row_offset + 4, 3)).astype(np.int64)
        item = PushItem(spec.key, rng.standard_normal((ids.size, 4)).astype(np.float32), ids)
    else:
        item = PushItem(spec.key, rng.standard_normal(spec.shape).astype(np.float32))
    store.push(f"{spec.variable}-{spec.shard_index}-{n}", [item])


def copy_at(store: VariableStore, spec: ShardSpec, pushes: int) -> None:
    initial = None if spec.table else np.arange(np.prod(spec.shape), dtype=np.float32).reshape(spec.shape) / 10
    ensure_created(store, spec, initial, "zeros", 0.0, 0)
    for n in range(pushes):
        push(store, spec, n)


def moved_cluster() -> tuple[list[VariableStore], dict[int, int]]:
    """Three PS stores after elastic moves; every primary saved one push after its backup did, and PS k mod 3
    of shards 2 and 5 still holds an old copy it no longer serves. Returns the stores and each shard's
    newest version."""
    stores = [VariableStore() for _ in range(P)]
    newest = {}
    for spec in SPECS:
        primary, backup = HOLDERS[spec.ordinal]
        copy_at(stores[primary], spec, 6)
        copy_at(stores[backup], spec, 5)
        newest[spec.ordinal] = 6
    for ordinal in (2, 5):
        copy_at(stores[ordinal % P], SPECS[ordinal], 2)
    return stores, newest


def assert_same(a: VariableStore, b: VariableStore, key: tuple[str, int]) -> None:
    x, y = a.get(key), b.get(key)
    assert (x.spec, x.version) == (y.spec, y.version), key
    assert x.record.state() == y.record.state(), key
    if x.table is not None:
        assert y.table is not None
        sx, sy = ts.snapshot(x.table), ts.snapshot(y.table)
        assert sorted(sx) == sorted(sy) and sx["keys"].size > 0, key
        for name in sx:
            np.testing.assert_array_equal(sx[name], sy[name])
        return
    np.testing.assert_array_equal(x.value, y.value)
    assert sorted(x.slots) == sorted(y.slots) and x.slots, key
    for name in x.slots:
        np.testing.assert_array_equal(x.slots[name], y.slots[name])


def save_all(stores: list[VariableStore], root, step: int) -> None:
    for i, store in enumerate(stores):
        checkpoint.save(store, root, step, i, P, keep=5)


def test_a_whole_cluster_restart_puts_back_every_shards_newest_copy_wherever_moves_left_it(tmp_path):
    stores, _ = moved_cluster()
    save_all(stores, tmp_path, 10)
    want = stores  # a save changes no value (a table's epoch is its creation time: rebuilt copies differ)
    for held in (False, True):  # replicas: 1 places by k mod P; replicas: 2 also loads what each task held
        fresh = [VariableStore() for _ in range(P)]
        for i, store in enumerate(fresh):
            checkpoint.restore(store, tmp_path, i, P, held=held)
        for spec in SPECS:
            primary = HOLDERS[spec.ordinal][0]
            places = [i for i, s in enumerate(fresh) if s.find(spec.key) is not None]
            assert spec.ordinal % P in places, (spec.key, places)
            if not held:
                assert places == [spec.ordinal % P]
            for i in places:  # every restored copy is the primary's, not a backup's or a stale one
                assert_same(want[primary], fresh[i], spec.key)


def test_a_restarted_ps_brings_back_the_shards_it_held_when_both_copies_died(tmp_path):
    stores, _ = moved_cluster()
    save_all(stores, tmp_path, 10)
    want = stores  # a save changes no value (a table's epoch is its creation time: rebuilt copies differ)
    for ps in range(P):
        fresh = VariableStore()
        checkpoint.restore(fresh, tmp_path, ps, P, held=True)
        for spec in SPECS:
            primary, backup = HOLDERS[spec.ordinal]
            if ps in (primary, backup):  # the replica table may name it to bring the shard back
                assert_same(want[primary], fresh, spec.key)


def test_a_table_increment_builds_on_its_own_writers_saves_when_the_shard_moved_between_them(tmp_path):
    spec = SPECS[6]  # ps 0 held it, then it moved to ps 1 (primary) with ps 2 as backup
    stores = [VariableStore() for _ in range(P)]
    copy_at(stores[0], spec, 2)
    save_all(stores, tmp_path, 4)  # ps 0: full
    push(stores[0], spec, 2)
    copy_at(stores[1], spec, 3)  # ps 1 catches up
    save_all(stores, tmp_path, 8)  # ps 0: increment on step 4; ps 1: full
    stores[0].remove(spec.key)  # moved away
    copy_at(stores[2], spec, 4)
    push(stores[1], spec, 3)
    push(stores[1], spec, 4)  # the primary saves after one more push than its backup
    save_all(stores, tmp_path, 12)  # ps 1: increment on step 8 (its own full save); ps 2: full
    want = stores[1]  # the primary's copy, pushes 0..4
    for ps in range(P):
        fresh = VariableStore()
        checkpoint.restore(fresh, tmp_path, ps, P, held=True)
        if fresh.find(spec.key) is not None:
            assert_same(want, fresh, spec.key)


def _core(stores_root, ps: int) -> ParameterServerCore:
    core = ParameterServerCore(ps, P, checkpoint_dir=stores_root)
    core.replication = Replication(core.store, ps, connect=lambda _: pytest.fail("no link in this test"))
    return core


def test_a_restored_copy_the_table_places_elsewhere_is_dropped_and_a_stale_copy_is_not_saved(tmp_path):
    stores, _ = moved_cluster()
    save_all(stores, tmp_path, 10)
    core = _core(tmp_path, 2)
    assert core.restore() == 10
    held = {s.spec.key for s in core.store.shards()}
    assert SPECS[2].key in held and SPECS[0].key in held  # k mod P, and a backup copy it held
    # a table that names ps 2 for no shard (its PS list and roles): every restored copy goes
    roles = [Role(spec.key, 5, *((0, 1) if spec.ordinal != 6 else (1, 2))) for spec in SPECS]
    core.take_roles(7, roles, [], 0)
    assert [s.spec.key for s in core.store.shards()] == [SPECS[6].key]
    # a copy held but named for other PS tasks is not written into the next checkpoint
    copy_at(core.store, SPECS[0], 1)
    core.save(20)
    files = checkpoint.complete_steps(tmp_path)
    assert files[-1][0] == 10  # ps 2 alone saved step 20
    with TensorFile(tmp_path / "step-000000000020" / "ps-2-of-3.safetensors") as fh:
        saved = [(e["spec"]["variable"], e["spec"]["shard_index"]) for e in json.loads(fh.metadata()["shards"])]
    assert saved == [SPECS[6].key]


def _diverged(root, epochs: list[int]) -> tuple[list[VariableStore], ShardSpec]:
    """PS 0, a deposed primary that still believed it led, applied an unacknowledged push A; PS 1, its promoted
    backup, applied the acknowledged push B: both copies at version 3. Each saves with its epoch."""
    spec = SPECS[0]
    stores = [VariableStore() for _ in range(P)]
    for store, fill in ((stores[0], 100.0), (stores[1], -100.0)):
        copy_at(store, spec, 2)
        store.push("A" if fill > 0 else "B", [PushItem(spec.key, np.full(spec.shape, fill, np.float32))])
    assert stores[0].get(spec.key).version == stores[1].get(spec.key).version == 3
    for i, store in enumerate(stores):
        checkpoint.save(store, root, 10, i, P, keep=5, epochs=lambda _, e=epochs[i]: e)
    return stores, spec


def test_restore_takes_the_newest_epochs_copy_not_a_deposed_primarys_diverged_one_at_the_same_version(tmp_path):
    stores, spec = _diverged(tmp_path, [4, 5, 0])
    for ps in range(P):
        fresh = VariableStore()
        checkpoint.restore(fresh, tmp_path, ps, P, held=True)
        if fresh.find(spec.key) is not None:
            assert_same(stores[1], fresh, spec.key)  # the promoted backup's: the acknowledged push B
    # a newer epoch wins over a higher version too: the deposed primary's extra updates were never acknowledged
    stores[0].push("A2", [PushItem(spec.key, np.ones(spec.shape, np.float32))])
    checkpoint.save(stores[0], tmp_path, 10, 0, P, keep=5, epochs=lambda _: 4)
    fresh = VariableStore()
    checkpoint.restore(fresh, tmp_path, 0, P)
    assert_same(stores[1], fresh, spec.key)


def test_a_ps_saves_each_copys_replica_epoch_from_its_replication(tmp_path):
    cores = [_core(tmp_path, ps) for ps in range(P)]
    spec = SPECS[0]
    for core, fill in ((cores[0], 100.0), (cores[1], -100.0)):
        copy_at(core.store, spec, 2)
        core.store.push("A" if fill > 0 else "B", [PushItem(spec.key, np.full(spec.shape, fill, np.float32))])
    # ps 0 has not heard of the failover (the keeper's SetRoles comes after the save): it still leads epoch 4
    cores[0].replication.set_roles(1, [Role(spec.key, 4, 0, -1)])  # (its backup link is left out here)
    cores[1].replication.set_roles(2, [Role(spec.key, 5, 1, -1)])
    for core in cores:
        core.save(10)
    fresh = VariableStore()
    checkpoint.restore(fresh, tmp_path, 0, P)
    assert_same(cores[1].store, fresh, spec.key)


def test_a_checkpoint_written_before_entries_carried_an_epoch_still_loads_as_epoch_0(tmp_path):
    stores, spec = _diverged(tmp_path, [0, 7, 0])
    for i in range(P):  # strip the field, as an older pscluster wrote the files
        path = tmp_path / "step-000000000010" / f"ps-{i}-of-{P}.safetensors"
        with TensorFile(path) as fh:
            header, tensors = fh.metadata(), {k: fh.get(k) for k in fh.keys()}
        shards = json.loads(header["shards"])
        assert all("epoch" in e for e in shards)
        header["shards"] = json.dumps([{k: v for k, v in e.items() if k != "epoch"} for e in shards])
        path.unlink()
        write(path, tensors, header)
    fresh = VariableStore()
    assert checkpoint.restore(fresh, tmp_path, 0, P).shards == 1
    assert_same(stores[0], fresh, spec.key)  # every copy epoch 0: the version, then the lowest task index


def test_dropping_an_unclaimed_restored_copy_spares_a_copy_installed_since(tmp_path):
    stores, _ = moved_cluster()
    save_all(stores, tmp_path, 10)
    core = _core(tmp_path, 2)
    assert core.restore() == 10
    key = SPECS[2].key
    restored = core.store.get(key)
    live = VariableStore()
    copy_at(live, SPECS[2], 6)
    table_of = core.replication.roles

    def roles_after_an_install():  # a newer SetRoles' catch-up installs a live copy between the read and the drop
        core.store.install(live.get(key))
        return table_of()

    core.replication.roles = roles_after_an_install
    core.take_roles(7, [Role(key, 5, 0, 1)], [], 0)
    assert core.store.get(key) is live.get(key) is not restored  # the live copy stays
    core.replication.roles = table_of
    assert key not in core._unclaimed  # the restored copy was decided once
    core.take_roles(8, [Role(key, 6, 0, 2)], [], 0)  # the table that installed it names ps 2: kept
    assert core.store.find(key) is live.get(key)
    core.take_roles(9, [Role(key, 7, 0, 1)], [], 0)  # one that names others deposes it: dropped (memory)
    assert core.store.find(key) is None


def test_a_table_increment_builds_on_its_own_processs_file_not_an_earlier_clusters_of_the_same_task_index(tmp_path):
    spec = SPECS[6]
    # an earlier cluster of 2 PS tasks left step 10 incomplete: task 1's file of it holds another lineage
    earlier = VariableStore()
    copy_at(earlier, spec, 1)
    checkpoint.save(earlier, tmp_path, 10, 1, 2, keep=5, writer=1234)  # ps-1-of-2 sorts first
    # this cluster (3 tasks, restored from an older step) saves step 10 again, then an increment on it
    stores = [VariableStore() for _ in range(P)]
    copy_at(stores[1], spec, 3)
    save_all(stores, tmp_path, 10)  # task 1: full
    push(stores[1], spec, 3)
    save_all(stores, tmp_path, 14)  # task 1: an increment on its step 10
    with TensorFile(tmp_path / "step-000000000014" / "ps-1-of-3.safetensors") as fh:
        assert json.loads(fh.metadata()["shards"])[0]["table_chain"] == [10]
    fresh = VariableStore()
    checkpoint.restore(fresh, tmp_path, 1, P, held=True)
    assert_same(stores[1], fresh, spec.key)


def test_a_backup_named_at_a_newer_epoch_saves_its_not_yet_replaced_copy_as_epoch_0(tmp_path):
    cores = [_core(tmp_path, ps) for ps in range(P)]
    spec = SPECS[0]
    copy_at(cores[0].store, spec, 5)  # the primary's live copy
    copy_at(cores[1].store, spec, 2)  # a copy restored from an older checkpoint: the primary's install is due
    cores[0].replication.set_roles(1, [Role(spec.key, 5, 0, -1)])  # the new table has not reached it yet
    cores[1].replication.set_roles(2, [Role(spec.key, 6, 0, 1)])  # named backup at epoch 6
    assert (cores[0].replication.epoch_of(spec.key), cores[1].replication.epoch_of(spec.key)) == (5, 0)
    for core in cores:
        core.save(10)
    fresh = VariableStore()
    checkpoint.restore(fresh, tmp_path, 0, P)
    assert_same(cores[0].store, fresh, spec.key)
