"""Dynamic-table checkpoints: full, incremental, re-sharded into other shard counts, exported."""

import pathlib

import numpy as np
import pytest
from pscluster.server import table_state as ts
from pscluster.server.dynamic_table import DynamicTable
from pscluster.server.hash_index import shard_of

from pscluster.errors import FailedPreconditionError, InvalidArgumentError
from pscluster.optimizers import Adagrad, Adam
from pscluster.tables import Admission, Eviction, TableConfig

CFG = TableConfig(dim=4, capacity=4_000, initializer="uniform", init_value=0.1,
                  admission=Admission("counter", min_count=2), eviction=Eviction("steps", max_idle=6, every_steps=4))


class Sharded:
    """A table split over n shards by key hash; every push reaches every shard (as the client does)."""

    def __init__(self, n: int, cfg: TableConfig = CFG) -> None:
        self.tables = [DynamicTable(cfg, Adam(0.01), name=f"t[{i}]") for i in range(n)]

    def push(self, keys: np.ndarray, grads: np.ndarray) -> list[int]:
        where = shard_of(keys, len(self.tables))
        evicted: list[int] = []
        for i, t in enumerate(self.tables):
            evicted += t.push(keys[where == i], grads[where == i]).evicted.tolist()
        return sorted(evicted)

    def pull(self, keys: np.ndarray) -> np.ndarray:
        where = shard_of(keys, len(self.tables))
        out = np.empty((keys.size, CFG.dim), np.float32)
        for i, t in enumerate(self.tables):
            out[where == i] = t.pull(keys[where == i])[0]
        return out

    def states(self) -> list[ts.State]:
        return [ts.snapshot(t) for t in self.tables]

    @classmethod
    def restored(cls, states: list[ts.State], n: int) -> "Sharded":
        new = cls(n)
        for t, s in zip(new.tables, ts.reshard(states, n)):
            ts.load(t, s)
        return new


def batches(seed: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        keys = (rng.integers(0, 300, 64) * 7_919 - 2**40).astype(np.int64)
        out.append((keys, rng.standard_normal((64, CFG.dim)).astype(np.float32)))
    return out


def merged(states: list[ts.State]) -> ts.State:
    return ts.reshard(states, 1)[0]


def assert_same(a: ts.State, b: ts.State) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


@pytest.mark.parametrize("m", [1, 2, 4, 6])
def test_save_with_n_shards_restores_bit_identical_into_other_shard_counts(m: int) -> None:
    n = 3
    before = Sharded(n)
    for keys, grads in batches(1, 30):
        before.push(keys, grads)
    after = Sharded.restored(before.states(), m)
    assert_same(merged(after.states()), merged(before.states()))
    for keys, grads in batches(2, 20):  # training goes on identically: values, slots, admission, eviction
        assert before.push(keys, grads) == after.push(keys, grads)
    probe = batches(3, 1)[0][0]
    assert np.array_equal(before.pull(probe), after.pull(probe))
    assert_same(merged(after.states()), merged(before.states()))


def test_filter_state_survives_save_restore_on_every_shard() -> None:
    before = Sharded(3)
    for keys, grads in batches(4, 5):
        before.push(keys, grads)
    states = before.states()
    assert all(s["filter.pending_keys"].size for s in states)
    for old, new in zip(states, ts.reshard(states, 3)):
        for name in ("filter.pending_keys", "filter.pending_count", "filter.pending_seen", "keys", "values"):
            assert np.array_equal(old[name], new[name]), name


def test_sketch_admission_state_is_summed_when_the_shard_count_changes() -> None:
    cfg = TableConfig(dim=4, capacity=100, admission=Admission("cms", min_count=3, cms_width=256, cms_depth=2))
    before = Sharded(2, cfg)
    keys = np.arange(40, dtype=np.int64)
    before.push(keys, np.ones((40, 4), np.float32))
    states = before.states()
    one = ts.reshard(states, 1)[0]
    assert one["filter.sketch"].sum() == 2 * 40
    after = DynamicTable(cfg, Adam(0.01))
    ts.load(after, one)
    assert after.push(keys, np.ones((40, 4), np.float32)).inserted == 0  # 2 of 3 occurrences, not forgotten
    assert after.push(keys, np.ones((40, 4), np.float32)).inserted == 40


@pytest.mark.parametrize("piece_bytes", [5, 64, 1000, 1 << 20])
def test_a_filter_cut_into_pieces_of_any_size_joins_into_the_same_filter(piece_bytes: int) -> None:
    """A catch-up sends a filter larger than a chunk in pieces (server/catch_up.py): none over the size (one
    element at least), and the joined pieces load the filter exactly, for the sketch and the counter."""
    sketch_cfg = TableConfig(dim=4, capacity=100, admission=Admission("cms", min_count=3, cms_width=96, cms_depth=3))
    for cfg in (sketch_cfg, CFG):
        before = Sharded(1, cfg)
        for keys, grads in batches(3, 5):
            before.push(keys, grads)
        state = before.states()[0]
        rest = {name: arr for name, arr in state.items() if not ts.per_key(name)}
        pieces = ts.filter_pieces(rest, piece_bytes)
        assert "meta" in pieces[0] and all("meta" not in p for p in pieces[1:])
        assert all(sum(a.nbytes for a in p.values()) <= max(piece_bytes, 8 + 48) for p in pieces)
        assert len(pieces) == 1 or piece_bytes < sum(a.nbytes for a in rest.values())
        joined = {name: np.array(arr, copy=True) for name, arr in pieces[0].items()}
        for piece in pieces[1:]:
            ts.add_piece(joined, piece)
        after = DynamicTable(cfg, Adam(0.01))
        ts.load_rest(after, joined)
        got = after.filter.state()
        for name, arr in before.tables[0].filter.state().items():
            assert np.array_equal(got[name], arr) and got[name].shape == arr.shape, name
    with pytest.raises(InvalidArgumentError, match="carries 'meta'"):
        ts.add_piece(joined, {"meta": state["meta"]})
    with pytest.raises(InvalidArgumentError, match="carries nothing"):
        ts.add_piece(joined, {})
    with pytest.raises(InvalidArgumentError, match="does not continue"):
        ts.add_piece(joined, {"filter.pending_keys": np.zeros(2, np.float32)})


def test_full_checkpoint_plus_increments_restores_exactly() -> None:
    live = Sharded(2)
    for keys, grads in batches(5, 10):
        live.push(keys, grads)
    bases = live.states()
    for t in live.tables:
        ts.mark(t)
    chains = [[], []]  # type: list[list[ts.State]]
    evicted = 0
    for round_ in range(3):
        for keys, grads in batches(10 + round_, 8):
            evicted += len(live.push(keys, grads))
        for t, chain in zip(live.tables, chains):
            chain.append(ts.delta(t))
    assert evicted > 0 and any(d["removed"].size for chain in chains for d in chain)
    rebuilt = []
    for base, chain in zip(bases, chains):
        for d in chain:
            base = ts.apply_delta(base, d)
        rebuilt.append(base)
    for got, want in zip(rebuilt, live.states()):
        assert_same(got, want)
    small = sum(d["keys"].size for d in chains[0])
    assert small < 3 * bases[0]["keys"].size + 8 * 64  # a delta holds changed rows, not the table


def test_delta_without_a_base_is_refused() -> None:
    with pytest.raises(FailedPreconditionError, match="full snapshot"):
        ts.delta(DynamicTable(CFG, Adam(0.01)))


def test_restore_refuses_a_state_of_another_optimizer_or_width() -> None:
    src = Sharded(1)
    src.push(*batches(6, 1)[0])
    state = ts.snapshot(src.tables[0])
    with pytest.raises(InvalidArgumentError, match="lacks 'slot.accumulator'"):
        ts.load(DynamicTable(CFG, Adagrad(0.1)), state)
    with pytest.raises(InvalidArgumentError, match="dim 8"):
        ts.load(DynamicTable(TableConfig(dim=8, capacity=100), Adam(0.01)), state)


def test_export_writes_sorted_keys_and_their_rows(tmp_path: pathlib.Path) -> None:
    src = Sharded(2)
    src.push(*batches(7, 1)[0])
    src.push(*batches(7, 1)[0])
    state = merged(src.states())
    keys_path, values_path = ts.export(state, tmp_path, "emb", float16=True)
    keys, values = np.load(keys_path), np.load(values_path)
    assert keys.dtype == np.int64 and np.all(np.diff(keys) > 0) and keys.size == state["keys"].size
    assert values.dtype == np.float16 and np.allclose(values, src.pull(keys), atol=1e-3)


def test_only_lfu_keeps_a_frequency_per_key_and_older_states_that_carry_one_still_load() -> None:
    src = Sharded(1)
    src.push(*batches(6, 1)[0])
    state = ts.snapshot(src.tables[0])
    assert "freq" not in state and src.tables[0].freq.nbytes == 0  # 4 B per key saved beyond LFU
    older = {**state, "freq": np.zeros(state["keys"].size, np.float32)}  # what the previous format saved
    again = ts.load(DynamicTable(CFG, Adam(0.01)), older)
    assert np.array_equal(ts.snapshot(again)["values"], state["values"])
    lfu = TableConfig(dim=4, capacity=100, eviction=Eviction("lfu", decay=0.5, min_frequency=0.1))
    t = DynamicTable(lfu, Adam(0.01))
    t.push(np.array([3, 3, 4], np.int64), np.ones((3, 4), np.float32))
    saved = ts.snapshot(t)
    assert saved["freq"].tolist() == [2.0, 1.0]
    with pytest.raises(InvalidArgumentError, match="lacks 'freq'"):
        ts.load(DynamicTable(lfu, Adam(0.01)), {k: v for k, v in saved.items() if k != "freq"})


def test_removed_log_stays_bounded_between_saves_and_the_next_save_is_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that evicts for a long time without a checkpoint must not grow the removal log without bound."""
    from pscluster.server import dynamic_table

    monkeypatch.setattr(dynamic_table, "REMOVED_LOG_LIMIT", 10)
    cfg = TableConfig(dim=4, capacity=100, increments=3, eviction=Eviction("steps", max_idle=0))
    table = DynamicTable(cfg, Adagrad(0.1))
    table.push(np.arange(5, dtype=np.int64), np.ones((5, 4), np.float32))
    _, chain = ts.for_checkpoint(table, 1)
    assert chain == [] and table.removed_log == []
    for i in range(1, 8):  # each sweep evicts the 5 keys of the push before
        table.push(np.arange(5, dtype=np.int64) + 5 * i, np.ones((5, 4), np.float32))
        assert table.sweep().evicted.size == 5
        held = table.removed_log
        assert (held is None) == (5 * i > 10) and (held is None or sum(p.size for p in held) == 5 * i)
    state, chain = ts.for_checkpoint(table, 2)
    assert chain == [] and "removed" not in state and sorted(state["keys"].tolist()) == list(range(35, 40))
    assert table.removed_log == [] and table.chain == [2]  # increments build on this full save again
    table.push(np.array([99], np.int64), np.ones((1, 4), np.float32))
    assert ts.for_checkpoint(table, 3)[1] == [2]


@pytest.mark.parametrize("holes", [False, True])
def test_checkpoint_states_in_row_order_and_older_sorted_files_restore_alike(holes: bool,
                                                                             tmp_path: pathlib.Path) -> None:
    """Checkpoints save keys in row order (views of a table without holes); files written before held
    sorted keys. Both load, re-shard and export to the same tables and files."""
    src = Sharded(1)
    for keys, grads in batches(3, 12 if holes else 2):
        src.push(keys, grads)
    table = src.tables[0]
    has_holes = table.live < table.index.high_water
    assert has_holes == holes  # every_steps=4, max_idle=6: twelve pushes evict, two do not
    new, _ = ts.for_checkpoint(table, 1)
    old = ts.snapshot(table)  # what files held before: sorted copies
    assert not np.array_equal(new["keys"], old["keys"]) and sorted(new["keys"]) == old["keys"].tolist()
    assert np.shares_memory(new["values"], table.values) != holes
    for m in (1, 2, 3):
        want = [ts.snapshot(t) for t in Sharded.restored([old], m).tables]
        for ordered in (True, False):
            parts = ts.reshard([new], m, ordered=ordered)
            got = [ts.snapshot(ts.load(DynamicTable(CFG, Adam(0.01)), part)) for part in parts]
            for g, w in zip(got, want):
                assert_same(g, w)
        # split + load(where): the rows go straight from the file's arrays into each table
        gathered = [ts.snapshot(ts.load(DynamicTable(CFG, Adam(0.01)), part, where))
                    for part, where in ts.split([new], m)]
        for g, w in zip(gathered, want):
            assert_same(g, w)
    for name, state in (("new", new), ("old", old)):
        keys_path, values_path = ts.export(state, tmp_path, name)
        np.testing.assert_array_equal(np.load(keys_path), old["keys"])
        np.testing.assert_array_equal(np.load(values_path), old["values"])
