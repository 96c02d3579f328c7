"""Pushes of several items that include dynamic tables: all or nothing on a PS, evicted keys reported."""

import threading

import numpy as np
import pytest
from pscluster.server import table_ops
from pscluster.server import table_state as ts
from pscluster.server.dynamic_table import DynamicTable, EvictionReport
from pscluster.server.store import PushItem, ShardSpec, VariableStore, ensure_created

from pscluster.client.plans import push_plan, room_checks
from pscluster.client.variables import ShardPlacement, Variable
from pscluster.errors import PsclusterError, ResourceExhaustedError
from pscluster.optimizers import SGD, Adagrad
from pscluster.tables import Eviction, TableConfig


def make_store(on_full: str = "refuse", capacity: int = 4) -> VariableStore:
    store = VariableStore()
    cfg = TableConfig(dim=2, capacity=capacity, on_full=on_full, initializer="uniform", init_value=0.1)
    for i, name in enumerate(("a", "b")):
        spec = ShardSpec(name, 0, 1, (0, 2), (0, 2), 0, "<f4", Adagrad(0.1), True, i, cfg.to_json())
        ensure_created(store, spec, None, "zeros", 0.0, 0)
    ensure_created(store, ShardSpec("w", 0, 1, (3,), (3,), 0, "<f4", SGD(0.5), False, 2), None, "ones", 0.0, 0)
    return store


def rows(keys: list[int]) -> tuple[np.ndarray, np.ndarray]:
    k = np.array(keys, np.int64)
    return k, np.ones((k.size, 2), np.float32)


def everything(store: VariableStore) -> dict[str, object]:
    out: dict[str, object] = {"w": store.get(("w", 0)).value.copy()}
    for name in ("a", "b"):
        shard = store.get((name, 0))
        assert shard.table is not None
        state = ts.snapshot(shard.table)
        state["meta"] = state["meta"][:5]  # [5] counts refused keys: the refusal is reported there, by design
        out[name] = (shard.version, shard.table.version, state)
    return out


def same(before: dict[str, object], after: dict[str, object]) -> bool:
    if not np.array_equal(before["w"], after["w"]):  # type: ignore[arg-type]
        return False
    for name in ("a", "b"):
        v0, t0, s0 = before[name]  # type: ignore[misc]
        v1, t1, s1 = after[name]  # type: ignore[misc]
        if (v0, t0) != (v1, t1) or set(s0) != set(s1) or not all(np.array_equal(s0[k], s1[k]) for k in s0):
            return False
    return True


def push(store: VariableStore, pid: str, a: list[int], b: list[int]) -> None:
    (ka, ga), (kb, gb) = rows(a), rows(b)
    store.push(pid, [PushItem(("w", 0), np.ones(3, np.float32)), PushItem(("a", 0), ga, ka),
                     PushItem(("b", 0), gb, kb)])


@pytest.mark.parametrize("on_full", ["refuse", "evict"])
def test_a_refused_table_item_leaves_the_requests_earlier_items_unapplied(on_full: str) -> None:
    store = make_store(on_full)
    push(store, "p1", [1, 2], [10, 11, 12])
    before = everything(store)
    # "a" fits its two new keys; "b" cannot take 5 new keys (refuse: over capacity; evict: the push's own
    # rows cannot be evicted): the dense item and "a", applied first in request order, must not change
    with pytest.raises(ResourceExhaustedError, match=r"b\[0\]: \d+ new keys do not fit"):
        push(store, "p2", [3, 4], [10, 13, 14, 15, 16, 17])
    assert same(before, everything(store))
    push(store, "p2", [3, 4], [10])  # the refused push id was not recorded: a smaller push under it applies
    assert store.get(("a", 0)).version == 2 and store.get(("w", 0)).version == 2


def test_a_push_id_held_already_is_not_prepared_again_and_cannot_be_refused() -> None:
    store = make_store("refuse", capacity=3)
    push(store, "p1", [1, 2, 3], [10, 11, 12])
    before = everything(store)
    push(store, "p1", [4, 5], [13])  # the same id resent with other keys: held, so neither refused nor applied
    assert same(before, everything(store))


def test_multi_item_pushes_and_consistent_snapshots_do_not_deadlock() -> None:
    store = make_store("evict", capacity=64)
    stop = threading.Event()
    errors: list[BaseException] = []

    def pusher(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for i in range(200):
                push(store, f"{seed}-{i}", rng.integers(0, 100, 3).tolist(), rng.integers(0, 100, 3).tolist())
        except PsclusterError as exc:  # reported below: a thread must not die unnoticed
            errors.append(exc)

    def freezer() -> None:
        while not stop.is_set():
            with store.frozen():
                pass

    threads = [threading.Thread(target=pusher, args=(s,)) for s in range(3)] + [threading.Thread(target=freezer)]
    for t in threads:
        t.start()
    for t in threads[:3]:
        t.join(timeout=30)
    stop.set()
    threads[3].join(timeout=30)
    assert not any(t.is_alive() for t in threads) and not errors
    assert store.get(("w", 0)).version == 600


def test_eviction_report_keeps_the_newest_keys_and_counts_the_rest() -> None:
    report = EvictionReport(4)
    report.add(np.array([1, 2, 3], np.int64))
    report.add(np.array([4, 5, 6], np.int64))
    keys, overflowed = report.drain()
    assert keys.tolist() == [3, 4, 5, 6] and overflowed == 2
    assert report.drain()[0].size == 0 and report.drain()[1] == 0


def test_every_eviction_path_reaches_the_report() -> None:
    table = DynamicTable(TableConfig(dim=2, capacity=3, eviction=Eviction("steps", max_idle=1)), SGD(1.0))
    table.push(*(rows([1, 2, 3])))
    table.push(*(rows([4])))  # a full shard: one row leaves for the new key
    table.pull(np.array([5], np.int64))  # a pull that creates a row at capacity evicts too
    table.push(*(rows([5])))
    table.sweep()  # idle rows leave
    keys, overflowed = table.report.drain()
    assert overflowed == 0 and keys.size == table.stats.evicted >= 3


def test_check_room_refuses_what_the_push_would_refuse_and_changes_nothing() -> None:
    store = make_store("refuse", capacity=3)
    push(store, "p1", [1, 2, 3], [10])
    before = everything(store)
    with pytest.raises(ResourceExhaustedError, match=r"a\[0\]: 1 new keys do not fit"):
        table_ops.check_room(store, "p2", [(("b", 0), np.array([11, 12], np.int64)), (("a", 0), np.array([4], np.int64))])
    assert same(before, everything(store))
    table_ops.check_room(store, "p2", [(("a", 0), np.array([1, 3, 3], np.int64))])  # known keys need no room
    table_ops.check_room(store, "p1", [(("a", 0), np.array([4], np.int64))])  # p1 is held: its repeat applies nothing


def test_room_is_checked_only_for_refusing_tables_spread_over_several_ps_tasks() -> None:
    refuse = Variable("r", (0, 2), np.dtype(np.float32), (ShardPlacement(0, 0, 0, 0, 0), ShardPlacement(1, 1, 0, 0, 1)),
                      True, TableConfig(dim=2, on_full="refuse").to_json())
    evict = Variable("e", refuse.shape, refuse.dtype, refuse.shards, True, TableConfig(dim=2).to_json())
    ids = np.arange(10, dtype=np.int64)
    g = np.ones((10, 2), np.float32)
    plan = push_plan([], [(refuse, ids, g), (evict, ids, g)])[0]
    calls = room_checks(plan, [(refuse, ids, g), (evict, ids, g)], "pid")
    assert sorted(ps for ps, _, _ in calls) == [0, 1] and all(m == "CheckRoom" for _, m, _ in calls)
    assert all([i.ref.variable for i in req.items] == ["r"] and req.push_id == "pid" for _, _, req in calls)
    assert room_checks(plan, [(evict, ids, g)], "pid") == []
    assert room_checks({0: plan[0]}, [(refuse, ids, g)], "pid") == []  # one PS task: all or nothing by itself


def test_read_table_pages_cover_every_live_row_once_with_holes_left_by_evictions() -> None:
    store = make_store("evict", capacity=50)
    push(store, "p1", list(range(40)), [1])
    push(store, "p2", list(range(40, 60)), [1])  # 10 rows evicted: their row ids are holes until reused
    shard = store.get(("a", 0))
    keys, values, start = [], [], 0
    while start >= 0:
        k, v, start, version = table_ops.read_page(shard, start, 7, float16=False)
        assert version == 2 and k.size <= 7
        keys.append(k)
        values.append(v)
    assert shard.table is not None
    full = ts.snapshot(shard.table)
    got = np.concatenate(keys)
    order = np.argsort(got)
    assert np.array_equal(got[order], full["keys"]) and np.array_equal(np.concatenate(values)[order], full["values"])
    assert table_ops.read_page(shard, 0, 100, float16=True)[1].dtype == np.float16


def test_a_refused_push_leaves_every_shards_push_record_as_it_was() -> None:
    """The refusal must not advance earlier shards' records to the push's final_below mark either."""
    store = make_store("refuse")
    first, late = (1 << 32) + 5, (1 << 32) + 9
    ka, ga = rows([1])
    store.push(f"c{first}.0", [PushItem(("a", 0), ga, ka), PushItem(("b", 0), ga, ka)])
    records = {name: store.get((name, 0)).record.state() for name in ("w", "a", "b")}
    (ka, ga), (kb, gb) = rows([2]), rows([10, 11, 12, 13, 14])
    with pytest.raises(ResourceExhaustedError, match=r"b\[0\]: 5 new keys do not fit"):
        store.push(f"c{late}.0", [PushItem(("w", 0), np.ones(3, np.float32)), PushItem(("a", 0), ga, ka),
                                  PushItem(("b", 0), gb, kb)], final_below=late)
    assert {name: store.get((name, 0)).record.state() for name in ("w", "a", "b")} == records
    assert store.get(("a", 0)).table.stats.refused == 0  # counted once, on the shard that refused
    assert store.get(("b", 0)).table.stats.refused == 5
    # a push from a closure below the mark the refused push carried is still refused as late everywhere
    store.push(f"c{first + 1}.0", [PushItem(("a", 0), ga, ka), PushItem(("b", 0), ga, ka)], final_below=late)
    assert store.get(("a", 0)).version == 1 and store.get(("b", 0)).version == 1
