"""What a variable is and how it is updated: the specs both the client and the PS work from.

The client builds them when it creates a variable, the PS validates and stores them, and both
translate them to and from wire messages here, so neither side imports the other's internals.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from pscluster.codec import wire_dtype
from pscluster.errors import InvalidArgumentError
from pscluster.proto import pscluster_pb2 as pb
from pscluster.tables import TableConfig

Key = tuple[str, int]  # (variable name, shard index)


@dataclass(frozen=True)
class OptimizerConfig:
    """Hyper-parameters of a PS-side optimizer (TF/Keras defaults)."""

    kind: str = "sgd"
    learning_rate: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-7
    initial_accumulator_value: float = 0.1

    def slot_names(self) -> tuple[str, ...]:
        """Names of the slot variables this optimizer keeps per shard."""
        return {"sgd": (), "momentum": ("momentum",), "adagrad": ("accumulator",),
                "adam": ("m", "v")}[self.kind]

    def validate(self) -> OptimizerConfig:
        """Self, or InvalidArgumentError naming the bad hyper-parameter."""
        if self.kind not in ("sgd", "momentum", "adagrad", "adam"):
            raise InvalidArgumentError(f"unknown optimizer {self.kind!r}; use sgd, momentum, adagrad or adam")
        if not (math.isfinite(self.learning_rate) and self.learning_rate >= 0):
            raise InvalidArgumentError(f"learning_rate must be finite and >= 0, got {self.learning_rate}")
        if not 0 <= self.momentum < 1 + 1e-12 or not 0 <= self.beta1 < 1 or not 0 <= self.beta2 < 1:
            raise InvalidArgumentError("momentum must be in [0, 1]; beta1 and beta2 in [0, 1)")
        if self.epsilon < 0 or self.initial_accumulator_value < 0:
            raise InvalidArgumentError("epsilon and initial_accumulator_value must be >= 0")
        return self


@dataclass(frozen=True)
class ShardSpec:
    """One shard of a variable: where it sits in the full variable and how it is updated."""

    variable: str
    shard_index: int
    num_shards: int
    full_shape: tuple[int, ...]
    shape: tuple[int, ...]
    row_offset: int
    dtype: str
    optimizer: OptimizerConfig
    sparse: bool = False
    ordinal: int = 0
    table: str = ""  # a dynamic table's TableConfig as JSON (pscluster/tables.py); "" for a fixed range

    @property
    def key(self) -> Key:
        """(variable, shard_index)."""
        return (self.variable, self.shard_index)

    @property
    def nbytes(self) -> int:
        """Size of the shard's value in bytes."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def validate(self) -> ShardSpec:
        """Self, or InvalidArgumentError naming the inconsistency."""
        if not self.variable or len(self.variable) > 256 or "\0" in self.variable:
            raise InvalidArgumentError(f"variable name {self.variable!r} must be 1..256 characters without NUL")
        if not 0 <= self.shard_index < self.num_shards:
            raise InvalidArgumentError(
                f"{self.variable}: shard_index {self.shard_index} not in [0, {self.num_shards})")
        if any(d < 0 for d in self.full_shape) or any(d < 0 for d in self.shape):
            raise InvalidArgumentError(f"{self.variable}: negative dimension in {self.full_shape}")
        if self.num_shards > 1 or self.shape != self.full_shape:
            if not self.full_shape or self.shape[1:] != self.full_shape[1:] or \
                    self.row_offset + self.shape[0] > self.full_shape[0] or self.row_offset < 0:
                raise InvalidArgumentError(
                    f"{self.variable}: shard {self.shard_index} shape {self.shape} at row {self.row_offset} "
                    f"does not fit full shape {self.full_shape}")
        if self.sparse and len(self.shape) < 1:
            raise InvalidArgumentError(f"{self.variable}: a sparse table needs at least one dimension")
        if self.table:
            cfg = TableConfig.from_json(self.table)
            if not self.sparse or self.shape != (0, cfg.dim) or self.full_shape != (0, cfg.dim) or \
                    np.dtype(self.dtype) != np.dtype(cfg.dtype):
                raise InvalidArgumentError(
                    f"{self.variable}: a dynamic table's shard is sparse with shape (0, {cfg.dim}) and dtype "
                    f"{cfg.dtype}; got sparse={self.sparse} {self.dtype}{list(self.shape)}")
        wire_dtype(self.dtype)
        self.optimizer.validate()
        return self


def optimizer_to_pb(cfg: OptimizerConfig) -> pb.OptimizerSpec:
    """OptimizerConfig -> OptimizerSpec message."""
    return pb.OptimizerSpec(**asdict(cfg))


def optimizer_from_pb(msg: pb.OptimizerSpec) -> OptimizerConfig:
    """OptimizerSpec message -> validated OptimizerConfig (empty kind means sgd)."""
    return OptimizerConfig(
        kind=msg.kind or "sgd", learning_rate=msg.learning_rate, momentum=msg.momentum,
        nesterov=msg.nesterov, beta1=msg.beta1, beta2=msg.beta2, epsilon=msg.epsilon,
        initial_accumulator_value=msg.initial_accumulator_value).validate()


def spec_to_pb(spec: ShardSpec) -> pb.ShardSpec:
    """ShardSpec -> message."""
    return pb.ShardSpec(
        variable=spec.variable, shard_index=spec.shard_index, num_shards=spec.num_shards,
        full_shape=spec.full_shape, shape=spec.shape, row_offset=spec.row_offset, dtype=spec.dtype,
        optimizer=optimizer_to_pb(spec.optimizer), sparse=spec.sparse, ordinal=spec.ordinal, table=spec.table)


def spec_from_pb(msg: pb.ShardSpec) -> ShardSpec:
    """Message -> validated ShardSpec."""
    return ShardSpec(
        variable=msg.variable, shard_index=msg.shard_index, num_shards=msg.num_shards,
        full_shape=tuple(msg.full_shape), shape=tuple(msg.shape), row_offset=msg.row_offset,
        dtype=msg.dtype, optimizer=optimizer_from_pb(msg.optimizer), sparse=msg.sparse,
        ordinal=msg.ordinal, table=msg.table).validate()
