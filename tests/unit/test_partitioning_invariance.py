"""A variable's values never depend on how it is partitioned: same pushes, 1 / 2 / 3 shards, same values.

The pushes are split exactly as the client splits them (`Variable.dense_parts` / `row_parts`) and
applied by real `VariableStore`s, one per PS task; no sockets.
"""

import numpy as np
import pytest
from pscluster.server import checkpoint
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.store import PushItem, ShardSpec, VariableStore

from pscluster.client.variables import ShardPlacement, Variable
from pscluster.placement import FixedShardsPartitioner, ps_for_ordinal, split_rows

OPTIMIZERS = {
    "sgd": OptimizerConfig("sgd", 0.1),
    "momentum": OptimizerConfig("momentum", 0.1, momentum=0.9),
    "nesterov": OptimizerConfig("momentum", 0.1, momentum=0.9, nesterov=True),
    "adagrad": OptimizerConfig("adagrad", 0.1),
    "adam": OptimizerConfig("adam", 0.1),
}
SHAPE = (7, 3)  # 7 rows: 3 shards of 3, 2, 2 rows


class Table:
    """A variable in `num_shards` shards over `num_ps` stores, pushed to as the client pushes."""

    def __init__(self, cfg: OptimizerConfig, sparse: bool, num_shards: int, num_ps: int,
                 shape: tuple[int, ...] = SHAPE, init: np.ndarray | None = None) -> None:
        init = np.linspace(-1, 1, int(np.prod(shape)), dtype=np.float32).reshape(shape) if init is None else init
        rows = split_rows(shape, np.float32, FixedShardsPartitioner(num_shards) if num_shards > 1 else None)
        offsets = np.concatenate([[0], np.cumsum(rows)[:-1]])
        self.var = Variable("t", shape, np.dtype(np.float32),
                            tuple(ShardPlacement(i, ps_for_ordinal(i, num_ps), int(o), n, i)
                                  for i, (o, n) in enumerate(zip(offsets, rows))), sparse)
        self.stores = [VariableStore() for _ in range(num_ps)]
        for pl in self.var.shards:
            spec = ShardSpec("t", pl.shard_index, num_shards, shape, self.var.shard_shape(pl), pl.row_offset,
                             "<f4", cfg, sparse, pl.ordinal)
            self.stores[pl.ps].create(spec, init[pl.row_offset:pl.row_offset + pl.rows].copy())
        self.pushes = 0

    def _send(self, parts: list[tuple[ShardPlacement, PushItem]]) -> None:
        self.pushes += 1
        for ps, store in enumerate(self.stores):
            items = [item for pl, item in parts if pl.ps == ps]
            if items:
                store.push(f"push-{self.pushes}", items)

    def push(self, grad: np.ndarray) -> None:
        self._send([(pl, PushItem(("t", pl.shard_index), part)) for pl, part in self.var.dense_parts(grad)])

    def push_rows(self, ids: list[int], grads: np.ndarray) -> None:
        ids_arr = np.asarray(ids, np.int64)
        self._send([(pl, PushItem(("t", pl.shard_index), part, part_ids))
                    for pl, part_ids, part in self.var.row_parts(ids_arr, grads)])

    def value(self) -> np.ndarray:
        out = np.empty(self.var.shape, np.float32)
        for pl in self.var.shards:
            out[pl.row_offset:pl.row_offset + pl.rows] = self.stores[pl.ps].get(("t", pl.shard_index)).value
        return out

    def versions(self) -> list[int]:
        return [self.stores[pl.ps].get(("t", pl.shard_index)).version for pl in self.var.shards]


def _sequence(table: Table, sparse: bool, seed: int = 3, steps: int = 8) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        if sparse:
            ids = rng.integers(0, SHAPE[0], size=int(rng.integers(1, 4))).tolist()  # duplicates happen
            table.push_rows(ids, rng.normal(size=(len(ids), SHAPE[1])).astype(np.float32))
        else:
            table.push(rng.normal(size=SHAPE).astype(np.float32))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_same_pushes_give_the_same_values_for_one_two_and_three_shards(name, sparse):
    runs = []
    for num_shards, num_ps in ((1, 1), (2, 2), (3, 2)):
        table = Table(OPTIMIZERS[name], sparse, num_shards, num_ps)
        _sequence(table, sparse)
        runs.append(table)
    for table in runs[1:]:
        np.testing.assert_allclose(table.value(), runs[0].value(), rtol=0, atol=1e-6)
        assert table.versions() == [runs[0].pushes] * table.var.num_shards  # every shard counts every push


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_sparse_adam_rows_0_0_3_from_the_issue_match_unsharded(num_shards):
    table = Table(OPTIMIZERS["adam"], True, num_shards, 2, shape=(4, 1), init=np.ones((4, 1), np.float32))
    for row in (0, 0, 3):
        table.push_rows([row], np.ones((1, 1), np.float32))
    # Row 3 is the variable's third update: t = 3 in the bias correction, whichever shard holds it.
    np.testing.assert_allclose(table.value()[:, 0], [0.8, 1.0, 1.0, 0.936], atol=5e-4)
    unsharded = Table(OPTIMIZERS["adam"], True, 1, 1, shape=(4, 1), init=np.ones((4, 1), np.float32))
    for row in (0, 0, 3):
        unsharded.push_rows([row], np.ones((1, 1), np.float32))
    np.testing.assert_allclose(table.value(), unsharded.value(), rtol=0, atol=1e-6)


def test_step_count_survives_checkpoint_restore_into_a_different_number_of_ps(tmp_path):
    sharded = Table(OPTIMIZERS["adam"], True, 3, 2)
    unsharded = Table(OPTIMIZERS["adam"], True, 1, 1)
    for table in (sharded, unsharded):
        _sequence(table, True, seed=5, steps=4)
    for ps, store in enumerate(sharded.stores):
        checkpoint.save(store, tmp_path, 4, ps, 2, keep=3)
    resumed = Table(OPTIMIZERS["adam"], True, 3, 3)  # same shards, now over 3 PS tasks
    resumed.stores = [VariableStore() for _ in range(3)]
    for ps, store in enumerate(resumed.stores):
        checkpoint.restore(store, tmp_path, ps, 3)
    resumed.pushes = sharded.pushes
    assert resumed.versions() == [4, 4, 4]
    for table in (resumed, unsharded):
        _sequence(table, True, seed=6, steps=4)
    np.testing.assert_allclose(resumed.value(), unsharded.value(), rtol=0, atol=1e-6)
