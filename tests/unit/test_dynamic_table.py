"""One shard of a dynamic table: admission, eviction, capacity, slots, duplicates, initializers."""

import numpy as np
import pytest
from pscluster.server import optimizers as opt
from pscluster.server.dynamic_table import DynamicTable

from pscluster.errors import InvalidArgumentError, ResourceExhaustedError
from pscluster.optimizers import SGD, Adagrad, Adam, Momentum, OptimizerConfig
from pscluster.tables import Admission, Eviction, TableConfig

OPTIMIZERS = {"sgd": SGD(0.5), "momentum": Momentum(0.1, 0.9), "adagrad": Adagrad(0.1), "adam": Adam(0.01)}


def k(*keys: int) -> np.ndarray:
    return np.array(keys, np.int64)


def ones(n: int, dim: int = 2, scale: float = 1.0) -> np.ndarray:
    return np.full((n, dim), scale, np.float32)


def table(dim: int = 2, optimizer: OptimizerConfig = SGD(1.0), **cfg: object) -> DynamicTable:
    cfg.setdefault("capacity", 64)
    return DynamicTable(TableConfig(dim=dim, **cfg), optimizer)  # type: ignore[arg-type]


def test_admission_counter_is_exact_across_batch_boundaries_and_duplicates() -> None:
    t = table(admission=Admission("counter", min_count=3))
    assert t.push(k(5, 5), ones(2)).dropped == 2  # 2 occurrences in one batch: not yet
    assert t.lookup(k(5)).tolist() == [-1]
    r = t.push(k(5, 6), ones(2))  # the third occurrence admits 5 and applies this push's gradient
    assert (r.inserted, r.applied, r.dropped) == (1, 1, 1)
    assert t.pull(k(5))[0].tolist() == [[-1.0, -1.0]]
    assert t.push(k(6, 6, 6), ones(3)).inserted == 1  # 1 + 3 >= 3
    assert t.pull(k(6))[0].tolist() == [[-3.0, -3.0]]
    assert t.stats.dropped == 3


def test_unadmitted_key_reads_its_initial_row_and_pull_does_not_count() -> None:
    t = table(admission=Admission("counter", min_count=2), initializer="uniform", init_value=0.5)
    first, _ = t.pull(k(9, 9, 9))
    assert t.live == 0 and np.array_equal(first[0], first[2])
    assert t.push(k(9), ones(1)).inserted == 0
    assert t.push(k(9), ones(1)).inserted == 1
    assert np.allclose(t.pull(k(9))[0], first[0] - 1.0)


def test_count_min_sketch_never_admits_before_min_count() -> None:
    t = table(capacity=2_000, admission=Admission("cms", min_count=4, cms_width=64, cms_depth=2))
    keys = np.arange(1_000, dtype=np.int64)
    for _ in range(3):
        t.push(keys[:10], ones(10))
    assert t.live == 0 or t.filter.state()["sketch"].sum() == 30  # collisions may admit early, never late
    t.push(keys[:10], ones(10))
    assert set(range(10)) <= set(t.index.row_keys[t.index.live_rows()].tolist())
    assert t.filter.state()["sketch"].nbytes == 2 * 64 * 4  # bounded, whatever the number of keys


def test_probability_admission_is_deterministic_and_near_p() -> None:
    a, b = (table(capacity=20_000, admission=Admission("probability", probability=0.25)) for _ in range(2))
    keys = np.arange(10_000, dtype=np.int64)
    ra, rb = a.push(keys, ones(10_000)), b.push(keys[::-1].copy(), ones(10_000))
    assert ra.inserted == rb.inserted and 2_200 < ra.inserted < 2_800
    live_a, live_b = a.index.row_keys[a.index.live_rows()], b.index.row_keys[b.index.live_rows()]
    assert np.array_equal(np.sort(live_a), np.sort(live_b))


def test_eviction_boundary_has_no_off_by_one() -> None:
    t = table(eviction=Eviction("steps", max_idle=3))
    t.push(k(1), ones(1))  # step 1
    for _ in range(3):
        t.push(k(2), ones(1))  # steps 2..4: key 1 idle for 3 pushes
    assert t.sweep().evicted.tolist() == []
    t.push(k(2), ones(1))  # step 5: idle 4 > 3
    assert t.sweep().evicted.tolist() == [1]


def test_periodic_sweep_reports_evicted_keys_from_the_push() -> None:
    t = table(eviction=Eviction("steps", max_idle=1, every_steps=3))
    t.push(k(1, 2), ones(2))
    t.push(k(2), ones(1))
    r = t.push(k(3), ones(1))  # step 3 sweeps: key 1 idle 2 > 1, key 2 idle 1
    assert r.evicted.tolist() == [1] and t.stats.evicted == 1


def test_readmitted_key_starts_fresh() -> None:
    t = table(optimizer=Adagrad(0.1), admission=Admission("counter", min_count=2),
              eviction=Eviction("steps", max_idle=0), initializer="normal", init_value=0.1)
    t.push(k(7, 7), ones(2))
    t.push(k(8), ones(1))
    assert t.sweep().evicted.tolist() == [7]
    assert t.push(k(7), ones(1)).inserted == 0  # its admission count left with it
    t.push(k(7), ones(1))  # admitted again: initial row, fresh slots, this push's gradient alone
    fresh = DynamicTable(t.cfg, t.optimizer)
    fresh.push(k(7), ones(1))
    fresh.push(k(7), ones(1))
    assert np.array_equal(t.pull(k(7))[0], fresh.pull(k(7))[0])
    row_t, row_f = t.lookup(k(7))[0], fresh.lookup(k(7))[0]
    assert np.array_equal(t.slots["accumulator"][row_t], fresh.slots["accumulator"][row_f])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_slots_leave_with_their_rows_for_every_optimizer(name: str) -> None:
    optimizer = OPTIMIZERS[name]
    t = table(dim=3, optimizer=optimizer, capacity=2, on_full="evict")
    t.push(k(1, 2), ones(2, 3, 2.0))
    t.push(k(1), ones(1, 3))  # key 2 is now least recently touched
    r = t.push(k(3), ones(1, 3, 3.0))  # full: 2 leaves, 3 takes its row id
    assert r.evicted.tolist() == [2]
    ref = DynamicTable(t.cfg, optimizer)
    ref.version = 2
    ref.push(k(3), ones(1, 3, 3.0))
    row, ref_row = t.lookup(k(3))[0], ref.lookup(k(3))[0]
    assert np.array_equal(t.values[row], ref.values[ref_row])
    for slot in optimizer.slot_names():
        assert np.array_equal(t.slots[slot][row], ref.slots[slot][ref_row]), slot


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_dynamic_rows_update_exactly_as_the_fixed_tables_sparse_kernel(name: str) -> None:
    optimizer = OPTIMIZERS[name]
    rng = np.random.default_rng(1)
    t = table(dim=4, optimizer=optimizer)
    dense = np.zeros((8, 4), np.float32)
    slots = opt.init_slots(optimizer, dense.shape, dense.dtype)
    for step in range(1, 6):
        ids = rng.integers(0, 8, 5)
        g = rng.standard_normal((5, 4)).astype(np.float32)
        t.push((ids * 1_000_003 - 17).astype(np.int64), g)
        u, inv = np.unique(ids, return_inverse=True)
        summed = np.zeros((u.size, 4), np.float64)
        np.add.at(summed, inv, g)
        opt.apply_sparse(optimizer, dense, u, summed.astype(np.float32), slots, step)
    got = t.pull((np.arange(8) * 1_000_003 - 17).astype(np.int64))[0]
    assert np.array_equal(got, dense)


def test_duplicate_keys_are_order_independent() -> None:
    rng = np.random.default_rng(5)
    keys = rng.integers(-5, 5, 500).astype(np.int64)
    grads = (rng.standard_normal((500, 8)) * 10.0 ** rng.integers(-6, 6, (500, 1))).astype(np.float32)
    a, b = table(dim=8), table(dim=8)
    a.push(keys, grads)
    perm = rng.permutation(500)
    b.push(keys[perm], grads[perm])
    assert np.array_equal(a.pull(np.arange(-5, 5, dtype=np.int64))[0], b.pull(np.arange(-5, 5, dtype=np.int64))[0])


def test_keys_pushed_sorted_and_unique_update_exactly_as_the_same_keys_in_any_order() -> None:
    """The sorted-unique fast path (no sort, no copy) must give what the general path gives, and must not
    write into the caller's gradients."""
    rng = np.random.default_rng(6)
    keys = np.unique(rng.integers(-2**63, 2**63 - 1, 300, dtype=np.int64, endpoint=True))
    grads = rng.standard_normal((keys.size, 4)).astype(np.float32)
    kept = grads.copy()
    a, b = table(dim=4, optimizer=Adam(0.01), capacity=400), table(dim=4, optimizer=Adam(0.01), capacity=400)
    perm = rng.permutation(keys.size)
    for _ in range(3):
        a.push(keys, grads)
        b.push(keys[perm], grads[perm])
    assert np.array_equal(grads, kept)
    assert np.array_equal(a.pull(keys)[0], b.pull(keys)[0])


def test_initial_rows_do_not_depend_on_shard_or_arrival_order() -> None:
    cfg = {"initializer": "normal", "init_value": 1.0, "dim": 16, "seed": 3}
    a, b = table(**cfg), table(capacity=1_000, **cfg)  # type: ignore[arg-type]
    keys = k(0, -1, 2**63 - 1, -(2**63), 42)
    b.pull(np.arange(500, dtype=np.int64))
    va, vb = a.pull(keys)[0], b.pull(keys[::-1].copy())[0][::-1]
    assert np.array_equal(va, vb)
    assert 0.5 < va.std() < 1.5 and len({tuple(r) for r in va.tolist()}) == 5
    assert not np.array_equal(va, table(**{**cfg, "seed": 4}).pull(keys)[0])  # type: ignore[arg-type]


def test_full_shard_refuses_with_a_clear_error_and_changes_nothing() -> None:
    t = table(capacity=3, on_full="refuse", admission=Admission("counter", min_count=1))
    t.push(k(1, 2), ones(2))
    before = t.pull(k(1, 2))[0].copy()
    with pytest.raises(ResourceExhaustedError, match="2 new keys do not fit: 2 of 3 rows live"):
        t.push(k(1, 3, 4), ones(3))
    assert t.live == 2 and t.version == 1 and np.array_equal(t.pull(k(1, 2))[0], before)


def test_full_shard_cannot_evict_the_rows_of_the_push_itself() -> None:
    t = table(capacity=2)
    t.push(k(1, 2), ones(2))
    with pytest.raises(ResourceExhaustedError, match="only 0 rows may be evicted"):
        t.push(k(1, 2, 3), ones(3))


def test_bad_push_changes_nothing() -> None:
    t = table(admission=Admission("counter", min_count=2))
    with pytest.raises(InvalidArgumentError, match="NaN"):
        t.push(k(1, 1), np.array([[1, np.nan], [1, 1]], np.float32))
    with pytest.raises(InvalidArgumentError, match="1-D int64"):
        t.push(np.array([1, 2], np.int32), ones(2))
    with pytest.raises(InvalidArgumentError, match="expected float32"):
        t.push(k(1), ones(1, 3))
    assert t.version == 0 and t.filter.state()["pending_keys"].size == 0


def test_lfu_evicts_the_least_frequent_after_decay() -> None:
    t = table(capacity=3, eviction=Eviction("lfu", decay=0.5, min_frequency=0.3))
    t.push(k(1, 1, 1, 1, 2), ones(5))  # step 1: freq 1 -> 4, 2 -> 1
    t.push(k(3), ones(1))  # step 2: 1 -> 2, 2 -> 0.5
    t.push(k(3), ones(1))  # step 3: 1 -> 1, 2 -> 0.25
    assert t.sweep().evicted.tolist() == [2]
    assert t.push(k(4, 5), ones(2)).evicted.tolist() == [1]  # full: the lowest of {1: 0.5, 3: 1.25} leaves


def test_l2_and_seconds_policies() -> None:
    t = table(eviction=Eviction("l2", min_norm=1.0))
    t.push(k(1, 2), np.array([[0.1, 0.1], [3, 4]], np.float32))
    assert t.sweep().evicted.tolist() == [1]
    now = [1000.0]
    s = DynamicTable(TableConfig(dim=2, capacity=8, eviction=Eviction("seconds", max_idle=10)), SGD(1.0),
                     clock=lambda: now[0])
    s.push(k(1), ones(1))
    now[0] += 10
    s.push(k(2), ones(1))
    assert s.sweep().evicted.tolist() == []
    now[0] += 1
    assert s.sweep().evicted.tolist() == [1]


def test_memory_bound_evicts_down_to_low_water_and_reports() -> None:
    t = table(capacity=100, eviction=Eviction("steps", max_rows=10, low_water=0.5))
    for i in range(10):
        t.push(k(i), ones(1))
    r = t.push(k(10), ones(1))
    assert r.evicted.tolist() == [0, 1, 2, 3, 4, 5] and t.live == 5


def test_no_silent_loss_at_capacity_against_a_dict_reference() -> None:
    """Mixed pushes, pulls and sweeps at a full shard: every key is live with the reference's value,
    or was reported evicted; nothing else. (bench/dyntables.py --ops 1000000 runs the million.)"""
    run_against_dict(60_000, seed=11)


def run_against_dict(total_ops: int, seed: int) -> None:
    """`total_ops` key operations in random pushes, pulls and sweeps, checked against a dict."""
    rng = np.random.default_rng(seed)
    t = table(dim=2, capacity=300, eviction=Eviction("steps", max_idle=40, every_steps=7))
    ref: dict[int, float] = {}
    ops = 0
    while ops < total_ops:
        keys = rng.integers(-1_000, 1_000, int(rng.integers(1, 64))).astype(np.int64)
        kind = rng.integers(0, 10)
        if kind < 6:
            g = rng.integers(-3, 4, (keys.size, 1)).astype(np.float32).repeat(2, axis=1)
            r = t.push(keys, g)
            for key in r.evicted.tolist():
                del ref[key]
            for key, gi in zip(keys.tolist(), g[:, 0].tolist()):
                ref[key] = ref.get(key, 0.0) - gi
        elif kind < 9:
            vals, r = t.pull(keys)
            for key in r.evicted.tolist():
                del ref[key]
            for key in keys.tolist():
                ref.setdefault(key, 0.0)
            assert vals[:, 0].tolist() == [ref[key] for key in keys.tolist()]
        else:
            for key in t.sweep().evicted.tolist():
                del ref[key]
        ops += keys.size
        assert t.live == len(ref) <= 300
    live = t.index.live_rows()
    assert dict(zip(t.index.row_keys[live].tolist(), t.values[live, 0].tolist())) == ref


@pytest.mark.parametrize("draw", ["unique_sorted", "unique_shuffled", "few_repeats", "all_repeats", "one"])
def test_sum_duplicates_matches_a_float64_dict_sum_and_never_writes_the_gradients(draw: str) -> None:
    from pscluster.server.dynamic_table import sum_duplicates

    rng = np.random.default_rng(9)
    keys = {"unique_sorted": np.arange(-20, 20), "unique_shuffled": rng.permutation(40) - 20,
            "few_repeats": rng.integers(-1000, 1000, 300), "all_repeats": np.repeat([3, -3, 0], 7),
            "one": np.array([5])}[draw].astype(np.int64)
    grads = rng.standard_normal((keys.size, 3)).astype(np.float32)
    kept = grads.copy()
    uniq, counts, summed = sum_duplicates(keys, grads)
    ref: dict[int, np.ndarray] = {}
    seen: dict[int, int] = {}
    for key, g in zip(keys.tolist(), grads.astype(np.float64)):
        ref[key] = ref.get(key, 0.0) + g
        seen[key] = seen.get(key, 0) + 1
    assert np.array_equal(grads, kept) and uniq.size == len(ref) == np.unique(uniq).size
    for key, n, row in zip(uniq.tolist(), counts.tolist(), summed):
        assert n == seen[key] and np.array_equal(row, ref[key].astype(np.float32))
