"""Dynamic tables in the PS store and its checkpoint files: routing, refusals, atomic saves, restore."""

import numpy as np
import pytest
from pscluster.server import checkpoint
from pscluster.server import table_state as ts
from pscluster.server.store import PushItem, ShardSpec, VariableStore, ensure_created

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
