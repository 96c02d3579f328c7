"""A variable's PS-side optimizer: its kind, hyper-parameters, learning-rate schedule and clipping.

One frozen value that the client builds (pscluster.optimizers, pscluster.torch, pscluster.jax),
the wire carries (OptimizerSpec), the PS applies (server/optimizers.py) and checkpoints carry (as
`to_dict()`). The formulas behind each field are in server/optimizers.py and docs/optimizers.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from typing import Any

from pscluster.errors import InvalidArgumentError
from pscluster.proto import pscluster_pb2 as pb
from pscluster.schedules import Schedule, schedule_from_dict, schedule_from_json, schedule_to_json

KINDS = ("sgd", "momentum", "adagrad", "adam", "rmsprop", "ftrl", "lion")
# What a driver may change while training runs (coord.set_hyperparameters): the rest shapes the slots.
MUTABLE = ("learning_rate", "schedule", "momentum_schedule", "momentum", "beta1", "beta2", "epsilon", "weight_decay", "dampening",
           "rho", "lr_decay", "l1", "l2", "l2_shrinkage", "beta", "clip_value", "clip_norm")


@dataclass(frozen=True)
class OptimizerConfig:
    """Hyper-parameters of a PS-side optimizer; `schedule`, when set, gives the rate of every update."""

    kind: str = "sgd"
    learning_rate: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-7
    initial_accumulator_value: float = 0.1
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False  # w -= lr * weight_decay * w (AdamW, Lion, Keras) vs g += wd * w (torch)
    amsgrad: bool = False
    dampening: float = 0.0
    rho: float = 0.9  # RMSprop's decay (torch's alpha, optax's decay)
    centered: bool = False
    lr_decay: float = 0.0  # torch Adagrad: lr / (1 + (t - 1) * lr_decay)
    l1: float = 0.0
    l2: float = 0.0
    l2_shrinkage: float = 0.0
    learning_rate_power: float = -0.5
    beta: float = 0.0
    epsilon_hat: bool = False  # Adam: Keras/TF places epsilon before the bias correction of the step
    eps_in_sqrt: bool = False  # Adagrad/RMSprop: sqrt(acc + eps) (Keras, optax) vs sqrt(acc) + eps (torch)
    clip_value: float = 0.0  # 0: off; else each gradient element is clipped to [-clip_value, clip_value]
    clip_norm: float = 0.0  # 0: off; else the variable's gradient is scaled to an L2 norm <= clip_norm
    schedule: Schedule | None = None
    # Momentum/RMSprop buffer: False keeps the step (torch: buf = mu * buf + g; w -= lr * buf), True keeps the
    # rate inside (Keras, optax's rmsprop: buf = mu * buf + lr * g; w -= buf). Equal at a constant rate only.
    lr_in_momentum: bool = False
    # The momentum (momentum, rmsprop) or beta1 (adam) of update t is momentum_schedule(t - 1) when set
    # (torch's OneCycleLR/CyclicLR with cycle_momentum); Adam's bias correction uses that update's beta1.
    momentum_schedule: Schedule | None = None

    def slot_names(self) -> tuple[str, ...]:
        """Names of the slot variables this optimizer keeps per shard."""
        if self.kind == "momentum":
            return ("momentum",)
        if self.kind == "adagrad":
            return ("accumulator",)
        if self.kind == "adam":
            return ("m", "v", "v_max") if self.amsgrad else ("m", "v")
        if self.kind == "rmsprop":
            return ("square_avg",) + (("grad_avg",) if self.centered else ()) + \
                (("momentum",) if self.momentum > 0 or self.momentum_schedule is not None else ())
        if self.kind == "ftrl":
            return ("accumulator", "linear")
        if self.kind == "lion":
            return ("m",)
        return ()

    def lr_at(self, t: int) -> float:
        """The learning rate of update t (1-based): the schedule's value after t - 1 updates."""
        return self.learning_rate if self.schedule is None else self.schedule(t - 1)

    def at(self, t: int) -> OptimizerConfig:
        """Self with the momentum (or Adam's beta1) of update t from momentum_schedule; self when there is none."""
        if self.momentum_schedule is None:
            return self
        value = self.momentum_schedule(t - 1)
        return replace(self, beta1=value) if self.kind == "adam" else replace(self, momentum=value)

    def validate(self) -> OptimizerConfig:
        """Self, or InvalidArgumentError naming the bad hyper-parameter and its value."""
        if self.kind not in KINDS:
            raise InvalidArgumentError(f"unknown optimizer {self.kind!r}; use one of {', '.join(KINDS)}")
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise InvalidArgumentError(f"{self.kind}: {f.name} must be finite, got {v}")
        if self.learning_rate < 0:
            raise InvalidArgumentError(f"{self.kind}: learning_rate must be >= 0, got {self.learning_rate}")
        if not 0 <= self.momentum <= 1 or not 0 <= self.beta1 < 1 \
                or not 0 <= self.beta2 < 1 or not 0 <= self.rho <= 1 or not 0 <= self.dampening <= 1:
            raise InvalidArgumentError(
                f"{self.kind}: momentum, rho and dampening must be in [0, 1], beta1 and beta2 in [0, 1); got "
                f"momentum={self.momentum}, rho={self.rho}, dampening={self.dampening}, beta1={self.beta1}, "
                f"beta2={self.beta2}")
        for name in ("epsilon", "initial_accumulator_value", "weight_decay", "lr_decay", "l1", "l2", "l2_shrinkage",
                     "beta", "clip_value", "clip_norm"):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"{self.kind}: {name} must be >= 0, got {getattr(self, name)}")
        if self.learning_rate_power > 0:
            raise InvalidArgumentError(f"ftrl: learning_rate_power must be <= 0, got {self.learning_rate_power}")
        if self.nesterov and self.kind == "momentum" and (self.momentum <= 0 or self.dampening != 0):
            raise InvalidArgumentError(f"momentum: nesterov needs momentum > 0 and dampening 0, got "
                                       f"momentum={self.momentum}, dampening={self.dampening}")
        if self.lr_in_momentum and self.dampening:
            raise InvalidArgumentError(f"{self.kind}: dampening has no meaning with lr_in_momentum (Keras's "
                                       f"momentum form), got dampening={self.dampening}")
        if self.kind == "ftrl" and self.weight_decay:
            raise InvalidArgumentError("ftrl: weight_decay is not defined for FTRL; use l2 or l2_shrinkage")
        if self.schedule is not None:
            self.schedule.validate()
        if self.momentum_schedule is not None:
            if self.kind not in ("momentum", "rmsprop", "adam"):
                raise InvalidArgumentError(f"{self.kind}: momentum_schedule needs a momentum (momentum, rmsprop) or "
                                           "beta1 (adam) to schedule")
            self.momentum_schedule.validate()
        return self

    def changed(self, changes: dict[str, Any]) -> OptimizerConfig:
        """A copy with `changes` (MUTABLE names only) applied and validated; a new learning_rate drops the schedule."""
        bad = sorted(set(changes) - set(MUTABLE))
        if bad:
            raise InvalidArgumentError(f"{self.kind}: cannot change {', '.join(bad)} while training; "
                                       f"changeable: {', '.join(MUTABLE)}")
        try:
            values: dict[str, Any] = {k: (v if k in _SCHEDULES else float(v)) for k, v in changes.items()}
            if "learning_rate" in values and "schedule" not in values:
                values["schedule"] = None
            if ("momentum" in values or "beta1" in values) and "momentum_schedule" not in values:
                values["momentum_schedule"] = None  # a value set by the driver ends the momentum schedule
            new = replace(self, **values).validate()
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"{self.kind}: bad hyper-parameter change {changes!r}: {exc}") from exc
        if new.slot_names() != self.slot_names():
            raise InvalidArgumentError(f"{self.kind}: changing {', '.join(sorted(changes))} would change the slot "
                                       f"variables {self.slot_names()} -> {new.slot_names()}; create the variable "
                                       "with that setting instead")
        return new

    def structure(self) -> OptimizerConfig:
        """Self with every MUTABLE field at its default: what a re-creation of the variable must match."""
        return replace(self, **{name: getattr(_DEFAULT, name) for name in MUTABLE})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (checkpoints); inverse of `config_from_dict`."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in _SCHEDULES:
            out[name] = None if getattr(self, name) is None else getattr(self, name).to_dict()
        return out


_DEFAULT = OptimizerConfig()
_SCHEDULES = ("schedule", "momentum_schedule")  # the fields holding a Schedule


def config_from_dict(d: dict[str, Any]) -> OptimizerConfig:
    """An OptimizerConfig from `to_dict()` output (keys it lacks take their defaults)."""
    known = {f.name for f in fields(OptimizerConfig)}
    args = {k: v for k, v in d.items() if k in known}
    for name in _SCHEDULES:
        if args.get(name) is not None:
            args[name] = schedule_from_dict(args[name])
    return OptimizerConfig(**args).validate()


def optimizer_to_pb(cfg: OptimizerConfig) -> pb.OptimizerSpec:
    """OptimizerConfig -> OptimizerSpec message."""
    d = cfg.to_dict()
    for name in _SCHEDULES:
        d[name] = schedule_to_json(getattr(cfg, name))
    return pb.OptimizerSpec(**d)


def optimizer_from_pb(msg: pb.OptimizerSpec) -> OptimizerConfig:
    """OptimizerSpec message -> validated OptimizerConfig (empty kind means sgd)."""
    args: dict[str, Any] = {f.name: getattr(msg, f.name) for f in fields(OptimizerConfig)}
    for name in _SCHEDULES:
        args[name] = schedule_from_json(getattr(msg, name))
    args["kind"] = msg.kind or "sgd"
    return OptimizerConfig(**args).validate()


def changes_to_json(changes: dict[str, Any]) -> str:
    """Wire form of a driver's hyper-parameter changes (a schedule as its dict); names are checked on the PS."""
    try:
        return json.dumps({k: (v.to_dict() if isinstance(v, Schedule) else v) for k, v in changes.items()})
    except TypeError as exc:
        raise InvalidArgumentError(f"hyper-parameter changes must be numbers or a schedule: {exc}") from exc


def changes_from_json(text: str) -> dict[str, Any]:
    """Inverse of changes_to_json: config field -> value, a schedule parsed."""
    try:
        changes = json.loads(text or "{}")
    except ValueError as exc:
        raise InvalidArgumentError(f"malformed hyper-parameter changes {text[:80]!r}: {exc}") from exc
    if not isinstance(changes, dict) or not changes:
        raise InvalidArgumentError(f"hyper-parameter changes must be a non-empty JSON object, got {text[:80]!r}")
    for name in _SCHEDULES:
        if changes.get(name) is not None:
            changes[name] = schedule_from_dict(changes[name])
    return changes
