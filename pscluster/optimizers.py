"""Optimizer constructors for `create_variable(..., optimizer=...)`; the update runs on the PS."""

from __future__ import annotations

from pscluster.specs import OptimizerConfig as OptimizerConfig  # re-exported for adapters


def SGD(learning_rate: float = 0.01) -> OptimizerConfig:
    """Plain SGD: w -= lr * g."""
    return OptimizerConfig("sgd", learning_rate).validate()


def Momentum(learning_rate: float = 0.01, momentum: float = 0.9, nesterov: bool = False) -> OptimizerConfig:
    """Momentum SGD (TF's MomentumOptimizer), optionally Nesterov."""
    return OptimizerConfig("momentum", learning_rate, momentum=momentum, nesterov=nesterov).validate()


def Adagrad(learning_rate: float = 0.001, initial_accumulator_value: float = 0.1,
            epsilon: float = 1e-7) -> OptimizerConfig:
    """Adagrad with Keras defaults."""
    return OptimizerConfig("adagrad", learning_rate, epsilon=epsilon,
                           initial_accumulator_value=initial_accumulator_value).validate()


def Adam(learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
         epsilon: float = 1e-7) -> OptimizerConfig:
    """Adam with Keras defaults; the sparse variant is lazy (only touched rows' moments change)."""
    return OptimizerConfig("adam", learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon).validate()
