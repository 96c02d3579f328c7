"""Optimizer constructors for `create_variable(..., optimizer=...)` under Keras's names; the update runs on the PS.

    ps.Adam(learning_rate=ps.schedules.CosineDecay(1e-3, 10_000), weight_decay=1e-4, clipnorm=1.0)

Defaults and formulas are Keras's (keras.optimizers): Adam puts epsilon before the bias correction
(`epsilon_hat`), Adagrad and RMSprop add epsilon inside the square root, `weight_decay` is decoupled
(w -= lr * weight_decay * w, as Keras applies it), SGD's and RMSprop's momentum buffers hold the rate
(`lr_in_momentum`: Keras's form, which differs from torch's once the rate changes). `learning_rate` is a number or a schedule
(pscluster.schedules). `clipnorm`/`clipvalue` clip each variable's gradient on the PS (clipnorm needs
the variable in one shard). torch's and optax's spellings are in pscluster.torch and pscluster.jax.
"""

from __future__ import annotations

from pscluster.errors import InvalidArgumentError
from pscluster.optimizer_config import OptimizerConfig as OptimizerConfig  # re-exported for adapters
from pscluster.schedules import Schedule, as_schedule

Rate = float | Schedule


def _cfg(kind: str, learning_rate: Rate, weight_decay: float | None, clipnorm: float | None,
         clipvalue: float | None, **hp: float | bool) -> OptimizerConfig:
    lr, schedule = as_schedule(learning_rate)
    return OptimizerConfig(kind, lr, schedule=schedule, weight_decay=float(weight_decay or 0.0),
                           decoupled_weight_decay=True, clip_norm=float(clipnorm or 0.0),
                           clip_value=float(clipvalue or 0.0), **hp).validate()  # type: ignore[arg-type]


def SGD(learning_rate: Rate = 0.01, momentum: float = 0.0, nesterov: bool = False,
        weight_decay: float | None = None, clipnorm: float | None = None,
        clipvalue: float | None = None) -> OptimizerConfig:
    """keras.optimizers.SGD: w -= lr * g; with momentum m = momentum * m - lr * g, w += m (nesterov:
    w += momentum * m - lr * g), the rate inside the buffer as Keras keeps it."""
    if not momentum:
        if nesterov:
            raise InvalidArgumentError("SGD: nesterov needs momentum > 0")
        return _cfg("sgd", learning_rate, weight_decay, clipnorm, clipvalue)
    return _cfg("momentum", learning_rate, weight_decay, clipnorm, clipvalue, momentum=float(momentum),
                nesterov=nesterov, lr_in_momentum=True)


def Momentum(learning_rate: Rate = 0.01, momentum: float = 0.9, nesterov: bool = False,
             weight_decay: float | None = None, clipnorm: float | None = None,
             clipvalue: float | None = None) -> OptimizerConfig:
    """Momentum SGD (TF1's MomentumOptimizer, torch's SGD(momentum)): buf = mu * buf + g; w -= lr * buf
    (Keras's SGD(momentum=...) keeps the rate in the buffer instead)."""
    return _cfg("momentum", learning_rate, weight_decay, clipnorm, clipvalue, momentum=momentum, nesterov=nesterov)


def Adagrad(learning_rate: Rate = 0.001, initial_accumulator_value: float = 0.1, epsilon: float = 1e-7,
            weight_decay: float | None = None, clipnorm: float | None = None,
            clipvalue: float | None = None) -> OptimizerConfig:
    """keras.optimizers.Adagrad: w -= lr * g / sqrt(acc + epsilon)."""
    return _cfg("adagrad", learning_rate, weight_decay, clipnorm, clipvalue, epsilon=epsilon,
                initial_accumulator_value=initial_accumulator_value, eps_in_sqrt=True)


def Adam(learning_rate: Rate = 0.001, beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-7,
         amsgrad: bool = False, weight_decay: float | None = None, clipnorm: float | None = None,
         clipvalue: float | None = None) -> OptimizerConfig:
    """keras.optimizers.Adam (epsilon-hat form); the sparse variant is lazy (only touched rows' moments change)."""
    return _cfg("adam", learning_rate, weight_decay, clipnorm, clipvalue, beta1=beta1, beta2=beta2,
                epsilon=epsilon, amsgrad=amsgrad, epsilon_hat=True)


def AdamW(learning_rate: Rate = 0.001, weight_decay: float = 0.004, beta1: float = 0.9, beta2: float = 0.999,
          epsilon: float = 1e-7, amsgrad: bool = False, clipnorm: float | None = None,
          clipvalue: float | None = None) -> OptimizerConfig:
    """keras.optimizers.AdamW: Adam with decoupled weight decay w -= lr * weight_decay * w."""
    return Adam(learning_rate, beta1, beta2, epsilon, amsgrad, weight_decay, clipnorm, clipvalue)


def RMSprop(learning_rate: Rate = 0.001, rho: float = 0.9, momentum: float = 0.0, epsilon: float = 1e-7,
            centered: bool = False, weight_decay: float | None = None, clipnorm: float | None = None,
            clipvalue: float | None = None) -> OptimizerConfig:
    """keras.optimizers.RMSprop: w -= lr * g / sqrt(v + epsilon) (centered: v minus the mean gradient squared);
    with momentum m = momentum * m + lr * g / sqrt(...), w -= m (the rate inside the buffer, as Keras)."""
    return _cfg("rmsprop", learning_rate, weight_decay, clipnorm, clipvalue, rho=rho, momentum=momentum,
                epsilon=epsilon, centered=centered, eps_in_sqrt=True, lr_in_momentum=momentum > 0)


def Ftrl(learning_rate: Rate = 0.001, learning_rate_power: float = -0.5,
         initial_accumulator_value: float = 0.1, l1_regularization_strength: float = 0.0,
         l2_regularization_strength: float = 0.0, l2_shrinkage_regularization_strength: float = 0.0,
         beta: float = 0.0, clipnorm: float | None = None, clipvalue: float | None = None) -> OptimizerConfig:
    """keras.optimizers.Ftrl (FTRL-proximal, TF's ApplyFtrlV2), the standard for wide sparse models."""
    return _cfg("ftrl", learning_rate, None, clipnorm, clipvalue, learning_rate_power=learning_rate_power,
                initial_accumulator_value=initial_accumulator_value, l1=l1_regularization_strength,
                l2=l2_regularization_strength, l2_shrinkage=l2_shrinkage_regularization_strength, beta=beta)


def Lion(learning_rate: Rate = 0.001, beta1: float = 0.9, beta2: float = 0.99,
         weight_decay: float | None = None, clipnorm: float | None = None,
         clipvalue: float | None = None) -> OptimizerConfig:
    """keras.optimizers.Lion: w -= lr * sign(b1 * m + (1 - b1) * g); m = b2 * m + (1 - b2) * g."""
    return _cfg("lion", learning_rate, weight_decay, clipnorm, clipvalue, beta1=beta1, beta2=beta2)
