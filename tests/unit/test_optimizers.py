"""Each PS optimizer against an independent numpy reference, over several steps, dense and sparse."""

import math

import numpy as np
import pytest
from pscluster.server import optimizers as opt

from pscluster.optimizers import Adagrad, Adam

RNG = np.random.default_rng(7)
STEPS = 6


def reference(kind: str, w: np.ndarray, grads: list[np.ndarray], **hp: float) -> np.ndarray:
    """Textbook formulas in float64, written independently of the PS implementation."""
    w = w.astype(np.float64).copy()
    lr = hp["lr"]
    a = np.zeros_like(w)
    acc = np.full_like(w, hp.get("init_acc", 0.1))
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64)
        if kind == "sgd":
            w = w - lr * g
        elif kind == "momentum":
            a = hp["mu"] * a + g
            w = w - lr * (g + hp["mu"] * a if hp.get("nesterov") else a)
        elif kind == "adagrad":
            acc = acc + g ** 2
            w = w - lr * g / (np.sqrt(acc) + 1e-7)
        elif kind == "adam":
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g ** 2
            mhat = m / (1 - 0.9 ** t)
            vhat = v / (1 - 0.999 ** t)
            # Keras form: epsilon scaled by sqrt(1 - beta2^t) relative to the textbook epsilon.
            w = w - lr * mhat / (np.sqrt(vhat) + 1e-7 / math.sqrt(1 - 0.999 ** t))
    return w


CASES = [
    ("sgd", opt.OptimizerConfig("sgd", 0.1), {"lr": 0.1}),
    ("momentum", opt.OptimizerConfig("momentum", 0.1, momentum=0.9), {"lr": 0.1, "mu": 0.9}),
    ("momentum", opt.OptimizerConfig("momentum", 0.1, momentum=0.9, nesterov=True),
     {"lr": 0.1, "mu": 0.9, "nesterov": True}),
    ("adagrad", opt.OptimizerConfig("adagrad", 0.1, initial_accumulator_value=0.1), {"lr": 0.1}),
    ("adam", opt.OptimizerConfig("adam", 0.01, epsilon_hat=True), {"lr": 0.01}),
]


@pytest.mark.parametrize("kind,cfg,hp", CASES, ids=[f"{c[0]}{'-nesterov' if c[1].nesterov else ''}" for c in CASES])
def test_dense_update_matches_numpy_reference(kind, cfg, hp):
    w0 = RNG.normal(size=(5, 3))
    grads = [RNG.normal(size=(5, 3)) for _ in range(STEPS)]
    value = w0.copy()
    slots = opt.init_slots(cfg, value.shape, value.dtype)
    for t, g in enumerate(grads, start=1):
        opt.apply_dense(cfg, value, g, slots, t)
    np.testing.assert_allclose(value, reference(kind, w0, grads, **hp), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind,cfg,hp", CASES, ids=[f"{c[0]}{'-nesterov' if c[1].nesterov else ''}" for c in CASES])
def test_sparse_update_touches_only_given_rows_and_matches_reference(kind, cfg, hp):
    w0 = RNG.normal(size=(8, 2))
    value = w0.copy()
    slots = opt.init_slots(cfg, value.shape, value.dtype)
    rows = np.array([1, 5, 5])  # duplicate ids are summed, as TF does
    grads = [RNG.normal(size=(3, 2)) for _ in range(STEPS)]
    for t, g in enumerate(grads, start=1):
        opt.apply_sparse(cfg, value, rows, g, slots, t)
    touched = [1, 5]
    summed = [np.stack([g[0], g[1] + g[2]]) for g in grads]
    np.testing.assert_allclose(value[touched], reference(kind, w0[touched], summed, **hp), rtol=1e-10, atol=1e-12)
    untouched = [i for i in range(8) if i not in touched]
    np.testing.assert_array_equal(value[untouched], w0[untouched])


def test_float32_dense_update_stays_float32_and_in_place():
    cfg = opt.OptimizerConfig("adam", 0.01)
    value = np.ones((4, 4), np.float32)
    slots = opt.init_slots(cfg, value.shape, value.dtype)
    before = value.ctypes.data
    opt.apply_dense(cfg, value, np.ones((4, 4), np.float32), slots, 1)
    assert value.dtype == np.float32 and value.ctypes.data == before
    assert all(s.dtype == np.float32 for s in slots.values())


def test_blocked_update_of_a_large_shard_equals_unblocked(monkeypatch):
    monkeypatch.setattr(opt, "BLOCK_BYTES", 64)  # forces many row blocks
    cfg = opt.OptimizerConfig("momentum", 0.1, momentum=0.5)
    w0 = RNG.normal(size=(37, 3))
    value, ref = w0.copy(), w0.copy()
    s1, s2 = opt.init_slots(cfg, w0.shape, w0.dtype), opt.init_slots(cfg, w0.shape, w0.dtype)
    for t in range(1, 4):
        g = RNG.normal(size=w0.shape)
        opt.apply_dense(cfg, value, g, s1, t)
        opt._update(cfg, ref, g, s2, t, cfg.learning_rate)
    np.testing.assert_allclose(value, ref)


def test_integer_variable_takes_rounded_sgd_steps():
    cfg = opt.OptimizerConfig("sgd", 1.0)
    value = np.zeros((), np.int64)
    opt.apply_dense(cfg, value, np.array(-3, np.int64), {}, 1)
    assert int(value) == 3


@pytest.mark.parametrize("bad", [
    opt.OptimizerConfig("adadelta"), opt.OptimizerConfig("sgd", -1.0),
    opt.OptimizerConfig("sgd", float("nan")), opt.OptimizerConfig("adam", beta1=1.0),
])
def test_bad_hyperparameters_are_rejected(bad):
    from pscluster.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):
        bad.validate()


def test_small_sgd_shortcut_equals_the_blocked_path(monkeypatch):
    cfg = opt.OptimizerConfig("sgd", 0.1)
    w0 = RNG.normal(size=(37, 3)).astype(np.float32)
    grads = [RNG.normal(size=w0.shape).astype(np.float32) for _ in range(3)]
    small = w0.copy()
    for t, g in enumerate(grads, start=1):
        opt.apply_dense(cfg, small, g, {}, t)  # one ufunc call
    monkeypatch.setattr(opt, "BLOCK_BYTES", 64)
    blocked = w0.copy()
    for t, g in enumerate(grads, start=1):
        opt.apply_dense(cfg, blocked, g, {}, t)  # many row blocks
    np.testing.assert_array_equal(small, blocked)
    assert small.dtype == np.float32


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_sparse_tables_slots_are_resident_at_creation_so_the_first_push_does_not_fault_them_in() -> None:
    """Lazily mapped slots made Adam's first push on a 5 M x 64 shard take seconds (random rows fault
    in every page): resident slots are written at creation, with the same initial values."""
    cfg = Adam(0.01)
    before = _rss_bytes()
    slots = opt.init_slots(cfg, (65_536, 128), np.dtype(np.float32), resident=True)  # 2 x 32 MiB
    grown = _rss_bytes() - before
    assert grown >= 60 * 2**20 and all(not s.any() for s in slots.values())
    acc = opt.init_slots(Adagrad(0.1, initial_accumulator_value=0.25), (8, 4), np.dtype(np.float32), resident=True)
    assert (acc["accumulator"] == 0.25).all()
    before = _rss_bytes()
    lazy = opt.init_slots(cfg, (65_536, 128), np.dtype(np.float32))
    assert _rss_bytes() - before < 8 * 2**20 and all(not s.any() for s in lazy.values())
