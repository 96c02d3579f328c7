"""Translation between wire messages and the store's plain-Python types (used by servicer and client)."""

from __future__ import annotations

from dataclasses import asdict

from pscluster.proto import pscluster_pb2 as pb
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.store import ShardSpec


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
        optimizer=optimizer_to_pb(spec.optimizer), sparse=spec.sparse, ordinal=spec.ordinal)


def spec_from_pb(msg: pb.ShardSpec) -> ShardSpec:
    """Message -> validated ShardSpec."""
    return ShardSpec(
        variable=msg.variable, shard_index=msg.shard_index, num_shards=msg.num_shards,
        full_shape=tuple(msg.full_shape), shape=tuple(msg.shape), row_offset=msg.row_offset,
        dtype=msg.dtype, optimizer=optimizer_from_pb(msg.optimizer), sparse=msg.sparse,
        ordinal=msg.ordinal).validate()
