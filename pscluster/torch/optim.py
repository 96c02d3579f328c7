"""PS-side optimizers under PyTorch's names and defaults, and the translation of `torch.optim` instances.

The update runs on the PS (server/optimizers.py); these only build its `OptimizerConfig`:

    ps_torch.SGD(lr=0.1, momentum=0.9, weight_decay=5e-4)          # torch.optim.SGD's names
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    ps_torch.from_torch(opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10_000))

Formulas are torch.optim's, eps included (Adam: eps added to sqrt(v_hat)); `weight_decay` is
torch's coupled decay (g += wd * w) except AdamW's decoupled one. Sparse variants are lazy: only
touched rows and their slots change (torch's SparseAdam for Adam; from_torch(SparseAdam) also takes its
epsilon placement, before the bias correction of the step). Parameter groups with different
settings give a `ParamGroups`, which PSModule applies parameter by parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pscluster.errors import InvalidArgumentError
from pscluster.optimizers import OptimizerConfig
from pscluster.torch.schedulers import from_torch_momentum, from_torch_scheduler


def SGD(lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,  # noqa: N802
        nesterov: bool = False) -> OptimizerConfig:
    """torch.optim.SGD run on the PS."""
    if nesterov and (momentum <= 0 or dampening != 0):
        raise InvalidArgumentError(f"SGD: nesterov needs momentum > 0 and zero dampening, got momentum={momentum}, "
                                   f"dampening={dampening}")
    return OptimizerConfig("momentum" if momentum else "sgd", float(lr), momentum=float(momentum),
                           dampening=float(dampening), weight_decay=float(weight_decay), nesterov=nesterov).validate()


def Adagrad(lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,  # noqa: N802
            initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> OptimizerConfig:
    """torch.optim.Adagrad run on the PS."""
    return OptimizerConfig("adagrad", float(lr), lr_decay=float(lr_decay), weight_decay=float(weight_decay),
                           initial_accumulator_value=float(initial_accumulator_value), epsilon=float(eps)).validate()


def Adam(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,  # noqa: N802
         weight_decay: float = 0.0, amsgrad: bool = False, decoupled_weight_decay: bool = False) -> OptimizerConfig:
    """torch.optim.Adam / SparseAdam run on the PS."""
    return OptimizerConfig("adam", float(lr), beta1=float(betas[0]), beta2=float(betas[1]), epsilon=float(eps),
                           weight_decay=float(weight_decay), amsgrad=amsgrad,
                           decoupled_weight_decay=decoupled_weight_decay).validate()


def AdamW(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,  # noqa: N802
          weight_decay: float = 1e-2, amsgrad: bool = False) -> OptimizerConfig:
    """torch.optim.AdamW run on the PS: w *= 1 - lr * weight_decay, then Adam."""
    return Adam(lr, betas, eps, weight_decay, amsgrad, decoupled_weight_decay=True)


def RMSprop(lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,  # noqa: N802
            momentum: float = 0.0, centered: bool = False) -> OptimizerConfig:
    """torch.optim.RMSprop run on the PS."""
    return OptimizerConfig("rmsprop", float(lr), rho=float(alpha), epsilon=float(eps), weight_decay=float(weight_decay),
                           momentum=float(momentum), centered=centered).validate()


@dataclass(frozen=True)
class ParamGroups:
    """Per-parameter PS optimizers of a torch optimizer whose groups differ (e.g. no decay on biases)."""

    configs: tuple[OptimizerConfig, ...]
    group_of: dict[int, int]  # id(parameter) -> index into configs

    def for_parameter(self, param: Any) -> OptimizerConfig:
        """The config of the group holding `param`; InvalidArgumentError if no group holds it."""
        index = self.group_of.get(id(param))
        if index is None:
            raise InvalidArgumentError(f"a parameter of shape {tuple(getattr(param, 'shape', ()))} is in no group "
                                       "of the torch optimizer given to from_torch")
        return self.configs[index]


# option -> the value under which the PS optimizer computes what torch would
_NEUTRAL: dict[str, Any] = {"maximize": False, "capturable": False, "differentiable": False}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "SGD": {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
    "Adam": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
             "decoupled_weight_decay": False},
    "AdamW": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False},
    "SparseAdam": {"betas": (0.9, 0.999), "eps": 1e-8},
    "Adagrad": {"lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10},
    "RMSprop": {"alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0, "centered": False},
}


def _group_config(kind: str, group: dict[str, Any]) -> OptimizerConfig:
    for name, neutral in _NEUTRAL.items():
        if group.get(name, neutral) not in (neutral, None):
            raise InvalidArgumentError(f"from_torch: {kind}({name}={group[name]!r}) is not supported on the PS; "
                                       f"use {name}={neutral!r}")
    args = {k: group.get(k, v) for k, v in _DEFAULTS[kind].items()}
    if "betas" in args:
        args["betas"] = (float(args["betas"][0]), float(args["betas"][1]))
    lr = float(group.get("initial_lr", group["lr"]))
    if kind == "SGD":
        return SGD(lr, **args)
    if kind == "Adagrad":
        return Adagrad(lr, **args)
    if kind == "RMSprop":
        return RMSprop(lr, **args)
    if kind == "AdamW":
        return AdamW(lr, **args)
    if kind == "SparseAdam":  # torch's SparseAdam adds eps before the bias correction of the step (Keras's form)
        return replace(Adam(lr, **args), epsilon_hat=True)
    return Adam(lr, **args)


def from_torch(optimizer: Any, scheduler: Any = None) -> OptimizerConfig | ParamGroups:
    """The PS optimizer equivalent to a torch.optim SGD, Adam, AdamW, SparseAdam, Adagrad or RMSprop
    instance and, optionally, its learning-rate scheduler (stepped once per update on the PS).

    Returns:
        One OptimizerConfig when every parameter group has the same settings, else a ParamGroups
        (PSModule accepts both).

    Raises:
        InvalidArgumentError: another optimizer class, an option the PS does not implement (maximize,
            ...), or a scheduler without a PS form (LambdaLR, ...), each named with the alternative.
    """
    kind = type(optimizer).__name__
    groups = list(getattr(optimizer, "param_groups", []))
    if kind not in _DEFAULTS or not groups:
        raise InvalidArgumentError(f"from_torch: {kind} has no PS equivalent; use SGD, Adam, AdamW, SparseAdam, "
                                   "Adagrad or RMSprop (or pscluster's Ftrl, Lion)")
    if scheduler is not None and scheduler.optimizer is not optimizer:
        raise InvalidArgumentError(f"from_torch: the {type(scheduler).__name__} given drives another optimizer")
    configs = []
    for i, group in enumerate(groups):
        cfg = _group_config(kind, group)
        if scheduler is not None:
            cfg = replace(cfg, schedule=from_torch_scheduler(scheduler, i),
                          momentum_schedule=from_torch_momentum(scheduler, i)).validate()
        configs.append(cfg)
    if all(c == configs[0] for c in configs[1:]):
        return configs[0]
    return ParamGroups(tuple(configs), {id(p): i for i, g in enumerate(groups) for p in g["params"]})
