"""pscluster.torch.fit on real daemons: a bfloat16 module trains on float32 masters through the bulk path, with
callbacks on the driver and validation on the PS's values."""

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

import pscluster as ps
import pscluster.torch as ps_torch
from pscluster.training import CSVLogger, EarlyStopping

pytestmark = pytest.mark.cluster


def blobs(info=None, n=64, seed=0):
    """Endless minibatches of two separable Gaussian blobs in 8 dimensions."""
    rng = np.random.default_rng(seed + (info.worker_index if info is not None else 100))
    while True:
        y = rng.integers(0, 2, n)
        x = (rng.standard_normal((n, 8)) + 2.0 * (2 * y[:, None] - 1)).astype(np.float32)
        yield x.astype(np.float32), y.astype(np.int64)


def test_a_bfloat16_module_fits_on_float32_masters_with_callbacks(fresh_cluster, tmp_path):
    cluster = fresh_cluster(2, 2, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings())
    try:
        coord.wait_for_workers(2)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(torch.bfloat16)
        model = ps_torch.PSModule(coord, net, ps_torch.SGD(lr=0.1))
        assert {v.dtype for v in model.variables.values()} == {np.dtype(np.float32)}
        x_val, y_val = next(blobs(n=512, seed=7))

        def to_bf16(info):
            for x, y in blobs(info):
                yield torch.from_numpy(x).to(torch.bfloat16), torch.from_numpy(y)

        history = ps_torch.fit(coord, model, lambda out, y: F.cross_entropy(out.float(), y),
                               coord.create_per_worker_dataset(to_bf16), epochs=3, steps_per_epoch=10,
                               metrics=["accuracy"], callbacks=[CSVLogger(tmp_path / "log.csv"),
                                                                EarlyStopping(monitor="val_accuracy", patience=5)],
                               validation_data=(torch.from_numpy(x_val).to(torch.bfloat16), torch.from_numpy(y_val)),
                               verbose=0)
        assert history.epoch == [0, 1, 2] and coord.global_step == 30
        assert history.history["val_accuracy"][-1] >= 0.95, history.history
        assert history.history["loss"][-1] < history.history["loss"][0]
        state = model.state_dict()
        assert {t.dtype for t in state.values()} == {torch.float32}
        assert len((tmp_path / "log.csv").read_text().splitlines()) == 4
    finally:
        coord.shutdown()
