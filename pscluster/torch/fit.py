"""`pscluster.torch.fit`: Keras's `model.fit` for a PSModule: a loss, metrics, validation data, callbacks.

    model = ps_torch.PSModule(coord, net, ps_torch.Adam(lr=1e-3))
    history = ps_torch.fit(coord, model, F.cross_entropy, per_worker_dataset, epochs=12, steps_per_epoch=62,
                           metrics=["accuracy"], validation_data=(x_test, y_test),
                           callbacks=[LearningRateScheduler(decay), BackupAndRestore("backup")])

The training step that runs on the workers is the one a user writes by hand (pull, forward, loss,
backward, push) and returns {"loss": ..., <metric>: ...}; the same values go to the coordinator's
training curves through `pscluster.report`. Validation runs on the driver on a copy of the module that
holds the PS's current values. Learning-rate callbacks change the rate of the module's parameters only
(buffers keep their SGD(1.0) policy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from pscluster.client import context
from pscluster.errors import InvalidArgumentError
from pscluster.torch.module import PSModule
from pscluster.training import Callback, History
from pscluster.training import fit as fit_loop

Metric = Callable[[torch.Tensor, torch.Tensor], Any]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of rows whose highest output is the target class (Keras's "accuracy" for class indices)."""
    return float((outputs.argmax(dim=-1) == targets).float().mean())


NAMED_METRICS: dict[str, Metric] = {"accuracy": accuracy, "acc": accuracy}


def _metrics(metrics: Sequence[str | Metric] | Mapping[str, Metric] | None) -> dict[str, Metric]:
    if metrics is None:
        return {}
    if isinstance(metrics, Mapping):
        return dict(metrics)
    out: dict[str, Metric] = {}
    for m in metrics:
        if isinstance(m, str):
            if m not in NAMED_METRICS:
                raise InvalidArgumentError(f"metrics: unknown name {m!r}; use {sorted(NAMED_METRICS)} or pass "
                                           "{name: fn(outputs, targets)}")
            out[m] = NAMED_METRICS[m]
        else:
            out[getattr(m, "__name__", f"metric_{len(out)}")] = m
    return out


def as_tensor(value: Any, device: torch.device | None = None) -> torch.Tensor:
    """A batch element as a tensor (numpy arrays are wrapped, not copied, on the CPU)."""
    tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
    return tensor.to(device) if device is not None and tensor.device != device else tensor


def _device(net: nn.Module) -> torch.device | None:
    return next((p.device for p in net.parameters()), None)


StepFn = Callable[[Any], dict[str, float]]
REDUCED = (torch.bfloat16, torch.float16)


def loss_input(outputs: torch.Tensor) -> torch.Tensor:
    """A reduced-precision module's outputs upcast to float32 for the loss, as torch autocast computes
    cross-entropy: a bfloat16 log-softmax keeps 8 bits of mantissa and biases the loss and its gradient."""
    return outputs.float() if outputs.dtype in REDUCED else outputs


def make_train_step(model: PSModule, loss_fn: LossFn, metrics: Mapping[str, Metric]) -> StepFn:
    """The closure body fit schedules: one minibatch (x, y) of the worker's iterator, pull, backward, push."""

    def train_step(iterator: Any) -> dict[str, float]:
        x, y = next(iterator)
        net = model.pull()
        device = _device(net)
        outputs = net(as_tensor(x, device))
        targets = as_tensor(y, device)
        loss = loss_fn(loss_input(outputs), targets)
        model.backward(loss)
        model.push()
        logs = {"loss": float(loss.detach()), **model.precision_logs()}
        with torch.no_grad():
            logs.update({name: float(fn(outputs.detach(), targets)) for name, fn in metrics.items()})
        context.report(**logs)
        return logs

    return train_step


def make_validation(model: PSModule, loss_fn: LossFn, metrics: Mapping[str, Metric], x: Any, y: Any,
                    batch_size: int = 1024) -> Callable[[], dict[str, float]]:
    """On the driver: the loss and metrics of the PS's current values on (x, y), batch-size-weighted means."""
    local: list[nn.Module] = []

    def validate() -> dict[str, float]:
        if not local:
            local.append(model.template())
        net = local[0]
        # by position: the copy's keys may differ from the original's (a Keras 3 model's do)
        net.load_state_dict(dict(zip(net.state_dict(), model.state_dict().values())))
        device = _device(net)
        totals: dict[str, float] = {}
        n = len(y)
        net.eval()
        with torch.no_grad():
            for start in range(0, n, batch_size):
                xb, yb = as_tensor(x[start:start + batch_size], device), as_tensor(y[start:start + batch_size], device)
                out = loss_input(net(xb))
                part = {"loss": float(loss_fn(out, yb)), **{k: float(fn(out, yb)) for k, fn in metrics.items()}}
                for k, v in part.items():
                    totals[k] = totals.get(k, 0.0) + v * len(yb)
        net.train()
        return {k: v / n for k, v in totals.items()}

    return validate


def _first_learning_rate(optimizer: Any) -> float:
    """The learning rate callbacks start from: the optimizer's, or its first parameter group's (ParamGroups)."""
    configs = getattr(optimizer, "configs", None)
    return float((configs[0] if configs else optimizer).learning_rate)


def fit(coord: Any, model: PSModule, loss_fn: LossFn, dataset: Any, *, epochs: int, steps_per_epoch: int,
        metrics: Sequence[str | Metric] | Mapping[str, Metric] | None = None,
        validation_data: tuple[Any, Any] | None = None, callbacks: Iterable[Callback] = (),
        initial_epoch: int = 0, verbose: int = 1, validation_batch_size: int = 1024) -> History:
    """Train a PSModule with Keras's fit semantics (see pscluster.training.fit); returns the History.

    Args:
        dataset: a per-worker dataset whose iterator yields (x, y) minibatches (numpy arrays or tensors).
        loss_fn: loss_fn(outputs, targets) -> a scalar tensor (e.g. F.cross_entropy).
        metrics: names ("accuracy") or {name: fn(outputs, targets) -> number}, computed per step on the
            workers and on validation_data on the driver.
        validation_data: (x, y) evaluated on the driver after each epoch, logged as val_loss, val_<metric>.

    Raises:
        InvalidArgumentError: an unknown metric name, or what pscluster.training.fit refuses.
    """
    named = _metrics(metrics)
    validation = None
    if validation_data is not None:
        validation = make_validation(model, loss_fn, named, *validation_data, batch_size=validation_batch_size)
    return fit_loop(coord, make_train_step(model, loss_fn, named), dataset, epochs=epochs,
                    steps_per_epoch=steps_per_epoch, learning_rate=_first_learning_rate(model.optimizer),
                    variables=model.parameter_variables(), callbacks=callbacks, validation=validation,
                    initial_epoch=initial_epoch, verbose=verbose)
