"""Keras's callbacks, run on the driver by `fit`: the base class and the learning-rate and stopping rules.

    class PrintLR(Callback):
        def on_epoch_end(self, epoch, logs=None):
            print(f"learning rate for epoch {epoch + 1} is {self.model.learning_rate}")

A callback sees `self.model` (a `TrainingModel`: `learning_rate` to read and set, `stop_training`,
`save_weights(path)`) and `self.params` (`epochs`, `steps`, `verbose`). `on_train_batch_end` gets the
logs one closure returned, in the order the closures were scheduled. A callback with state that must
survive a crash (`wait`, `best`, ...) returns it from `get_state()` as JSON-able values; BackupAndRestore
saves it at every epoch's end and `set_state` puts it back when a rerun resumes.

Learning-rate changes go to the PS tasks through `TrainingModel.learning_rate` (the coordinator's
`set_learning_rate`): they apply from the next update on every shard and are checkpointed there.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from pscluster.errors import InvalidArgumentError

log = logging.getLogger(__name__)
Logs = Mapping[str, float]


class TrainingModel(Protocol):
    """What callbacks see as `self.model`."""

    stop_training: bool
    learning_rate: float

    def save_weights(self, path: str) -> None:
        """Write every variable, whole, to one safetensors file."""


class Callback:
    """Keras's Callback: override the hooks you need; every hook runs on the driver."""

    def __init__(self) -> None:
        self.model: Any = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: TrainingModel) -> None:
        """Called by fit before training."""
        self.model = model

    def set_params(self, params: dict[str, Any]) -> None:
        """Called by fit before training: epochs, steps (per epoch), verbose."""
        self.params = params

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Before the first epoch (also on a resumed run, before its state is restored)."""

    def on_train_end(self, logs: Logs | None = None) -> None:
        """After the last epoch (or an early stop)."""

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        """Before the epoch's closures are scheduled (epoch counts from 0)."""

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """After the epoch's closures finished and validation ran: logs hold the means and val_* values."""

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """One closure finished; logs are what it returned (batch counts from 0 within the epoch)."""

    def get_state(self) -> dict[str, Any]:
        """JSON-able state that BackupAndRestore saves at each epoch's end (none by default)."""
        return {}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Put back a state get_state() returned."""


class CallbackList:
    """Calls each hook of every callback in order."""

    def __init__(self, callbacks: Iterable[Callback], model: TrainingModel, params: dict[str, Any]) -> None:
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise InvalidArgumentError(f"callbacks: {cb!r} is not a pscluster.training.Callback")
            cb.set_model(model)
            cb.set_params(params)

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Every callback's on_train_begin."""
        for cb in self.callbacks:
            cb.on_train_begin(logs)

    def on_train_end(self, logs: Logs | None = None) -> None:
        """Every callback's on_train_end."""
        for cb in self.callbacks:
            cb.on_train_end(logs)

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        """Every callback's on_epoch_begin."""
        for cb in self.callbacks:
            cb.on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Every callback's on_epoch_end."""
        for cb in self.callbacks:
            cb.on_epoch_end(epoch, logs)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Every callback's on_train_batch_end."""
        for cb in self.callbacks:
            cb.on_train_batch_end(batch, logs)


def monitor_mode(monitor: str, mode: str) -> str:
    """"min" or "max" for a monitored value; "auto" is "max" for accuracy-like names, as in Keras.

    Raises:
        InvalidArgumentError: mode is not auto, min or max.
    """
    if mode not in ("auto", "min", "max"):
        raise InvalidArgumentError(f"mode={mode!r}: use 'auto', 'min' or 'max'")
    if mode != "auto":
        return mode
    return "max" if any(word in monitor for word in ("acc", "auc", "precision", "recall")) else "min"


def monitored(monitor: str, logs: Logs | None, who: str) -> float | None:
    """logs[monitor], or None with one warning naming what the logs hold."""
    value = (logs or {}).get(monitor)
    if value is None:
        log.warning("%s: %r is not in the epoch's logs (%s); skipped", who, monitor, ", ".join(sorted(logs or {})))
        return None
    return float(value)


def _schedule_arity(schedule: Callable[..., float]) -> int:
    try:
        params = [p for p in inspect.signature(schedule).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):  # a builtin without a signature: Keras's two-argument form
        return 2
    return 1 if len(params) == 1 else 2


class LearningRateScheduler(Callback):
    """Keras's LearningRateScheduler: at each epoch's start, lr = schedule(epoch) or schedule(epoch, lr)."""

    def __init__(self, schedule: Callable[..., float], verbose: int = 0) -> None:
        super().__init__()
        self.schedule = schedule
        self.verbose = verbose
        self._arity = _schedule_arity(schedule)

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        """Set the epoch's learning rate on the PS tasks."""
        args = (epoch,) if self._arity == 1 else (epoch, self.model.learning_rate)
        lr = self.schedule(*args)
        if not isinstance(lr, (int, float)) or not math.isfinite(lr):
            raise InvalidArgumentError(f"LearningRateScheduler: schedule{args} returned {lr!r}, not a finite number")
        self.model.learning_rate = float(lr)
        if self.verbose:
            print(f"\nEpoch {epoch + 1}: LearningRateScheduler setting learning rate to {float(lr)}.")


class ReduceLROnPlateau(Callback):
    """Keras's ReduceLROnPlateau: lr *= factor after `patience` epochs without improvement of `monitor`."""

    def __init__(self, monitor: str = "val_loss", factor: float = 0.1, patience: int = 10, verbose: int = 0,
                 mode: str = "auto", min_delta: float = 1e-4, cooldown: int = 0, min_lr: float = 0.0) -> None:
        super().__init__()
        if not 0 <= factor < 1:
            raise InvalidArgumentError(f"ReduceLROnPlateau: factor={factor}; it must be in [0, 1)")
        self.monitor, self.factor, self.patience, self.verbose = monitor, factor, patience, verbose
        self.mode = monitor_mode(monitor, mode)
        self.min_delta, self.cooldown, self.min_lr = abs(min_delta), cooldown, min_lr
        self.wait = 0
        self.cooldown_counter = 0
        self.best = math.inf if self.mode == "min" else -math.inf

    def _better(self, current: float) -> bool:
        if self.mode == "min":
            return current < self.best - self.min_delta
        return current > self.best + self.min_delta

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Reset the counters."""
        self.wait = self.cooldown_counter = 0
        self.best = math.inf if self.mode == "min" else -math.inf

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Count epochs without improvement; reduce the PS learning rate after `patience` of them."""
        current = monitored(self.monitor, logs, "ReduceLROnPlateau")
        if current is None:
            return
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self._better(current):
            self.best, self.wait = current, 0
        elif self.cooldown_counter <= 0:
            self.wait += 1
            if self.wait >= self.patience:
                old = self.model.learning_rate
                if old > self.min_lr:
                    new = max(old * self.factor, self.min_lr)
                    self.model.learning_rate = new
                    if self.verbose:
                        print(f"\nEpoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to {new}.")
                    self.cooldown_counter, self.wait = self.cooldown, 0

    def get_state(self) -> dict[str, Any]:
        """wait, cooldown counter, best."""
        return {"wait": self.wait, "cooldown_counter": self.cooldown_counter, "best": self.best}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue counting from a saved state."""
        self.wait, self.cooldown_counter = int(state["wait"]), int(state["cooldown_counter"])
        self.best = float(state["best"])


class EarlyStopping(Callback):
    """Keras's EarlyStopping: stop training after `patience` epochs without improvement of `monitor`."""

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0.0, patience: int = 0, verbose: int = 0,
                 mode: str = "auto", baseline: float | None = None, restore_best_weights: bool = False,
                 start_from_epoch: int = 0) -> None:
        super().__init__()
        if restore_best_weights:
            raise InvalidArgumentError("EarlyStopping(restore_best_weights=True) is not supported: the weights live "
                                       "on the PS tasks; keep the best with ModelCheckpoint(save_best_only=True)")
        self.monitor, self.min_delta, self.patience, self.verbose = monitor, abs(min_delta), patience, verbose
        self.mode = monitor_mode(monitor, mode)
        self.baseline, self.start_from_epoch = baseline, start_from_epoch
        self.wait = self.stopped_epoch = self.best_epoch = 0
        self.best: float | None = baseline

    def _improves(self, value: float, reference: float | None) -> bool:
        if reference is None:
            return True
        if self.mode == "min":
            return value + self.min_delta < reference
        return value - self.min_delta > reference

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Reset the counters."""
        self.wait = self.stopped_epoch = self.best_epoch = 0
        self.best = self.baseline

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Count epochs without improvement; set model.stop_training after `patience` of them."""
        current = monitored(self.monitor, logs, "EarlyStopping")
        if current is None or epoch < self.start_from_epoch:
            return
        self.wait += 1
        if self._improves(current, self.best):
            self.best, self.best_epoch = current, epoch
            if self.baseline is None or self._improves(current, self.baseline):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.model.stop_training = True
            if self.verbose:
                print(f"\nEpoch {epoch + 1}: early stopping (best {self.monitor} {self.best} at epoch "
                      f"{self.best_epoch + 1})")

    def get_state(self) -> dict[str, Any]:
        """wait, best, best epoch."""
        return {"wait": self.wait, "best": self.best, "best_epoch": self.best_epoch}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue counting from a saved state."""
        self.wait, self.best_epoch = int(state["wait"]), int(state["best_epoch"])
        self.best = None if state["best"] is None else float(state["best"])
