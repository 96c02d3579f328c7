"""PS-side optimizers under PyTorch's names and defaults, and the translation of a `torch.optim` instance.

The update runs on the PS (server/optimizers.py); these only build its `OptimizerConfig`:

    ps_torch.SGD(lr=0.1, momentum=0.9)                  # torch.optim.SGD's names
    ps_torch.from_torch(torch.optim.Adam(net.parameters(), lr=1e-3))

Formulas match torch.optim for SGD (with momentum and Nesterov) and Adagrad. Adam differs from
torch.optim.Adam in where epsilon enters (TF's form: eps is added to sqrt(v) before the bias
correction of the step size), a difference of order eps; its sparse variant is torch's SparseAdam
(lazy: only touched rows' moments change).
"""

from __future__ import annotations

from typing import Any

from pscluster import optimizers
from pscluster.errors import InvalidArgumentError
from pscluster.optimizers import OptimizerConfig


def SGD(lr: float = 1e-3, momentum: float = 0.0, nesterov: bool = False) -> OptimizerConfig:  # noqa: N802
    """torch.optim.SGD (no dampening, no weight decay) run on the PS."""
    if nesterov and momentum <= 0:
        raise InvalidArgumentError(f"SGD: nesterov needs momentum > 0, got momentum={momentum}")
    return optimizers.Momentum(lr, momentum, nesterov) if momentum else optimizers.SGD(lr)


def Adagrad(lr: float = 1e-2, initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> OptimizerConfig:  # noqa: N802
    """torch.optim.Adagrad (no lr_decay, no weight decay) run on the PS."""
    return optimizers.Adagrad(lr, initial_accumulator_value, eps)


def Adam(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> OptimizerConfig:  # noqa: N802
    """torch.optim.Adam / SparseAdam (no weight decay, no amsgrad) run on the PS."""
    return optimizers.Adam(lr, betas[0], betas[1], eps)


# option -> the value under which the PS optimizer computes what torch would
_NEUTRAL: dict[str, Any] = {"weight_decay": 0, "dampening": 0, "amsgrad": False, "maximize": False,
                            "lr_decay": 0, "decoupled_weight_decay": False}


def from_torch(optimizer: Any) -> OptimizerConfig:
    """The PS optimizer equivalent to a torch.optim.SGD, Adagrad, Adam or SparseAdam instance.

    Raises:
        InvalidArgumentError: another optimizer class, parameter groups with different settings, or
            an option the PS optimizers do not implement (weight_decay, dampening, amsgrad, ...).
    """
    kind = type(optimizer).__name__
    groups = [{k: v for k, v in g.items() if k != "params"} for g in getattr(optimizer, "param_groups", [])]
    if kind not in ("SGD", "Adagrad", "Adam", "SparseAdam") or not groups:
        raise InvalidArgumentError(f"from_torch: {kind} has no PS equivalent; use SGD, Adagrad, Adam or SparseAdam")
    if any(g != groups[0] for g in groups[1:]):
        raise InvalidArgumentError(f"from_torch: {kind} has {len(groups)} parameter groups with different settings; "
                                   "the PS applies one optimizer per model")
    group = groups[0]
    for name, neutral in _NEUTRAL.items():
        if name in group and group[name] not in (neutral, None):
            raise InvalidArgumentError(f"from_torch: {kind}({name}={group[name]!r}) is not supported on the PS; "
                                       f"use {name}={neutral!r}")
    lr = float(group["lr"])
    if kind == "SGD":
        return SGD(lr, float(group.get("momentum", 0.0)), bool(group.get("nesterov", False)))
    if kind == "Adagrad":
        return Adagrad(lr, float(group.get("initial_accumulator_value", 0.0)), float(group.get("eps", 1e-10)))
    b1, b2 = group.get("betas", (0.9, 0.999))
    return Adam(lr, (float(b1), float(b2)), float(group.get("eps", 1e-8)))
