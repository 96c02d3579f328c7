"""A checkpoint taken while a PS task is down (replicas: 2): the live copies complete the step, restore finds
every shard wherever it was saved, and incomplete steps never pile up."""

import numpy as np
import pytest
from pscluster.server import checkpoint
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.ps import ParameterServerCore
from pscluster.server.store import PushItem, ShardSpec, VariableStore

from pscluster.client.cluster_ops import uncovered_shards
from pscluster.errors import InvalidArgumentError
from pscluster.placement import SYNC_STATE_KEY, ps_for_ordinal

SHARDS = 6


def replicated_stores(num_ps: int = 3) -> list[VariableStore]:
    """Shard i (value i + 1 after one push) on its primary ordinal mod P and its backup, the next task."""
    stores = [VariableStore() for _ in range(num_ps)]
    for i in range(SHARDS):
        spec = ShardSpec("w", i, SHARDS, (SHARDS * 2, 2), (2, 2), i * 2, "<f4", OptimizerConfig("sgd", 1.0), False, i)
        primary = ps_for_ordinal(i, num_ps)
        for task in (primary, (primary + 1) % num_ps):
            stores[task].create(spec, np.full((2, 2), float(i), np.float32))
            stores[task].push(f"p{i}", [PushItem(("w", i), -np.ones((2, 2), np.float32))])
    return stores


def _values(stores: list[VariableStore]) -> dict[int, float]:
    return {sh.spec.shard_index: float(sh.value[0, 0]) for s in stores for sh in s.shards()}


def test_a_step_saved_by_the_live_tasks_plus_an_empty_file_for_the_down_one_is_complete_and_restores(tmp_path):
    stores = replicated_stores()
    for task in (0, 2):  # ps 1 is down: its shards' other copies are on ps 2 (its backups) and ps 0 (its primaries)
        checkpoint.save(stores[task], tmp_path, 5, task, 3, keep=3)
    assert checkpoint.complete_steps(tmp_path) == []
    checkpoint.save_absent(tmp_path, 5, [1], 3, keep=3, ps_index=0, extra={"sync": None})
    assert [s for s, _ in checkpoint.complete_steps(tmp_path)] == [5]
    want = {i: i + 1.0 for i in range(SHARDS)}
    # ps 1 restarts alone: it finds the shards placed on it in the other tasks' files
    one = VariableStore()
    found = checkpoint.restore(one, tmp_path, 1, 3, held=True)
    assert found is not None and found.step == 5 and found.shards == 2
    assert _values([one]) == {i: want[i] for i in range(SHARDS) if ps_for_ordinal(i, 3) == 1}
    # the whole cluster restarts, onto 3, 2 or 4 tasks: every shard comes back, with its value
    for num_ps in (3, 2, 4):
        restarted = [VariableStore() for _ in range(num_ps)]
        for task, store in enumerate(restarted):
            checkpoint.restore(store, tmp_path, task, num_ps, held=num_ps == 3)
        assert _values(restarted) == want


def test_an_empty_file_never_replaces_a_saved_one(tmp_path):
    stores = replicated_stores()
    for task in range(3):
        checkpoint.save(stores[task], tmp_path, 5, task, 3, keep=3)
    assert checkpoint.save_absent(tmp_path, 5, [1], 3, keep=3, ps_index=0) == []
    restored = VariableStore()
    assert checkpoint.restore(restored, tmp_path, 1, 3, held=True).shards == 4  # its primaries and backups


def test_incomplete_step_directories_do_not_pile_up(tmp_path):
    # with ps 1 down and no empty file, every save leaves an incomplete step: all but the newest go
    stores = replicated_stores()
    for step in range(1, 4):
        for task in range(3):
            checkpoint.save(stores[task], tmp_path, step, task, 3, keep=2)
    for step in range(4, 10):
        for task in (0, 2):
            checkpoint.save(stores[task], tmp_path, step, task, 3, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{s:012d}" for s in (2, 3, 9)]
    for task in range(3):  # the step in progress completes: the directory holds keep complete steps
        checkpoint.save(stores[task], tmp_path, 10, task, 3, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{s:012d}" for s in (3, 10)]


def test_uncovered_shards_are_those_no_live_task_saved():
    table = {("w", 0), ("w", 1), ("w", 2), SYNC_STATE_KEY}
    assert uncovered_shards(table, {0: {("w", 0)}, 2: {("w", 1), ("w", 2)}}) == []
    assert uncovered_shards(table, {0: {("w", 0)}}) == [("w", 1), ("w", 2)]
    assert uncovered_shards(table, {}) == [("w", 0), ("w", 1), ("w", 2)]


def test_a_save_for_absent_tasks_refuses_itself_and_unknown_tasks(tmp_path):
    core = ParameterServerCore(0, 3, checkpoint_dir=tmp_path)
    for bad in ([0], [3], [-1]):
        with pytest.raises(InvalidArgumentError, match="absent tasks"):
            core.save(4, absent=bad)
    assert not list(tmp_path.iterdir())
    path, saved = core.save(4, absent=[1, 2])
    assert saved == [] and path.name == "ps-1-of-3.safetensors"
    assert [s for s, _ in checkpoint.complete_steps(tmp_path)] == []  # ps 0's own file is not there
