"""optax's optimizers and schedules under optax's names and defaults, run on the PS (re-exported by pscluster.jax).

    import pscluster.jax as ps_jax
    lr = ps_jax.warmup_cosine_decay_schedule(0.0, 1e-3, warmup_steps=500, decay_steps=10_000)
    model = ps_jax.PSParams(coord, params, ps_jax.adamw(lr, weight_decay=1e-4))

Formulas are optax's: adam and adamw put eps after the bias correction (sqrt(nu_hat) + eps), adagrad
and rmsprop (eps_in_sqrt=True) take sqrt(acc + eps), adamw and lion decay weights by lr * wd * w. A
schedule is evaluated at the variable's update count, as optax's at its `count`. rmsprop's momentum
trace holds lr * update (optax's order, `lr_in_momentum`), exact under a schedule too. Options optax has
and the PS does not (eps_root, masks, nesterov rmsprop) are refused by name. No jax import here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pscluster import schedules as sch
from pscluster.errors import InvalidArgumentError
from pscluster.optimizer_config import OptimizerConfig
from pscluster.schedules import Schedule, as_schedule

Rate = float | Schedule


def _cfg(kind: str, learning_rate: Rate, **hp: float | bool) -> OptimizerConfig:
    lr, schedule = as_schedule(learning_rate)
    return OptimizerConfig(kind, lr, schedule=schedule, **hp).validate()  # type: ignore[arg-type]


def _no(name: str, value: object, neutral: object, alternative: str) -> None:
    if value != neutral:
        raise InvalidArgumentError(f"{name}={value!r} is not supported on the PS; {alternative}")


def sgd(learning_rate: Rate, momentum: float | None = None, nesterov: bool = False) -> OptimizerConfig:
    """optax.sgd: trace t = g + momentum * t; w -= lr * t (or lr * (g + momentum * t) with nesterov)."""
    if momentum:
        return _cfg("momentum", learning_rate, momentum=float(momentum), nesterov=nesterov)
    _no("sgd(nesterov", nesterov, False, "nesterov needs momentum")
    return _cfg("sgd", learning_rate)


def adam(learning_rate: Rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0) -> OptimizerConfig:
    """optax.adam."""
    _no("adam(eps_root", eps_root, 0.0, "use eps")
    return _cfg("adam", learning_rate, beta1=b1, beta2=b2, epsilon=eps)


def adamw(learning_rate: Rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
          weight_decay: float = 1e-4) -> OptimizerConfig:
    """optax.adamw: adam's update plus weight_decay * w, scaled by the learning rate."""
    _no("adamw(eps_root", eps_root, 0.0, "use eps")
    return _cfg("adam", learning_rate, beta1=b1, beta2=b2, epsilon=eps, weight_decay=weight_decay,
                decoupled_weight_decay=True)


def adagrad(learning_rate: Rate, initial_accumulator_value: float = 0.1, eps: float = 1e-7) -> OptimizerConfig:
    """optax.adagrad: w -= lr * g / sqrt(acc + eps)."""
    return _cfg("adagrad", learning_rate, initial_accumulator_value=initial_accumulator_value, epsilon=eps,
                eps_in_sqrt=True)


def rmsprop(learning_rate: Rate, decay: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0,
            eps_in_sqrt: bool = True, centered: bool = False, momentum: float | None = None,
            nesterov: bool = False) -> OptimizerConfig:
    """optax.rmsprop."""
    _no("rmsprop(initial_scale", initial_scale, 0.0, "the PS starts nu at 0")
    _no("rmsprop(nesterov", nesterov, False, "use momentum without nesterov")
    return _cfg("rmsprop", learning_rate, rho=decay, epsilon=eps, eps_in_sqrt=eps_in_sqrt, centered=centered,
                momentum=float(momentum or 0.0), lr_in_momentum=bool(momentum))


def lion(learning_rate: Rate, b1: float = 0.9, b2: float = 0.99, weight_decay: float = 1e-3) -> OptimizerConfig:
    """optax.lion: w -= lr * (sign(b1 * m + (1 - b1) * g) + weight_decay * w)."""
    return _cfg("lion", learning_rate, beta1=b1, beta2=b2, weight_decay=weight_decay, decoupled_weight_decay=True)


# -- schedules -----------------------------------------------------------------------------------------------
def constant_schedule(value: float) -> Schedule:
    """optax.constant_schedule."""
    return sch.Constant(float(value)).validate()


def linear_schedule(init_value: float, end_value: float, transition_steps: int,
                    transition_begin: int = 0) -> Schedule:
    """optax.linear_schedule."""
    return sch.Linear(float(init_value), float(end_value), int(transition_steps), int(transition_begin)).validate()


def polynomial_schedule(init_value: float, end_value: float, power: float, transition_steps: int,
                        transition_begin: int = 0) -> Schedule:
    """optax.polynomial_schedule."""
    if transition_steps <= 0:
        return constant_schedule(init_value)
    return sch.Polynomial(float(init_value), float(end_value), int(transition_steps), float(power),
                          begin=int(transition_begin)).validate()


def exponential_decay(init_value: float, transition_steps: int, decay_rate: float, transition_begin: int = 0,
                      staircase: bool = False, end_value: float | None = None) -> Schedule:
    """optax.exponential_decay."""
    if transition_steps <= 0 or decay_rate == 0:
        return constant_schedule(init_value)
    return sch.Exponential(float(init_value), float(transition_steps), float(decay_rate), staircase,
                           int(transition_begin), None if end_value is None else float(end_value)).validate()


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0,
                          exponent: float = 1.0) -> Schedule:
    """optax.cosine_decay_schedule."""
    return sch.Cosine(float(init_value), int(decay_steps), float(init_value) * float(alpha),
                      float(exponent)).validate()


def piecewise_constant_schedule(init_value: float,
                                boundaries_and_scales: Mapping[int, float] | None = None) -> Schedule:
    """optax.piecewise_constant_schedule (the scale applies from the boundary step on)."""
    bounds = sorted((boundaries_and_scales or {}).items())
    values, v = [float(init_value)], float(init_value)
    for _, scale in bounds:
        v *= float(scale)
        values.append(v)
    return sch.Piecewise(tuple(int(b) for b, _ in bounds), tuple(values), right_closed=False).validate()


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """optax.join_schedules: schedules[i] from boundaries[i - 1] on, counting from there."""
    return sch.Sequence(tuple(schedules), tuple(int(b) for b in boundaries)).validate()


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int, decay_steps: int,
                                 end_value: float = 0.0, exponent: float = 1.0) -> Schedule:
    """optax.warmup_cosine_decay_schedule (decay_steps counts the warmup too)."""
    alpha = 0.0 if peak_value == 0 else end_value / peak_value
    return join_schedules([linear_schedule(init_value, peak_value, warmup_steps),
                           cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent)],
                          [warmup_steps])


def warmup_exponential_decay_schedule(init_value: float, peak_value: float, warmup_steps: int,
                                      transition_steps: int, decay_rate: float, transition_begin: int = 0,
                                      staircase: bool = False, end_value: float | None = None) -> Schedule:
    """optax.warmup_exponential_decay_schedule."""
    return join_schedules([linear_schedule(init_value, peak_value, warmup_steps),
                           exponential_decay(peak_value, transition_steps, decay_rate, transition_begin, staircase,
                                             end_value)], [warmup_steps])


def sgdr_schedule(cosine_kwargs: Sequence[Mapping[str, float]]) -> Schedule:
    """optax.sgdr_schedule: warmup-cosine cycles one after another."""
    parts, boundaries, total = [], [], 0
    for kwargs in cosine_kwargs:
        parts.append(warmup_cosine_decay_schedule(**kwargs))  # type: ignore[arg-type]
        total += int(kwargs["decay_steps"])
        boundaries.append(total)
    return join_schedules(parts, boundaries[:-1])
