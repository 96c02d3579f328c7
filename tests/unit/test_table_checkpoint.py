"""Dynamic tables in the PS store and its checkpoint files: routing, refusals, atomic saves, restore."""

import os

import numpy as np
import pytest
from pscluster.server import checkpoint
from pscluster.server import table_state as ts
from pscluster.server.store import PushItem, ShardSpec, VariableStore, ensure_created
from safetensors import SafetensorError

from pscluster.errors import InvalidArgumentError
from pscluster.optimizers import Adam
from pscluster.tables import Admission, Eviction, TableConfig

CFG = TableConfig(dim=3, capacity=500, initializer="uniform", init_value=0.2,
                  admission=Admission("counter", min_count=2), eviction=Eviction("steps", max_idle=3, every_steps=2))


def table_store() -> VariableStore:
    store = VariableStore()
    spec = ShardSpec("emb", 0, 1, (0, 3), (0, 3), 0, "<f4", Adam(0.05), True, 0, CFG.to_json())
    ensure_created(store, spec, None, "zeros", 0.0, 0)
    return store


def push(store: VariableStore, pid: str, keys: list[int]) -> None:
    k = np.array(keys, np.int64)
    store.push(pid, [PushItem(("emb", 0), np.ones((k.size, 3), np.float32), k)])


def state(store: VariableStore) -> ts.State:
    table = store.get(("emb", 0)).table
    assert table is not None
    return ts.snapshot(table)


def test_store_routes_keys_to_the_table_and_applies_each_push_id_once() -> None:
    store = table_store()
    push(store, "a", [2**63 - 1, 2**63 - 1, -1])
    push(store, "a", [2**63 - 1, -1])  # the same push id again: not applied twice
    push(store, "b", [-1])
    rows, version = store.pull(("emb", 0), np.array([2**63 - 1, -1], np.int64))
    assert version == 2 and rows.shape == (2, 3)
    assert state(store)["keys"].tolist() == [-1, 2**63 - 1]


def test_store_refuses_dense_and_badly_keyed_table_requests_without_change() -> None:
    store = table_store()
    push(store, "a", [5, 5])
    before = state(store)
    with pytest.raises(InvalidArgumentError, match="takes row gradients by key"):
        store.push("x", [PushItem(("emb", 0), np.ones((0, 3), np.float32))])
    with pytest.raises(InvalidArgumentError, match="1-D int64"):
        store.push("y", [PushItem(("emb", 0), np.ones((1, 3), np.float32), np.array([[5]], np.int64))])
    with pytest.raises(InvalidArgumentError, match="no whole value"):
        store.pull(("emb", 0))
    after = state(store)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint_loadable(tmp_path) -> None:
    store = table_store()
    for i, keys in enumerate([[1, 1, 2], [2, 3, 3], [4, 4, 1], [2, 9]]):
        push(store, f"p{i}", keys)
    saved = state(store)
    final = checkpoint.save(store, tmp_path, 5, 0, 1, keep=3)
    push(store, "later", [1, 2, 3])
    # what a SIGKILL during the next save leaves: a truncated temporary, never a final file
    step_dir = tmp_path / "step-000000000006"
    step_dir.mkdir()
    (step_dir / f".{final.name}.tmp-999999999").write_bytes(final.read_bytes()[:1000])
    fresh = VariableStore()
    restored = checkpoint.restore(fresh, tmp_path, 0, 1)
    assert restored is not None and restored.step == 5
    got = state(fresh)
    assert sorted(got) == sorted(saved) and all(np.array_equal(got[k], saved[k]) for k in saved)
    assert got["filter.pending_keys"].size > 0  # admission candidates came back too
    assert fresh.get(("emb", 0)).version == 4
    push(fresh, "later", [1, 2, 3])  # training goes on from the checkpoint exactly as it did
    again = state(fresh)
    now = state(store)
    assert sorted(again) == sorted(now) and all(np.array_equal(again[k], now[k]) for k in now)


INC = TableConfig(dim=3, capacity=64, initializer="uniform", init_value=0.2, increments=2,
                  admission=Admission("counter", min_count=2), eviction=Eviction("steps", max_idle=3, every_steps=2))


def inc_store() -> VariableStore:
    store = VariableStore()
    spec = ShardSpec("emb", 0, 1, (0, 3), (0, 3), 0, "<f4", Adam(0.05), True, 0, INC.to_json())
    ensure_created(store, spec, None, "zeros", 0.0, 0)
    return store


def restored_state(root) -> tuple[int, ts.State]:
    fresh = VariableStore()
    found = checkpoint.restore(fresh, root, 0, 1)
    assert found is not None
    return found.step, state(fresh)


def equal(a: ts.State, b: ts.State) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_full_checkpoint_plus_increments_on_disk_restore_bit_exact_and_keep_spares_their_base(tmp_path) -> None:
    store = inc_store()
    rng = np.random.default_rng(5)
    for i in range(20):
        push(store, f"a{i}", rng.integers(0, 40, 6).tolist())
    for step in range(1, 6):  # full at 1, increments at 2 and 3, full at 4, increment at 5
        push(store, f"s{step}", rng.integers(0, 40, 3).tolist())  # a few rows change (and some are evicted)
        checkpoint.save(store, tmp_path, step, 0, 1, keep=1)
        got_step, got = restored_state(tmp_path)
        assert got_step == step and equal(got, state(store))
        on_disk = sorted(int(p.name[5:]) for p in tmp_path.iterdir())
        assert on_disk == {1: [1], 2: [1, 2], 3: [1, 2, 3], 4: [4], 5: [4, 5]}[step]  # keep=1 plus its base
    fresh = VariableStore()
    checkpoint.restore(fresh, tmp_path, 0, 1)
    push(fresh, "after", [1, 2, 3])  # training goes on from the restored increment exactly as it did
    push(store, "after", [1, 2, 3])
    assert equal(state(fresh), state(store))


def test_a_save_killed_or_failed_mid_increment_leaves_the_previous_one_loadable_and_the_next_full(tmp_path) -> None:
    store = inc_store()
    for i, keys in enumerate([[1, 1, 2], [2, 3, 3], [4, 4, 1]]):
        push(store, f"p{i}", keys)
    checkpoint.save(store, tmp_path, 1, 0, 1, keep=2)
    push(store, "q", [1, 2, 9, 9])
    final = checkpoint.save(store, tmp_path, 2, 0, 1, keep=2)  # an increment
    saved = state(store)
    push(store, "r", [5, 5, 6])
    # what a SIGKILL during the next save leaves: a truncated temporary, never a final file
    (tmp_path / "step-000000000003").mkdir()
    (tmp_path / "step-000000000003" / f".{final.name}.tmp-999999999").write_bytes(final.read_bytes()[:500])
    step, got = restored_state(tmp_path)
    assert step == 2 and equal(got, saved)
    # a save that fails after its increment was taken (here: a directory where its temporary goes)
    blocker = tmp_path / "step-000000000004" / f".{final.name}.tmp-{os.getpid()}"
    blocker.mkdir(parents=True)
    with pytest.raises((OSError, SafetensorError)):
        checkpoint.save(store, tmp_path, 4, 0, 1, keep=2)
    blocker.rmdir()
    push(store, "s", [7, 7])
    checkpoint.save(store, tmp_path, 5, 0, 1, keep=2)  # full: the failed increment's changes are in it
    step, got = restored_state(tmp_path)
    assert step == 5 and equal(got, state(store))


def test_an_increment_on_disk_costs_the_rows_it_changed(tmp_path) -> None:
    store = VariableStore()
    cfg = TableConfig(dim=16, capacity=10_000, increments=3)
    ensure_created(store, ShardSpec("big", 0, 1, (0, 16), (0, 16), 0, "<f4", Adam(0.05), True, 0, cfg.to_json()),
                   None, "zeros", 0.0, 0)
    keys = np.arange(5_000, dtype=np.int64)
    store.push("a", [PushItem(("big", 0), np.ones((keys.size, 16), np.float32), keys)])
    full = checkpoint.save(store, tmp_path, 1, 0, 1, keep=2).stat().st_size
    store.push("b", [PushItem(("big", 0), np.ones((50, 16), np.float32), keys[:50])])
    increment = checkpoint.save(store, tmp_path, 2, 0, 1, keep=2).stat().st_size
    assert increment < full / 50  # 1 % of the rows changed


def test_an_increment_whose_base_step_never_completed_still_restores(tmp_path) -> None:
    """This task's full save at step 1 landed but another task's did not (step 1 is incomplete); the
    increment at the complete step 2 builds on this task's own step-1 file (found by review: the restore
    demanded a complete step 1 and failed on every later step until the next full save)."""
    store = inc_store()
    push(store, "p0", [1, 1, 2, 3, 3])
    checkpoint.save(store, tmp_path, 1, 0, 2, keep=3)  # ps 1 of 2 died before writing step 1
    push(store, "p1", [2, 4, 4])
    checkpoint.save(store, tmp_path, 2, 0, 2, keep=3)  # an increment on step 1
    checkpoint.save(VariableStore(), tmp_path, 2, 1, 2, keep=3)  # ps 1 writes step 2: it is complete
    fresh = VariableStore()
    found = checkpoint.restore(fresh, tmp_path, 0, 2)
    assert found is not None and found.step == 2 and equal(state(fresh), state(store))


def test_a_second_save_at_the_same_step_writes_a_full_state_not_an_increment_on_itself(tmp_path) -> None:
    store = inc_store()
    push(store, "p0", [1, 1, 2])
    checkpoint.save(store, tmp_path, 1, 0, 1, keep=2)
    push(store, "p1", [2, 3, 3])
    checkpoint.save(store, tmp_path, 1, 0, 1, keep=2)  # a retried Save at the same step overwrites step 1
    step, got = restored_state(tmp_path)
    assert step == 1 and equal(got, state(store))
