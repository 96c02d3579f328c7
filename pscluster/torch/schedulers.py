"""`torch.optim.lr_scheduler` instances as PS schedules (pscluster.schedules), one per parameter group.

The PS advances the rate once per update, as `scheduler.step()` after each `optimizer.step()`; each
scheduler maps to the closed form of the rate it produces after k steps; OneCycleLR and CyclicLR with
cycle_momentum also give the momentum (or Adam's beta1) schedule. What has no closed form the PS can
evaluate (a Python function, a metric) is refused with the alternative.
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
        return _one_cycle(s, group, "lr")
    if kind == "CyclicLR":
        return _cyclic(s, group, momentum=False)
    if kind == "SequentialLR":
        cycling = [type(sub).__name__ for sub in s._schedulers if getattr(sub, "cycle_momentum", False)]
        if cycling:
            raise InvalidArgumentError(f"from_torch: {cycling[0]}(cycle_momentum=True) inside SequentialLR: the PS "
                                       "schedules momentum from the top-level scheduler only; pass "
                                       "cycle_momentum=False, or use it alone")
        subs = tuple(_one(sub, base, group) for sub in s._schedulers)
        return sch.Sequence(subs, tuple(int(m) for m in s._milestones))
    if kind in _REFUSED:
        raise InvalidArgumentError(f"from_torch: {kind} cannot run on the PS: {_REFUSED[kind]}")
    raise InvalidArgumentError(f"from_torch: {kind} has no PS equivalent; use StepLR, MultiStepLR, ExponentialLR, "
                               "CosineAnnealingLR, CosineAnnealingWarmRestarts, LinearLR, ConstantLR, PolynomialLR, "
                               "OneCycleLR, CyclicLR or SequentialLR, or pscluster.schedules")


def _one_cycle(s: Any, group: dict[str, Any], what: str) -> sch.Schedule:
    """OneCycleLR's rate (what="lr") or momentum (what="momentum") of one group: the same phases and anneal."""
    phases = tuple((float(p["end_step"]), float(group[p[f"start_{what}"]]), float(group[p[f"end_{what}"]]))
                   for p in s._schedule_phases)
    return sch.OneCycle(phases, str(getattr(s, "_anneal_func_type", "cos")))


def _cyclic(s: Any, group: dict[str, Any], momentum: bool) -> sch.Schedule:
    """CyclicLR's rate, or its momentum (max_momentum - height: the cycle inverted), for one group."""
    if getattr(s, "_scale_fn_custom", None) is not None:
        raise InvalidArgumentError("from_torch: CyclicLR(scale_fn=...) cannot run on the PS: a Python function; use "
                                   "mode='triangular', 'triangular2' or 'exp_range', or pscluster.schedules shapes")
    i = next(k for k, g in enumerate(s.optimizer.param_groups) if g is group)
    low, high = (s.base_momentums[i], s.max_momentums[i]) if momentum else (s.base_lrs[i], s.max_lrs[i])
    return sch.Cyclic(float(low), float(high), float(s.total_size), float(s.step_ratio), str(s.mode),
                      float(s.gamma), inverse=momentum)


def from_torch_momentum(scheduler: Any, group: int) -> sch.Schedule | None:
    """The momentum (SGD, RMSprop) or beta1 (Adam, AdamW) schedule of a OneCycleLR or CyclicLR with
    cycle_momentum=True, for parameter group `group`; None when the scheduler leaves momentum alone."""
    if not getattr(scheduler, "cycle_momentum", False) or type(scheduler).__name__ not in ("OneCycleLR", "CyclicLR"):
        return None
    g = scheduler.optimizer.param_groups[group]
    if type(scheduler).__name__ == "OneCycleLR":
        return _one_cycle(scheduler, g, "momentum").validate()
    return _cyclic(scheduler, g, momentum=True).validate()


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
