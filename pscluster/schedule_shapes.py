"""The shapes of a learning-rate schedule (frozen values), their evaluation and their wire form.

pscluster.schedules re-exports them beside Keras's constructors; see its docstring for when the PS
reads a schedule. Each shape is a pure function of the update count, so every shard and a restored
PS agree.
"""


from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from pscluster.errors import InvalidArgumentError


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgumentError(f"schedule: {name} must be finite and > 0, got {value}")


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise InvalidArgumentError(f"schedule: {name} must be finite, got {value}")


@dataclass(frozen=True)
class Schedule:
    """Base of every schedule: `schedule(count)` is the rate of the update after `count` updates."""

    kind: ClassVar[str] = ""

    def __call__(self, count: int) -> float:
        """The learning rate of the update that follows `count` applied updates."""
        raise NotImplementedError(type(self).__name__)

    def validate(self) -> Schedule:
        """Self, or InvalidArgumentError naming the bad argument."""
        return self

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (inverse of `schedule_from_dict`)."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "schedules":
                v = [s.to_dict() for s in v]
            elif isinstance(v, tuple):
                v = [list(x) if isinstance(x, tuple) else x for x in v]
            out[f.name] = v
        return out


@dataclass(frozen=True)
class Constant(Schedule):
    """The same rate at every update."""

    kind: ClassVar[str] = "constant"
    value: float

    def __call__(self, count: int) -> float:
        return self.value

    def validate(self) -> Schedule:
        _finite("value", self.value)
        return self


@dataclass(frozen=True)
class Piecewise(Schedule):
    """values[i] between boundaries; `right_closed`: a boundary step still has the earlier value (Keras)
    rather than the next one (torch's MultiStepLR, optax)."""

    kind: ClassVar[str] = "piecewise"
    boundaries: tuple[int, ...]
    values: tuple[float, ...]
    right_closed: bool = True

    def __call__(self, count: int) -> float:
        pick = bisect.bisect_left if self.right_closed else bisect.bisect_right
        return self.values[pick(self.boundaries, count)]

    def validate(self) -> Schedule:
        if len(self.values) != len(self.boundaries) + 1:
            raise InvalidArgumentError(f"schedule: piecewise needs one more value than boundaries, got "
                                       f"{len(self.values)} values for {len(self.boundaries)} boundaries")
        if list(self.boundaries) != sorted(self.boundaries):
            raise InvalidArgumentError(
                f"schedule: piecewise boundaries must be increasing, got {list(self.boundaries)}")
        for v in self.values:
            _finite("piecewise value", v)
        return self


@dataclass(frozen=True)
class Exponential(Schedule):
    """initial * rate ** ((count - begin) / decay_steps), floored exponent if staircase, clipped at end_value."""

    kind: ClassVar[str] = "exponential"
    initial: float
    decay_steps: float
    rate: float
    staircase: bool = False
    begin: int = 0
    end_value: float | None = None

    def __call__(self, count: int) -> float:
        c = count - self.begin
        if c <= 0:
            return self.initial
        p = c / self.decay_steps
        value = self.initial * self.rate ** (math.floor(p) if self.staircase else p)
        if self.end_value is not None:
            value = max(value, self.end_value) if self.rate < 1 else min(value, self.end_value)
        return value

    def validate(self) -> Schedule:
        _finite("initial_learning_rate", self.initial)
        _positive("decay_steps", self.decay_steps)
        _positive("decay_rate", self.rate)
        return self


@dataclass(frozen=True)
class InverseTime(Schedule):
    """initial / (1 + rate * count / decay_steps), floored quotient if staircase (Keras's InverseTimeDecay)."""

    kind: ClassVar[str] = "inverse_time"
    initial: float
    decay_steps: float
    rate: float
    staircase: bool = False

    def __call__(self, count: int) -> float:
        p = count / self.decay_steps
        return self.initial / (1 + self.rate * (math.floor(p) if self.staircase else p))

    def validate(self) -> Schedule:
        _finite("initial_learning_rate", self.initial)
        _positive("decay_steps", self.decay_steps)
        _finite("decay_rate", self.rate)
        return self


@dataclass(frozen=True)
class Polynomial(Schedule):
    """(initial - end) * (1 - c / decay_steps) ** power + end, c = count - begin clipped to
    [0, decay_steps]; with `cycle`, decay_steps grows to the next multiple of itself (Keras)."""

    kind: ClassVar[str] = "polynomial"
    initial: float
    end: float
    decay_steps: int
    power: float = 1.0
    cycle: bool = False
    begin: int = 0

    def __call__(self, count: int) -> float:
        c = max(count - self.begin, 0)
        steps = float(self.decay_steps)
        if self.cycle:
            steps *= 1.0 if c == 0 else math.ceil(c / steps)
        else:
            c = min(c, self.decay_steps)
        return float((self.initial - self.end) * (1 - c / steps) ** self.power + self.end)

    def validate(self) -> Schedule:
        _finite("initial_learning_rate", self.initial)
        _finite("end_learning_rate", self.end)
        _positive("decay_steps", self.decay_steps)
        _finite("power", self.power)
        return self


@dataclass(frozen=True)
class Linear(Schedule):
    """From initial to end over `steps` updates after `begin`, then end (warmup, torch's LinearLR)."""

    kind: ClassVar[str] = "linear"
    initial: float
    end: float
    steps: int
    begin: int = 0

    def __call__(self, count: int) -> float:
        if self.steps <= 0:
            return self.initial
        c = min(max(count - self.begin, 0), self.steps)
        return self.initial + (self.end - self.initial) * (c / self.steps)

    def validate(self) -> Schedule:
        _finite("initial", self.initial)
        _finite("end", self.end)
        return self


@dataclass(frozen=True)
class Cosine(Schedule):
    """end + (initial - end) * ((1 + cos(pi * c / decay_steps)) / 2) ** exponent with c = min(count,
    decay_steps) (Keras, optax), or c = count when `periodic` (torch's CosineAnnealingLR)."""

    kind: ClassVar[str] = "cosine"
    initial: float
    decay_steps: int
    end: float = 0.0
    exponent: float = 1.0
    periodic: bool = False

    def __call__(self, count: int) -> float:
        c = count if self.periodic else min(count, self.decay_steps)
        cos = 0.5 * (1 + math.cos(math.pi * c / self.decay_steps))
        return float(self.end + (self.initial - self.end) * cos ** self.exponent)

    def validate(self) -> Schedule:
        _finite("initial_learning_rate", self.initial)
        _positive("decay_steps", self.decay_steps)
        _finite("end", self.end)
        return self


@dataclass(frozen=True)
class CosineRestarts(Schedule):
    """Keras's CosineDecayRestarts (SGDR): periods grow by t_mul, peaks shrink by m_mul."""

    kind: ClassVar[str] = "cosine_restarts"
    initial: float
    first_decay_steps: float
    t_mul: float = 2.0
    m_mul: float = 1.0
    alpha: float = 0.0

    def __call__(self, count: int) -> float:
        fraction = count / self.first_decay_steps
        if self.t_mul == 1.0:
            restart = math.floor(fraction)
            fraction -= restart
        else:
            restart = math.floor(math.log(1 - fraction * (1 - self.t_mul)) / math.log(self.t_mul))
            done = (1 - self.t_mul ** restart) / (1 - self.t_mul)
            fraction = (fraction - done) / self.t_mul ** restart
        cos = 0.5 * self.m_mul ** restart * (1 + math.cos(math.pi * fraction))
        return self.initial * ((1 - self.alpha) * cos + self.alpha)

    def validate(self) -> Schedule:
        _finite("initial_learning_rate", self.initial)
        _positive("first_decay_steps", self.first_decay_steps)
        _positive("t_mul", self.t_mul)
        _finite("m_mul", self.m_mul)
        _finite("alpha", self.alpha)
        return self


@dataclass(frozen=True)
class WarmRestarts(Schedule):
    """torch's CosineAnnealingWarmRestarts in whole steps: periods T_0, T_0*T_mult, ... from base to eta_min."""

    kind: ClassVar[str] = "warm_restarts"
    base: float
    t_0: int
    t_mult: int = 1
    eta_min: float = 0.0

    def __call__(self, count: int) -> float:
        t_cur, t_i = count, self.t_0
        if self.t_mult == 1:
            t_cur %= t_i
        else:
            while t_cur >= t_i:  # at most log_{T_mult}(count) rounds: periods grow geometrically
                t_cur -= t_i
                t_i *= self.t_mult
        return self.eta_min + (self.base - self.eta_min) * (1 + math.cos(math.pi * t_cur / t_i)) / 2

    def validate(self) -> Schedule:
        if self.t_0 < 1 or self.t_mult < 1:
            raise InvalidArgumentError(f"schedule: T_0 and T_mult must be integers >= 1, got {self.t_0}, {self.t_mult}")
        _finite("base learning rate", self.base)
        _finite("eta_min", self.eta_min)
        return self


@dataclass(frozen=True)
class OneCycle(Schedule):
    """torch's OneCycleLR: phases (end_step, start_lr, end_lr) annealed by cosine or linearly."""

    kind: ClassVar[str] = "one_cycle"
    phases: tuple[tuple[float, float, float], ...]
    anneal: str = "cos"

    def __call__(self, count: int) -> float:
        start_step = 0.0
        for i, (end_step, lo, hi) in enumerate(self.phases):
            if count <= end_step or i == len(self.phases) - 1:
                pct = (count - start_step) / (end_step - start_step)
                if self.anneal == "cos":
                    return hi + (lo - hi) / 2.0 * (math.cos(math.pi * pct) + 1)
                return (hi - lo) * pct + lo
            start_step = end_step
        raise AssertionError("unreachable: the last phase always answers")

    def validate(self) -> Schedule:
        if not self.phases or self.anneal not in ("cos", "linear"):
            raise InvalidArgumentError(f"schedule: one_cycle needs phases and anneal 'cos' or 'linear', "
                                       f"got {len(self.phases)} phases, anneal={self.anneal!r}")
        return self


@dataclass(frozen=True)
class Cyclic(Schedule):
    """torch's CyclicLR: triangular cycles of total_size steps between low and high (mode 'triangular',
    'triangular2' or 'exp_range'); `inverse` runs high -> low -> high (its momentum, high - height)."""

    kind: ClassVar[str] = "cyclic"
    low: float
    high: float
    total_size: float
    step_ratio: float
    mode: str = "triangular"
    gamma: float = 1.0
    inverse: bool = False

    def __call__(self, count: int) -> float:
        cycle = math.floor(1 + count / self.total_size)
        x = 1.0 + count / self.total_size - cycle
        factor = x / self.step_ratio if x <= self.step_ratio else (x - 1) / (self.step_ratio - 1)
        scale = 1.0 if self.mode == "triangular" else 1 / (2.0 ** (cycle - 1)) if self.mode == "triangular2" \
            else self.gamma ** count
        if self.inverse:
            return self.high - (self.high - self.low) * factor * scale
        return self.low + (self.high - self.low) * factor * scale

    def validate(self) -> Schedule:
        if self.mode not in ("triangular", "triangular2", "exp_range") or not 0 < self.step_ratio < 1:
            raise InvalidArgumentError(f"schedule: cyclic needs mode triangular, triangular2 or exp_range and "
                                       f"0 < step_ratio < 1, got {self.mode!r}, {self.step_ratio}")
        _positive("total_size", self.total_size)
        for name in ("low", "high", "gamma"):
            _finite(name, getattr(self, name))
        return self


@dataclass(frozen=True)
class Sequence(Schedule):
    """schedules[i] from boundaries[i - 1] on, counting from there (optax's join_schedules, torch's SequentialLR)."""

    kind: ClassVar[str] = "sequence"
    schedules: tuple[Schedule, ...]
    boundaries: tuple[int, ...]

    def __call__(self, count: int) -> float:
        i = bisect.bisect_right(self.boundaries, count)
        return self.schedules[i](count - (self.boundaries[i - 1] if i else 0))

    def validate(self) -> Schedule:
        if len(self.schedules) != len(self.boundaries) + 1:
            raise InvalidArgumentError(f"schedule: a sequence of {len(self.schedules)} schedules needs "
                                       f"{len(self.schedules) - 1} boundaries, got {len(self.boundaries)}")
        if list(self.boundaries) != sorted(self.boundaries):
            raise InvalidArgumentError(f"schedule: sequence boundaries must be increasing, got {list(self.boundaries)}")
        for s in self.schedules:
            s.validate()
        return self


_KINDS: dict[str, type[Schedule]] = {c.kind: c for c in (
    Constant, Piecewise, Exponential, InverseTime, Polynomial, Linear, Cosine, CosineRestarts, WarmRestarts,
    OneCycle, Cyclic, Sequence)}


def schedule_from_dict(d: dict[str, Any]) -> Schedule:
    """A validated schedule from its `to_dict()` form; InvalidArgumentError on an unknown shape."""
    cls = _KINDS.get(str(d.get("kind")))
    if cls is None:
        raise InvalidArgumentError(f"unknown schedule kind {d.get('kind')!r}; known: {', '.join(sorted(_KINDS))}")
    unknown = sorted(set(d) - {"kind"} - {f.name for f in fields(cls)})
    if unknown:
        raise InvalidArgumentError(f"schedule {cls.kind}: unknown argument(s) {', '.join(unknown)}")
    args: dict[str, Any] = {}
    try:
        for f in fields(cls):
            if f.name not in d:
                continue
            v = d[f.name]
            if f.name == "schedules":
                v = tuple(schedule_from_dict(s) for s in v)
            elif isinstance(v, list):
                v = tuple(tuple(x) if isinstance(x, list) else x for x in v)
            args[f.name] = v
        return cls(**args).validate()
    except TypeError as exc:
        raise InvalidArgumentError(f"schedule {cls.kind}: {exc}") from exc


def schedule_to_json(s: Schedule | None) -> str:
    """Wire form of an optional schedule ("" for none)."""
    return "" if s is None else json.dumps(s.to_dict(), separators=(",", ":"))


def schedule_from_json(text: str) -> Schedule | None:
    """Inverse of `schedule_to_json`."""
    if not text:
        return None
    try:
        return schedule_from_dict(json.loads(text))
    except (ValueError, AttributeError) as exc:
        raise InvalidArgumentError(f"malformed schedule {text[:80]!r}: {exc}") from exc
