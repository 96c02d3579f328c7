"""What a variable is and how it is updated: the specs both the client and the PS work from.

The client builds them when it creates a variable, the PS validates and stores them, and both
translate them to and from wire messages here, so neither side imports the other's internals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from pscluster.codec import BFLOAT16, dtype_name, wire_dtype
from pscluster.errors import InvalidArgumentError
from pscluster.optimizer_config import OptimizerConfig as OptimizerConfig
from pscluster.optimizer_config import optimizer_from_pb, optimizer_to_pb
from pscluster.proto import pscluster_pb2 as pb
from pscluster.tables import TableConfig

Key = tuple[str, int]  # (variable name, shard index)


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
        if dtype_name(wire_dtype(self.dtype)) == BFLOAT16:
            raise InvalidArgumentError(f"{self.variable}: a bfloat16 variable; keep float32 masters on the PS and push "
                                       "bfloat16 gradients (they are upcast before the optimizer)")
        self.optimizer.validate()
        if self.optimizer.clip_norm and self.num_shards > 1:
            # a shard sees only its part of the gradient: its norm is not the variable's
            raise InvalidArgumentError(
                f"{self.variable}: clip_norm on the PS needs the variable in one shard (it is split in "
                f"{self.num_shards}); use clip_value, or clip the global norm in the worker before the push")
        return self


def same_definition(existing: ShardSpec, spec: ShardSpec) -> bool:
    """Whether `spec` re-creates `existing`: equal but for the ordinal and the hyper-parameters a driver may
    change while training (learning rate, schedule, ...; the PS's current ones stay)."""
    return replace(existing, ordinal=spec.ordinal, optimizer=existing.optimizer.structure()) == \
        replace(spec, optimizer=spec.optimizer.structure())


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
