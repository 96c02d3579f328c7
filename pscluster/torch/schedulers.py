"""`torch.optim.lr_scheduler` instances as PS schedules (pscluster.schedules), one per parameter group.

The PS advances the rate once per update, as `scheduler.step()` after each `optimizer.step()`; each
scheduler maps to the closed form of the rate it produces after k steps. What has no closed form the
PS can evaluate (a Python function, a metric) is refused with the alternative.
"""

from __future__ import annotations

import collections
from typing import Any

from pscluster import schedules as sch
from pscluster.errors import InvalidArgumentError

_REFUSED = {
    "LambdaLR": "a Python function cannot run on the PS; express it with pscluster.schedules shapes "
                "(Sequence, Linear, Cosine, Piecewise, ...) or drive it with coord.set_learning_rate",
    "MultiplicativeLR": "a Python function cannot run on the PS; use ExponentialLR or pscluster.schedules",
    "ReduceLROnPlateau": "it follows a metric the driver sees: use pscluster.ReduceLROnPlateau, which calls "
                         "coord.set_learning_rate",
    "ChainedScheduler": "chain the shapes yourself with pscluster.schedules (a product is not supported); "
                        "SequentialLR is",
    "CyclicLR": "use OneCycleLR, CosineAnnealingWarmRestarts or pscluster.schedules shapes",
}


def _one(s: Any, base: float, group: dict[str, Any]) -> sch.Schedule:
    """Scheduler `s` for a group of base rate `base`."""
    kind = type(s).__name__
    if kind == "StepLR":
        return sch.Exponential(base, float(s.step_size), float(s.gamma), staircase=True)
    if kind == "MultiStepLR":
        counts = collections.Counter(s.milestones)
        bounds = sorted(counts)
        values, lr = [base], base
        for b in bounds:
            lr *= float(s.gamma) ** counts[b]
            values.append(lr)
        return sch.Piecewise(tuple(int(b) for b in bounds), tuple(values), right_closed=False)
    if kind == "ExponentialLR":
        return sch.Exponential(base, 1.0, float(s.gamma))
    if kind == "CosineAnnealingLR":
        return sch.Cosine(base, int(s.T_max), float(s.eta_min), periodic=True)
    if kind == "CosineAnnealingWarmRestarts":
        return sch.WarmRestarts(base, int(s.T_0), int(s.T_mult), float(s.eta_min))
    if kind == "LinearLR":
        return sch.Linear(base * float(s.start_factor), base * float(s.end_factor), int(s.total_iters))
    if kind == "ConstantLR":
        return sch.Piecewise((int(s.total_iters),), (base * float(s.factor), base), right_closed=False)
    if kind == "PolynomialLR":
        return sch.Polynomial(base, 0.0, int(s.total_iters), float(s.power))
    if kind == "OneCycleLR":
        if s.cycle_momentum:
            raise InvalidArgumentError("from_torch: OneCycleLR(cycle_momentum=True) changes momentum every step, "
                                       "which the PS does not schedule; pass cycle_momentum=False")
        phases = tuple((float(p["end_step"]), float(group[p["start_lr"]]), float(group[p["end_lr"]]))
                       for p in s._schedule_phases)
        return sch.OneCycle(phases, str(getattr(s, "_anneal_func_type", "cos")))
    if kind == "SequentialLR":
        subs = tuple(_one(sub, base, group) for sub in s._schedulers)
        return sch.Sequence(subs, tuple(int(m) for m in s._milestones))
    if kind in _REFUSED:
        raise InvalidArgumentError(f"from_torch: {kind} cannot run on the PS: {_REFUSED[kind]}")
    raise InvalidArgumentError(f"from_torch: {kind} has no PS equivalent; use StepLR, MultiStepLR, ExponentialLR, "
                               "CosineAnnealingLR, CosineAnnealingWarmRestarts, LinearLR, ConstantLR, PolynomialLR, "
                               "OneCycleLR or SequentialLR, or pscluster.schedules")


def from_torch_scheduler(scheduler: Any, group: int) -> sch.Schedule:
    """The PS schedule of parameter group `group` under a freshly built torch scheduler.

    Raises:
        InvalidArgumentError: a scheduler without a PS form (named, with the alternative), or one
            already stepped (the PS starts counting at the variable's first update).
    """
    if int(getattr(scheduler, "last_epoch", 0)) != 0:
        raise InvalidArgumentError(f"from_torch: {type(scheduler).__name__} was stepped {scheduler.last_epoch} times; "
                                   "pass a freshly built scheduler (the PS counts from the first update)")
    groups = scheduler.optimizer.param_groups
    base = float(groups[group].get("initial_lr", groups[group]["lr"]))
    return _one(scheduler, base, groups[group]).validate()
