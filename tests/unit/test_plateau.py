"""ReduceLROnPlateau's decisions against torch's own scheduler and Keras's callback rule (written out here),
fed the same metric sequence; the helper calls set_learning_rate exactly when the rate changes."""

from __future__ import annotations

import pytest
import torch

import pscluster as ps
from pscluster.errors import InvalidArgumentError
from pscluster.plateau import PlateauRule, decide, initial_state

METRICS = [1.0, 0.9, 0.95, 0.95, 0.95, 0.89, 0.9, 0.9, 0.9, 0.9, 0.88, 0.88, 0.88, 0.88, 0.88, 0.88, 0.5, 0.6, 0.6,
           0.6, 0.6, 0.6, 0.6]


class RecordingCoordinator:
    """Stands in for a coordinator: records what the helper asks of it."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, object]] = []

    def set_learning_rate(self, lr: float, variables: object = None) -> int:
        self.calls.append((lr, variables))
        return 1


@pytest.mark.parametrize("kwargs", [
    dict(mode="min", factor=0.5, patience=2),
    dict(mode="min", factor=0.5, patience=1, cooldown=2, threshold=0.05, threshold_mode="abs", min_lr=0.02),
    dict(mode="max", factor=0.1, patience=0, threshold_mode="rel"),
])
def test_decisions_equal_torch_reduce_lr_on_plateau(kwargs):
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=0.1)
    torch_rule = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, **kwargs)
    coord = RecordingCoordinator()
    plateau = ps.ReduceLROnPlateau(coord, 0.1, variables=["w"], **kwargs)
    for m in METRICS:
        torch_rule.step(m)
        assert plateau.step(m) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-15)
    assert [lr for lr, _ in coord.calls] == sorted({lr for lr, _ in coord.calls}, reverse=True)
    assert all(v == ["w"] for _, v in coord.calls)


def keras_rule(metrics, lr, factor, patience, min_delta, cooldown, min_lr):
    """keras.callbacks.ReduceLROnPlateau.on_epoch_end, mode min, written out."""
    best, wait, cooldown_counter, out = float("inf"), 0, 0, []
    for current in metrics:
        if cooldown_counter > 0:
            cooldown_counter -= 1
            wait = 0
        if current < best - min_delta:
            best, wait = current, 0
        elif not cooldown_counter > 0:
            wait += 1
            if wait >= patience and lr > min_lr:
                lr = max(lr * factor, min_lr)
                cooldown_counter, wait = cooldown, 0
        out.append(lr)
    return out


@pytest.mark.parametrize("patience, cooldown, min_delta", [(2, 0, 1e-4), (1, 2, 0.05), (3, 1, 0.0)])
def test_keras_flavour_equals_the_keras_callback_rule(patience, cooldown, min_delta):
    plateau = ps.ReduceLROnPlateau.keras(RecordingCoordinator(), 0.1, factor=0.5, patience=patience,
                                         min_delta=min_delta, cooldown=cooldown, min_lr=0.01)
    got = [plateau.step(m) for m in METRICS]
    assert got == pytest.approx(keras_rule(METRICS, 0.1, 0.5, patience, min_delta, cooldown, 0.01), rel=1e-15)


def test_decide_is_pure_and_reports_only_changes():
    rule = PlateauRule(patience=0, factor=0.5)
    state = initial_state(rule, 1.0)
    state, new = decide(rule, state, 3.0)
    assert new is None and state.best == 3.0
    state, new = decide(rule, state, 3.0)
    assert new == 0.5 and state.lr == 0.5


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="auto"), "mode must be min or max"),
    (dict(factor=1.0), r"factor must be in \[0, 1\)"),
    (dict(patience=-1), "patience, cooldown and min_lr must be >= 0"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        ps.ReduceLROnPlateau(RecordingCoordinator(), 0.1, **kwargs)
