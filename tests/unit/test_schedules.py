"""Keras-named schedules against Keras's formulas written out here in float64, their wire and checkpoint
forms, and their refusals."""

from __future__ import annotations

import math

import pytest

import pscluster as ps
from pscluster import schedules as sch
from pscluster.errors import InvalidArgumentError
from pscluster.optimizer_config import optimizer_from_pb, optimizer_to_pb

STEPS = range(0, 60)


def keras_cosine(step, init, decay_steps, alpha=0.0, target=None, warmup=0):
    if target is None:
        s = min(step, decay_steps)
        return init * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * s / decay_steps)) + alpha)
    if step < warmup:
        return init + (target - init) * step / warmup
    s = min(step, decay_steps + warmup) - warmup
    return target * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * s / decay_steps)) + alpha)


def keras_restarts(step, init, first, t_mul, m_mul, alpha):
    frac = step / first
    if t_mul == 1.0:
        i = math.floor(frac)
        frac -= i
    else:
        i = math.floor(math.log(1 - frac * (1 - t_mul)) / math.log(t_mul))
        frac = (frac - (1 - t_mul ** i) / (1 - t_mul)) / t_mul ** i
    return init * ((1 - alpha) * 0.5 * m_mul ** i * (1 + math.cos(math.pi * frac)) + alpha)


def keras_polynomial(step, init, decay_steps, end, power, cycle):
    if cycle:
        decay_steps = decay_steps * (1 if step == 0 else math.ceil(step / decay_steps))
    else:
        step = min(step, decay_steps)
    return (init - end) * (1 - step / decay_steps) ** power + end


CASES = {
    "exponential": (sch.ExponentialDecay(0.1, 7, 0.8), lambda k: 0.1 * 0.8 ** (k / 7)),
    "exponential-staircase": (sch.ExponentialDecay(0.1, 7, 0.8, staircase=True), lambda k: 0.1 * 0.8 ** (k // 7)),
    "inverse-time": (sch.InverseTimeDecay(0.1, 5, 0.5), lambda k: 0.1 / (1 + 0.5 * k / 5)),
    "inverse-time-staircase": (sch.InverseTimeDecay(0.1, 5, 0.5, True), lambda k: 0.1 / (1 + 0.5 * (k // 5))),
    "piecewise": (sch.PiecewiseConstantDecay([10, 20], [1.0, 0.5, 0.1]),
                  lambda k: 1.0 if k <= 10 else 0.5 if k <= 20 else 0.1),
    "polynomial": (sch.PolynomialDecay(0.1, 30, 0.01, power=2.0), lambda k: keras_polynomial(k, 0.1, 30, 0.01, 2, False)),
    "polynomial-cycle": (sch.PolynomialDecay(0.1, 13, 0.01, power=0.5, cycle=True),
                         lambda k: keras_polynomial(k, 0.1, 13, 0.01, 0.5, True)),
    "cosine": (sch.CosineDecay(0.1, 40, alpha=0.1), lambda k: keras_cosine(k, 0.1, 40, 0.1)),
    "cosine-warmup": (sch.CosineDecay(0.0, 30, alpha=0.05, warmup_target=0.2, warmup_steps=10),
                      lambda k: keras_cosine(k, 0.0, 30, 0.05, 0.2, 10)),
    "cosine-restarts": (sch.CosineDecayRestarts(0.1, 5, t_mul=2.0, m_mul=0.7, alpha=0.01),
                        lambda k: keras_restarts(k, 0.1, 5, 2.0, 0.7, 0.01)),
    "cosine-restarts-t1": (sch.CosineDecayRestarts(0.1, 6, t_mul=1.0, m_mul=0.9),
                           lambda k: keras_restarts(k, 0.1, 6, 1.0, 0.9, 0.0)),
    "linear-warmup-then-exponential": (sch.LinearWarmup(sch.ExponentialDecay(0.1, 10, 0.5), 8, 0.01),
                                       lambda k: 0.01 + (0.1 - 0.01) * k / 8 if k < 8 else 0.1 * 0.5 ** ((k - 8) / 10)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_keras_schedule_equals_its_formula_at_every_step(name):
    schedule, formula = CASES[name]
    for k in STEPS:
        assert schedule(k) == pytest.approx(formula(k), rel=1e-13, abs=1e-16), k


@pytest.mark.parametrize("name", list(CASES))
def test_schedule_crosses_the_wire_and_the_checkpoint_unchanged(name):
    schedule, _ = CASES[name]
    cfg = ps.Adam(learning_rate=schedule)
    assert optimizer_from_pb(optimizer_to_pb(cfg)) == cfg
    from pscluster.optimizer_config import config_from_dict

    assert config_from_dict(cfg.to_dict()) == cfg
    assert [cfg.lr_at(t) for t in range(1, 5)] == [schedule(k) for k in range(4)]


def test_update_t_uses_the_rate_after_t_minus_one_updates():
    cfg = ps.SGD(sch.PiecewiseConstantDecay([0, 1], [1.0, 2.0, 3.0]))
    assert [cfg.lr_at(t) for t in (1, 2, 3)] == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("make, message", [
    (lambda: sch.ExponentialDecay(0.1, 0, 0.5), "decay_steps must be finite and > 0"),
    (lambda: sch.PiecewiseConstantDecay([5, 2], [1.0, 2.0, 3.0]), "boundaries must be increasing"),
    (lambda: sch.PiecewiseConstantDecay([5], [1.0]), "one more value than boundaries"),
    (lambda: sch.CosineDecay(float("nan"), 10), "initial_learning_rate must be finite"),
    (lambda: sch.schedule_from_dict({"kind": "lambda"}), "unknown schedule kind 'lambda'"),
    (lambda: sch.schedule_from_dict({"kind": "constant", "value": 1.0, "extra": 2}), "constant"),
    (lambda: sch.schedule_from_json("{"), "malformed schedule"),
])
def test_bad_schedules_are_refused_with_the_argument_named(make, message):
    with pytest.raises(InvalidArgumentError, match=message):
        make()
