"""ReduceLROnPlateau: lower the learning rate when a metric the driver sees stops improving.

    plateau = ps.ReduceLROnPlateau(coord, lr=0.1, mode="min", factor=0.5, patience=2)
    for epoch in range(epochs):
        ...                                   # schedule and join the epoch's steps
        plateau.step(evaluator_loss)          # may call coord.set_learning_rate(...)

The rule is a pure `decide(rule, state, metric) -> (state, new_lr)` with torch's semantics (arguments
of torch.optim.lr_scheduler.ReduceLROnPlateau) or Keras's (`ReduceLROnPlateau.keras(...)`, the
arguments of keras.callbacks.ReduceLROnPlateau: wait >= patience, an absolute min_delta, cooldown
counted before the comparison). The helper applies a decision through `coord.set_learning_rate`,
which every PS applies from its next update and keeps in its checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pscluster.errors import InvalidArgumentError


@dataclass(frozen=True)
class PlateauRule:
    """The arguments of the rule (torch's names; `keras` picks Keras's counting)."""

    mode: str = "min"
    factor: float = 0.1
    patience: int = 10
    threshold: float = 1e-4
    threshold_mode: str = "rel"
    cooldown: int = 0
    min_lr: float = 0.0
    eps: float = 1e-8
    keras: bool = False

    def validate(self) -> PlateauRule:
        """Self, or InvalidArgumentError naming the bad argument."""
        if self.mode not in ("min", "max") or self.threshold_mode not in ("rel", "abs"):
            raise InvalidArgumentError(f"ReduceLROnPlateau: mode must be min or max and threshold_mode rel or abs, "
                                       f"got {self.mode!r}, {self.threshold_mode!r}")
        if not 0 <= self.factor < 1:
            raise InvalidArgumentError(f"ReduceLROnPlateau: factor must be in [0, 1), got {self.factor}")
        if self.patience < 0 or self.cooldown < 0 or self.min_lr < 0:
            raise InvalidArgumentError(f"ReduceLROnPlateau: patience, cooldown and min_lr must be >= 0, got "
                                       f"{self.patience}, {self.cooldown}, {self.min_lr}")
        return self

    def better(self, a: float, best: float) -> bool:
        """Whether metric `a` improves on `best`."""
        if self.keras:
            return a < best - self.threshold if self.mode == "min" else a > best + self.threshold
        if self.mode == "min":
            return a < (best * (1 - self.threshold) if self.threshold_mode == "rel" else best - self.threshold)
        return a > (best * (1 + self.threshold) if self.threshold_mode == "rel" else best + self.threshold)


@dataclass(frozen=True)
class PlateauState:
    """Where the rule stands: best metric, epochs without improvement, cooldown left, current rate."""

    lr: float
    best: float
    bad: int = 0
    cooldown_left: int = 0


def initial_state(rule: PlateauRule, lr: float) -> PlateauState:
    """The state before the first metric."""
    return PlateauState(lr, math.inf if rule.mode == "min" else -math.inf)


def decide(rule: PlateauRule, state: PlateauState, metric: float) -> tuple[PlateauState, float | None]:
    """The state after one metric value, and the new learning rate if it is to change (else None)."""
    if rule.keras:
        s = state
        if s.cooldown_left > 0:
            s = replace(s, cooldown_left=s.cooldown_left - 1, bad=0)
        if rule.better(metric, s.best):
            return replace(s, best=metric, bad=0), None
        if s.cooldown_left > 0:
            return s, None
        s = replace(s, bad=s.bad + 1)
        if s.bad >= rule.patience and s.lr > rule.min_lr:
            new = max(s.lr * rule.factor, rule.min_lr)
            return replace(s, lr=new, bad=0, cooldown_left=rule.cooldown), new
        return s, None
    s = replace(state, best=metric, bad=0) if rule.better(metric, state.best) else replace(state, bad=state.bad + 1)
    if s.cooldown_left > 0:
        s = replace(s, cooldown_left=s.cooldown_left - 1, bad=0)
    if s.bad > rule.patience:
        new = max(s.lr * rule.factor, rule.min_lr)
        s = replace(s, bad=0, cooldown_left=rule.cooldown)
        if s.lr - new > rule.eps:
            return replace(s, lr=new), new
    return s, None


class ReduceLROnPlateau:
    """torch's/Keras's ReduceLROnPlateau for a cluster: `step(metric)` may call coord.set_learning_rate."""

    def __init__(self, coord: Any, lr: float, mode: str = "min", factor: float = 0.1, patience: int = 10,
                 threshold: float = 1e-4, threshold_mode: str = "rel", cooldown: int = 0, min_lr: float = 0.0,
                 eps: float = 1e-8, variables: Sequence[str] | None = None, *, keras: bool = False) -> None:
        """Args as torch.optim.lr_scheduler.ReduceLROnPlateau; `lr` is the rate the variables run at now."""
        self.rule = PlateauRule(mode, factor, patience, threshold, threshold_mode, cooldown, min_lr, eps,
                                keras).validate()
        self.state = initial_state(self.rule, float(lr))
        self._coord = coord
        self._variables = None if variables is None else list(variables)

    @classmethod
    def keras(cls, coord: Any, lr: float, factor: float = 0.1, patience: int = 10, mode: str = "min",
              min_delta: float = 1e-4, cooldown: int = 0, min_lr: float = 0.0,
              variables: Sequence[str] | None = None) -> ReduceLROnPlateau:
        """keras.callbacks.ReduceLROnPlateau's arguments and counting (mode "auto" is yours to resolve)."""
        return cls(coord, lr, mode, factor, patience, min_delta, "abs", cooldown, min_lr, variables=variables,
                   keras=True)

    @property
    def lr(self) -> float:
        """The learning rate the rule has set (or started from)."""
        return self.state.lr

    def step(self, metric: float) -> float:
        """Feed one metric value (e.g. an evaluation loss); lowers the rate on a plateau. Returns the rate."""
        self.state, new = decide(self.rule, self.state, float(metric))
        if new is not None:
            self._coord.set_learning_rate(new, self._variables)
        return self.state.lr
