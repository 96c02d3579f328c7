"""Checkpoint write/read, atomicity, keep-K, and re-sharding into a different number of PS tasks."""

import shutil
import subprocess
import sys

import numpy as np
import pytest
from pscluster.server import checkpoint
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.ps import ParameterServerCore
from pscluster.server.store import PushItem, ShardSpec, VariableStore
from safetensors.numpy import load_file

from pscluster.placement import ps_for_ordinal

ADAM = OptimizerConfig("adam", 0.1)


def make_stores(num_ps: int, num_shards: int = 5) -> list[VariableStore]:
    """A 10x2 variable in num_shards shards, placed round-robin over num_ps stores, with one update."""
    stores = [VariableStore() for _ in range(num_ps)]
    rows = 10 // num_shards
    for i in range(num_shards):
        spec = ShardSpec("w", i, num_shards, (10, 2), (rows, 2), i * rows, "<f4", ADAM, False, i)
        store = stores[ps_for_ordinal(i, num_ps)]
        store.create(spec, np.full((rows, 2), float(i), np.float32))
        store.push(f"p{i}", [PushItem(("w", i), np.ones((rows, 2), np.float32))])
    return stores


def test_save_then_restore_gives_same_values_slots_versions_and_push_ids(tmp_path):
    stores = make_stores(2)
    for i, s in enumerate(stores):
        checkpoint.save(s, tmp_path, 7, i, 2, keep=3)
    for i, original in enumerate(stores):
        fresh = VariableStore()
        restored = checkpoint.restore(fresh, tmp_path, i, 2)
        assert restored is not None and restored.step == 7
        for a, b in zip(original.shards(), fresh.shards()):
            assert a.spec == b.spec and a.version == b.version == 1
            np.testing.assert_array_equal(a.value, b.value)
            for name in ("m", "v"):
                np.testing.assert_array_equal(a.slots[name], b.slots[name])
            assert a.record.state() == b.record.state() and len(b.record) > 0


def test_restore_into_a_different_number_of_ps_tasks(tmp_path):
    stores = make_stores(2)
    for i, s in enumerate(stores):
        checkpoint.save(s, tmp_path, 3, i, 2, keep=3)
    resharded = [VariableStore() for _ in range(3)]
    for i, s in enumerate(resharded):
        checkpoint.restore(s, tmp_path, i, 3)
    for i, s in enumerate(resharded):
        assert all(ps_for_ordinal(sh.spec.ordinal, 3) == i for sh in s.shards())
    got = {sh.spec.shard_index: sh.value for s in resharded for sh in s.shards()}
    want = {sh.spec.shard_index: sh.value for s in stores for sh in s.shards()}
    assert sorted(got) == list(range(5))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_incomplete_step_is_not_restored_and_no_temp_files_remain(tmp_path):
    stores = make_stores(2)
    for i, s in enumerate(stores):
        checkpoint.save(s, tmp_path, 1, i, 2, keep=3)
    checkpoint.save(stores[0], tmp_path, 2, 0, 2, keep=3)  # PS 1 never wrote step 2
    assert [step for step, _ in checkpoint.complete_steps(tmp_path)] == [1]
    assert checkpoint.restore(VariableStore(), tmp_path, 0, 2).step == 1
    assert not list(tmp_path.rglob("*.tmp-*"))


def test_only_the_newest_k_steps_are_kept(tmp_path):
    store = make_stores(1)[0]
    for step in range(1, 6):
        checkpoint.save(store, tmp_path, step, 0, 1, keep=2)
    assert [s for s, _ in checkpoint.complete_steps(tmp_path)] == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000000004", "step-000000000005"]


def test_checkpoint_file_is_plain_safetensors(tmp_path):
    store = make_stores(1)[0]
    path = checkpoint.save(store, tmp_path, 1, 0, 1, keep=1)
    tensors = load_file(str(path))
    assert tensors["w/0/value"].shape == (2, 2) and "w/0/slot/m" in tensors


def test_restore_without_checkpoint_returns_none(tmp_path):
    assert checkpoint.restore(VariableStore(), tmp_path / "missing", 0, 1) is None


@pytest.mark.parametrize("num_ps", [1, 4])
def test_every_shard_lands_on_exactly_one_task(tmp_path, num_ps):
    stores = make_stores(2)
    for i, s in enumerate(stores):
        checkpoint.save(s, tmp_path, 1, i, 2, keep=1)
    counts = [checkpoint.restore(VariableStore(), tmp_path, i, num_ps).shards for i in range(num_ps)]
    assert sum(counts) == 5


def _dir_bytes(root):
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _dead_pid():
    """The PID of a process that has already exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def test_two_ps_tasks_prune_whole_steps_down_to_keep(tmp_path):
    stores = make_stores(2)
    for step in range(1, 13):
        for i, s in enumerate(stores):
            checkpoint.save(s, tmp_path, step, i, 2, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{s:012d}" for s in (10, 11, 12)]
    assert [s for s, _ in checkpoint.complete_steps(tmp_path)] == [10, 11, 12]
    assert all(len(list(d.iterdir())) == 2 for d in tmp_path.iterdir())


def test_stale_temporaries_are_removed_on_prune_and_size_stays_bounded(tmp_path):
    stores = make_stores(2)
    for i, s in enumerate(stores):
        checkpoint.save(s, tmp_path, 1, i, 2, keep=2)
    model_bytes = _dir_bytes(tmp_path)
    dead = _dead_pid()
    for step in range(2, 22):  # every step: a save killed mid-write left a full-size temporary
        for i, s in enumerate(stores):
            final = checkpoint.save(s, tmp_path, step, i, 2, keep=2)
            shutil.copy(final, final.parent / f".{final.name}.tmp-{dead}")
        # keep=2 complete steps, one step being written; each of those 6 files' header may be one 8-byte pad
        # longer than step 1's (a two-digit step number): the bound held with no byte to spare before
        assert _dir_bytes(tmp_path) <= 3 * model_bytes + 6 * 8
    for i, s in enumerate(stores):  # each task removes its own
        checkpoint.save(s, tmp_path, 22, i, 2, keep=2)
    assert not list(tmp_path.rglob("*.tmp-*"))


def test_a_task_removes_its_own_temporaries_whatever_their_pid_and_leaves_other_tasks_in_flight_ones(tmp_path):
    stores = make_stores(2)
    finals = [checkpoint.save(s, tmp_path, 1, i, 2, keep=3) for i, s in enumerate(stores)]
    # a live process whose command line names pscluster: what PID reuse, or the PID namespace of another
    # container sharing the checkpoint volume, makes of a dead writer's PID
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "pscluster"])
    try:
        ours = finals[0].parent / f".{finals[0].name}.tmp-{alive.pid}"
        orphan_dir = tmp_path / "step-000000000002"
        orphan_dir.mkdir()
        orphan = orphan_dir / f".{finals[0].name}.tmp-{alive.pid}"
        theirs = finals[1].parent / f".{finals[1].name}.tmp-{alive.pid}"  # task 1's: maybe being written
        other_shape = finals[0].parent / f".ps-2-of-3.safetensors.tmp-{alive.pid}"  # a cluster of 3 PS, gone
        for p in (ours, orphan, theirs, other_shape):
            shutil.copy(finals[0], p)
        ParameterServerCore(0, 2, checkpoint_dir=tmp_path)  # task 0 starts: none of its saves is in flight
        assert not ours.exists() and not orphan_dir.exists() and not other_shape.exists()
        assert theirs.exists() and all(f.exists() for f in finals)
        checkpoint.save(stores[1], tmp_path, 3, 1, 2, keep=3)  # task 1's next save removes its own
        assert not theirs.exists()
    finally:
        alive.kill()
        alive.wait(timeout=10)
    assert checkpoint.restore(VariableStore(), tmp_path, 0, 2).step == 1


def test_a_step_saved_while_the_ps_list_grew_is_not_complete_and_says_which_files_it_lacks(tmp_path, caplog):
    # step 1 by three PS tasks (one joined); step 2 while the list changed: PS 0 saved with P = 2, PS 1 and 2
    # with P = 3 (whatever order the directory lists them in)
    from pscluster.checkpoint_files import missing, newer_incomplete, task_files

    stores = make_stores(3, num_shards=6)
    for i, s in enumerate(stores):
        checkpoint.save(s, tmp_path, 1, i, 3, keep=5)
    checkpoint.save(stores[0], tmp_path, 2, 0, 2, keep=5)
    for i in (1, 2):
        checkpoint.save(stores[i], tmp_path, 2, i, 3, keep=5)
    step2 = tmp_path / f"step-{2:012d}"
    assert task_files(step2)[1] == 3 and sorted(task_files(step2)[0]) == [1, 2]
    assert [step for step, _ in checkpoint.complete_steps(tmp_path)] == [1]
    assert missing(step2) == ("ps-0-of-3 missing; it holds files of P = 2 and 3: the PS list changed while it was "
                              "saved (a PS joined or left), so it is not restored")
    assert missing(tmp_path / f"step-{1:012d}") == ""
    assert newer_incomplete(tmp_path, 1) == [(2, missing(step2))]
    # a whole-cluster restart: the two listed PS tasks (P = 2) take every shard of step 1, the joined one's too
    cores = [ParameterServerCore(i, 2, checkpoint_dir=tmp_path) for i in range(2)]
    with caplog.at_level("WARNING"):
        assert [core.restore() for core in cores] == [1, 1]
    assert "ps 0: checkpoint step 2 is not complete: ps-0-of-3 missing" in caplog.text
    got = {sh.spec.shard_index: sh.value for core in cores for sh in core.store.shards()}
    want = {sh.spec.shard_index: sh.value for s in stores for sh in s.shards()}
    assert sorted(got) == list(range(6))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    one = tmp_path / "one"
    checkpoint.save(stores[0], one, 4, 0, 3, keep=5)
    assert missing(one / f"step-{4:012d}") == "ps-1-of-3, ps-2-of-3 missing (a save that did not finish)"
