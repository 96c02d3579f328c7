"""Learning-rate schedules evaluated on the PS at every update, under Keras's names and arguments.

A schedule is a small frozen value (a tree of the shapes below) that travels in a variable's
optimizer config. The PS evaluates it at each update from the variable's update count: the update
numbered t (1-based, the count Adam's bias correction uses) gets the rate `schedule(t - 1)`, the
rate Keras reads at `optimizer.iterations == t - 1`, optax at `count == t - 1`, and torch after
`t - 1` calls of `scheduler.step()` (one after each `optimizer.step()`). Async, sync and bounded
modes therefore apply the rate of the update being applied, every shard agrees, and a restore into
any number of PS tasks continues the schedule (the count is checkpointed with the shard).

    lr = ps.schedules.CosineDecay(1e-3, decay_steps=10_000, warmup_target=3e-3, warmup_steps=500)
    w = coord.create_variable("w", shape=(784, 10), optimizer=ps.Adam(learning_rate=lr))

torch schedulers map through `pscluster.torch.from_torch(optimizer, scheduler)`, optax schedules
through `pscluster.jax` (`warmup_cosine_decay_schedule`, ...). Shapes: `Constant`, `Piecewise`,
`Exponential`, `InverseTime`, `Polynomial`, `Linear`, `Cosine`, `CosineRestarts` (Keras's),
`WarmRestarts` (torch's, in integer steps), `OneCycle` and `Cyclic` (torch's), `Sequence` (one after another).
"""

from __future__ import annotations

from pscluster.schedule_shapes import (
    Constant,
    Cosine,
    CosineRestarts,
    Cyclic,
    Exponential,
    InverseTime,
    Linear,
    OneCycle,
    Piecewise,
    Polynomial,
    Schedule,
    Sequence,
    WarmRestarts,
    schedule_from_dict,
    schedule_from_json,
    schedule_to_json,
)

__all__ = [
    "Constant",
    "Cosine",
    "CosineDecay",
    "CosineDecayRestarts",
    "CosineRestarts",
    "Cyclic",
    "Exponential",
    "ExponentialDecay",
    "InverseTime",
    "InverseTimeDecay",
    "Linear",
    "LinearWarmup",
    "OneCycle",
    "Piecewise",
    "PiecewiseConstantDecay",
    "Polynomial",
    "PolynomialDecay",
    "Schedule",
    "Sequence",
    "WarmRestarts",
    "as_schedule",
    "schedule_from_dict",
    "schedule_from_json",
    "schedule_to_json",
]


# -- Keras's names and arguments (keras.optimizers.schedules) -------------------------------------------------
def ExponentialDecay(initial_learning_rate: float, decay_steps: int, decay_rate: float,  # noqa: N802
                     staircase: bool = False) -> Schedule:
    """keras.optimizers.schedules.ExponentialDecay."""
    return Exponential(float(initial_learning_rate), float(decay_steps), float(decay_rate), staircase).validate()


def PiecewiseConstantDecay(boundaries: list[int], values: list[float]) -> Schedule:  # noqa: N802
    """keras.optimizers.schedules.PiecewiseConstantDecay (a boundary step keeps the earlier value)."""
    return Piecewise(tuple(int(b) for b in boundaries), tuple(float(v) for v in values), True).validate()


def PolynomialDecay(initial_learning_rate: float, decay_steps: int, end_learning_rate: float = 0.0001,  # noqa: N802
                    power: float = 1.0, cycle: bool = False) -> Schedule:
    """keras.optimizers.schedules.PolynomialDecay."""
    return Polynomial(float(initial_learning_rate), float(end_learning_rate), int(decay_steps), float(power),
                      cycle).validate()


def InverseTimeDecay(initial_learning_rate: float, decay_steps: float, decay_rate: float,  # noqa: N802
                     staircase: bool = False) -> Schedule:
    """keras.optimizers.schedules.InverseTimeDecay."""
    return InverseTime(float(initial_learning_rate), float(decay_steps), float(decay_rate), staircase).validate()


def CosineDecay(initial_learning_rate: float, decay_steps: int, alpha: float = 0.0,  # noqa: N802
                warmup_target: float | None = None, warmup_steps: int = 0) -> Schedule:
    """keras.optimizers.schedules.CosineDecay, with its optional linear warmup to warmup_target."""
    peak = float(initial_learning_rate if warmup_target is None else warmup_target)
    decay = Cosine(peak, int(decay_steps), peak * float(alpha)).validate()
    if warmup_target is None or warmup_steps <= 0:
        return decay
    return Sequence((Linear(float(initial_learning_rate), peak, int(warmup_steps)), decay),
                    (int(warmup_steps),)).validate()


def CosineDecayRestarts(initial_learning_rate: float, first_decay_steps: int, t_mul: float = 2.0,  # noqa: N802
                        m_mul: float = 1.0, alpha: float = 0.0) -> Schedule:
    """keras.optimizers.schedules.CosineDecayRestarts."""
    return CosineRestarts(float(initial_learning_rate), float(first_decay_steps), float(t_mul), float(m_mul),
                          float(alpha)).validate()


def LinearWarmup(schedule: Schedule | float, warmup_steps: int, initial_value: float = 0.0) -> Schedule:  # noqa: N802
    """Rise linearly from initial_value to schedule(0) over warmup_steps, then run `schedule` from its start."""
    after = Constant(float(schedule)) if not isinstance(schedule, Schedule) else schedule
    if warmup_steps <= 0:
        return after.validate()
    return Sequence((Linear(float(initial_value), after(0), int(warmup_steps)), after), (int(warmup_steps),)).validate()


def as_schedule(lr: Schedule | float) -> tuple[float, Schedule | None]:
    """(learning_rate, schedule) of an optimizer's `learning_rate` argument: a number or a schedule."""
    if isinstance(lr, Schedule):
        return float(lr(0)), lr.validate()
    return float(lr), None
