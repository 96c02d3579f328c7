from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("kind", "learning_rate", "momentum", "nesterov", "beta1", "beta2", "epsilon", "initial_accumulator_value")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_VALUE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    learning_rate: float
    momentum: float
    nesterov: bool
    beta1: float
    beta2: float
    epsilon: float
    initial_accumulator_value: float
    def __init__(self, kind: _Optional[str] = ..., learning_rate: _Optional[float] = ..., momentum: _Optional[float] = ..., nesterov: _Optional[bool] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., epsilon: _Optional[float] = ..., initial_accumulator_value: _Optional[float] = ...) -> None: ...

class Initializer(_message.Message):
    __slots__ = ("kind", "value", "seed")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    kind: str
    value: float
    seed: int
    def __init__(self, kind: _Optional[str] = ..., value: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class ShardSpec(_message.Message):
    __slots__ = ("variable", "shard_index", "num_shards", "full_shape", "shape", "row_offset", "dtype", "optimizer", "sparse", "ordinal")
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    FULL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    variable: str
    shard_index: int
    num_shards: int
    full_shape: _containers.RepeatedScalarFieldContainer[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    row_offset: int
    dtype: str
    optimizer: OptimizerSpec
    sparse: bool
    ordinal: int
    def __init__(self, variable: _Optional[str] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., full_shape: _Optional[_Iterable[int]] = ..., shape: _Optional[_Iterable[int]] = ..., row_offset: _Optional[int] = ..., dtype: _Optional[str] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., sparse: _Optional[bool] = ..., ordinal: _Optional[int] = ...) -> None: ...

class ShardRef(_message.Message):
    __slots__ = ("variable", "shard_index")
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    variable: str
    shard_index: int
    def __init__(self, variable: _Optional[str] = ..., shard_index: _Optional[int] = ...) -> None: ...

class CreateShardRequest(_message.Message):
    __slots__ = ("spec", "initial_value", "initializer")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    INITIAL_VALUE_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    spec: ShardSpec
    initial_value: Tensor
    initializer: Initializer
    def __init__(self, spec: _Optional[_Union[ShardSpec, _Mapping]] = ..., initial_value: _Optional[_Union[Tensor, _Mapping]] = ..., initializer: _Optional[_Union[Initializer, _Mapping]] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("spec", "version", "ps_index", "restored_version")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PS_INDEX_FIELD_NUMBER: _ClassVar[int]
    RESTORED_VERSION_FIELD_NUMBER: _ClassVar[int]
    spec: ShardSpec
    version: int
    ps_index: int
    restored_version: int
    def __init__(self, spec: _Optional[_Union[ShardSpec, _Mapping]] = ..., version: _Optional[int] = ..., ps_index: _Optional[int] = ..., restored_version: _Optional[int] = ...) -> None: ...

class ListShardsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListShardsReply(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ...) -> None: ...

class PullItem(_message.Message):
    __slots__ = ("ref", "ids")
    REF_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ref: ShardRef
    ids: Tensor
    def __init__(self, ref: _Optional[_Union[ShardRef, _Mapping]] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PullItem]
    def __init__(self, items: _Optional[_Iterable[_Union[PullItem, _Mapping]]] = ...) -> None: ...

class PullReply(_message.Message):
    __slots__ = ("tensors", "versions")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., versions: _Optional[_Iterable[int]] = ...) -> None: ...

class PushItem(_message.Message):
    __slots__ = ("ref", "grad", "ids")
    REF_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ref: ShardRef
    grad: Tensor
    ids: Tensor
    def __init__(self, ref: _Optional[_Union[ShardRef, _Mapping]] = ..., grad: _Optional[_Union[Tensor, _Mapping]] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("items", "push_id", "step", "final_below")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FINAL_BELOW_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PushItem]
    push_id: str
    step: int
    final_below: int
    def __init__(self, items: _Optional[_Iterable[_Union[PushItem, _Mapping]]] = ..., push_id: _Optional[str] = ..., step: _Optional[int] = ..., final_below: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("versions", "applied", "incarnation")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    applied: _containers.RepeatedScalarFieldContainer[bool]
    incarnation: int
    def __init__(self, versions: _Optional[_Iterable[int]] = ..., applied: _Optional[_Iterable[bool]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class PullChunk(_message.Message):
    __slots__ = ("header", "version", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: Tensor
    version: int
    data: bytes
    def __init__(self, header: _Optional[_Union[Tensor, _Mapping]] = ..., version: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushRequest
    data: bytes
    def __init__(self, header: _Optional[_Union[PushRequest, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class SaveReply(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class PsStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PsStatus(_message.Message):
    __slots__ = ("ps_index", "num_ps", "global_step", "restored_step", "num_shards", "total_bytes", "dropped_stale", "incarnation", "bulk_port")
    PS_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_PS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORED_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    ps_index: int
    num_ps: int
    global_step: int
    restored_step: int
    num_shards: int
    total_bytes: int
    dropped_stale: int
    incarnation: int
    bulk_port: int
    def __init__(self, ps_index: _Optional[int] = ..., num_ps: _Optional[int] = ..., global_step: _Optional[int] = ..., restored_step: _Optional[int] = ..., num_shards: _Optional[int] = ..., total_bytes: _Optional[int] = ..., dropped_stale: _Optional[int] = ..., incarnation: _Optional[int] = ..., bulk_port: _Optional[int] = ...) -> None: ...

class BulkRequest(_message.Message):
    __slots__ = ("token", "pull", "push", "closure", "take_token", "step_done")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    CLOSURE_FIELD_NUMBER: _ClassVar[int]
    TAKE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STEP_DONE_FIELD_NUMBER: _ClassVar[int]
    token: str
    pull: PullRequest
    push: PushRequest
    closure: RunClosureRequest
    take_token: TokenRequest
    step_done: StepDoneRequest
    def __init__(self, token: _Optional[str] = ..., pull: _Optional[_Union[PullRequest, _Mapping]] = ..., push: _Optional[_Union[PushRequest, _Mapping]] = ..., closure: _Optional[_Union[RunClosureRequest, _Mapping]] = ..., take_token: _Optional[_Union[TokenRequest, _Mapping]] = ..., step_done: _Optional[_Union[StepDoneRequest, _Mapping]] = ...) -> None: ...

class BulkReply(_message.Message):
    __slots__ = ("code", "message", "pull", "push", "closure", "token", "step")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    CLOSURE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    pull: PullReply
    push: PushReply
    closure: RunClosureReply
    token: TokenReply
    step: StepReply
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., pull: _Optional[_Union[PullReply, _Mapping]] = ..., push: _Optional[_Union[PushReply, _Mapping]] = ..., closure: _Optional[_Union[RunClosureReply, _Mapping]] = ..., token: _Optional[_Union[TokenReply, _Mapping]] = ..., step: _Optional[_Union[StepReply, _Mapping]] = ...) -> None: ...

class SyncConfigRequest(_message.Message):
    __slots__ = ("mode", "replicas_to_aggregate", "total_num_replicas", "staleness")
    MODE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_TO_AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    replicas_to_aggregate: int
    total_num_replicas: int
    staleness: int
    def __init__(self, mode: _Optional[str] = ..., replicas_to_aggregate: _Optional[int] = ..., total_num_replicas: _Optional[int] = ..., staleness: _Optional[int] = ...) -> None: ...

class SyncConfigReply(_message.Message):
    __slots__ = ("global_step",)
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    def __init__(self, global_step: _Optional[int] = ...) -> None: ...

class TokenRequest(_message.Message):
    __slots__ = ("closure_id", "worker", "timeout_s")
    CLOSURE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    closure_id: int
    worker: str
    timeout_s: float
    def __init__(self, closure_id: _Optional[int] = ..., worker: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class TokenReply(_message.Message):
    __slots__ = ("step", "replica")
    STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    step: int
    replica: int
    def __init__(self, step: _Optional[int] = ..., replica: _Optional[int] = ...) -> None: ...

class StepDoneRequest(_message.Message):
    __slots__ = ("closure_id", "step", "worker")
    CLOSURE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    closure_id: int
    step: int
    worker: str
    def __init__(self, closure_id: _Optional[int] = ..., step: _Optional[int] = ..., worker: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("global_step", "dropped_stale", "mode", "max_spread", "clocks")
    class ClocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_SPREAD_FIELD_NUMBER: _ClassVar[int]
    CLOCKS_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    dropped_stale: int
    mode: str
    max_spread: int
    clocks: _containers.ScalarMap[str, int]
    def __init__(self, global_step: _Optional[int] = ..., dropped_stale: _Optional[int] = ..., mode: _Optional[str] = ..., max_spread: _Optional[int] = ..., clocks: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ClosurePayload(_message.Message):
    __slots__ = ("digest", "function", "arguments")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    digest: str
    function: bytes
    arguments: bytes
    def __init__(self, digest: _Optional[str] = ..., function: _Optional[bytes] = ..., arguments: _Optional[bytes] = ...) -> None: ...

class RunClosureRequest(_message.Message):
    __slots__ = ("closure_id", "attempt", "payload", "sync_mode", "worker_index", "final_below")
    CLOSURE_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SYNC_MODE_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    FINAL_BELOW_FIELD_NUMBER: _ClassVar[int]
    closure_id: int
    attempt: int
    payload: bytes
    sync_mode: str
    worker_index: int
    final_below: int
    def __init__(self, closure_id: _Optional[int] = ..., attempt: _Optional[int] = ..., payload: _Optional[bytes] = ..., sync_mode: _Optional[str] = ..., worker_index: _Optional[int] = ..., final_below: _Optional[int] = ...) -> None: ...

class UserError(_message.Message):
    __slots__ = ("type_name", "message", "traceback", "pickled")
    TYPE_NAME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    PICKLED_FIELD_NUMBER: _ClassVar[int]
    type_name: str
    message: str
    traceback: str
    pickled: bytes
    def __init__(self, type_name: _Optional[str] = ..., message: _Optional[str] = ..., traceback: _Optional[str] = ..., pickled: _Optional[bytes] = ...) -> None: ...

class ShardVersion(_message.Message):
    __slots__ = ("variable", "shard_index", "version", "incarnation")
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    variable: str
    shard_index: int
    version: int
    incarnation: int
    def __init__(self, variable: _Optional[str] = ..., shard_index: _Optional[int] = ..., version: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class RunClosureReply(_message.Message):
    __slots__ = ("result", "error", "retryable", "seconds", "versions", "scalars")
    class ScalarsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SCALARS_FIELD_NUMBER: _ClassVar[int]
    result: bytes
    error: UserError
    retryable: bool
    seconds: float
    versions: _containers.RepeatedCompositeFieldContainer[ShardVersion]
    scalars: _containers.ScalarMap[str, float]
    def __init__(self, result: _Optional[bytes] = ..., error: _Optional[_Union[UserError, _Mapping]] = ..., retryable: _Optional[bool] = ..., seconds: _Optional[float] = ..., versions: _Optional[_Iterable[_Union[ShardVersion, _Mapping]]] = ..., scalars: _Optional[_Mapping[str, float]] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingReply(_message.Message):
    __slots__ = ("worker_id", "closures_run")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOSURES_RUN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    closures_run: int
    def __init__(self, worker_id: _Optional[str] = ..., closures_run: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "address", "closure_port")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CLOSURE_PORT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    closure_port: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., closure_port: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("worker_index", "heartbeat_interval_s")
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    worker_index: int
    heartbeat_interval_s: float
    def __init__(self, worker_index: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "leaving")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    leaving: bool
    def __init__(self, worker_id: _Optional[str] = ..., leaving: _Optional[bool] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class ScheduleRequest(_message.Message):
    __slots__ = ("payload", "job")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    job: str
    def __init__(self, payload: _Optional[bytes] = ..., job: _Optional[str] = ...) -> None: ...

class ScheduleReply(_message.Message):
    __slots__ = ("closure_id",)
    CLOSURE_ID_FIELD_NUMBER: _ClassVar[int]
    closure_id: int
    def __init__(self, closure_id: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("closure_id", "timeout_s")
    CLOSURE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    closure_id: int
    timeout_s: float
    def __init__(self, closure_id: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class FetchReply(_message.Message):
    __slots__ = ("done", "reply")
    DONE_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    done: bool
    reply: RunClosureReply
    def __init__(self, done: _Optional[bool] = ..., reply: _Optional[_Union[RunClosureReply, _Mapping]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("timeout_s", "job", "keep_error")
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    KEEP_ERROR_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    job: str
    keep_error: bool
    def __init__(self, timeout_s: _Optional[float] = ..., job: _Optional[str] = ..., keep_error: _Optional[bool] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("done", "closure_id_of_error", "error")
    DONE_FIELD_NUMBER: _ClassVar[int]
    CLOSURE_ID_OF_ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    done: bool
    closure_id_of_error: int
    error: UserError
    def __init__(self, done: _Optional[bool] = ..., closure_id_of_error: _Optional[int] = ..., error: _Optional[_Union[UserError, _Mapping]] = ...) -> None: ...

class JobRequest(_message.Message):
    __slots__ = ("job", "reason")
    JOB_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job: str
    reason: str
    def __init__(self, job: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class JobReply(_message.Message):
    __slots__ = ("job", "known", "keepalive_interval_s")
    JOB_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    job: str
    known: bool
    keepalive_interval_s: float
    def __init__(self, job: _Optional[str] = ..., known: _Optional[bool] = ..., keepalive_interval_s: _Optional[float] = ...) -> None: ...

class CoordinatorSyncRequest(_message.Message):
    __slots__ = ("job", "config")
    JOB_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    job: str
    config: SyncConfigRequest
    def __init__(self, job: _Optional[str] = ..., config: _Optional[_Union[SyncConfigRequest, _Mapping]] = ...) -> None: ...

class CoordinatorCheckpointRequest(_message.Message):
    __slots__ = ("job", "has_step", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    HAS_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    has_step: bool
    step: int
    def __init__(self, job: _Optional[str] = ..., has_step: _Optional[bool] = ..., step: _Optional[int] = ...) -> None: ...

class CoordinatorCheckpointReply(_message.Message):
    __slots__ = ("paths",)
    PATHS_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, paths: _Optional[_Iterable[str]] = ...) -> None: ...

class JobState(_message.Message):
    __slots__ = ("job", "queued", "running", "done", "failed", "idle_s", "ended")
    JOB_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    job: str
    queued: int
    running: int
    done: int
    failed: int
    idle_s: float
    ended: str
    def __init__(self, job: _Optional[str] = ..., queued: _Optional[int] = ..., running: _Optional[int] = ..., done: _Optional[int] = ..., failed: _Optional[int] = ..., idle_s: _Optional[float] = ..., ended: _Optional[str] = ...) -> None: ...

class CoordinatorStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerState(_message.Message):
    __slots__ = ("worker_id", "address", "state", "closures_done", "steps_per_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CLOSURES_DONE_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    state: str
    closures_done: int
    steps_per_s: float
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., closures_done: _Optional[int] = ..., steps_per_s: _Optional[float] = ...) -> None: ...

class CoordinatorStatus(_message.Message):
    __slots__ = ("queued", "running", "done", "retried", "failed", "workers", "lost_updates", "global_step", "sync_mode", "jobs")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    RETRIED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LOST_UPDATES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    SYNC_MODE_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    queued: int
    running: int
    done: int
    retried: int
    failed: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerState]
    lost_updates: int
    global_step: int
    sync_mode: str
    jobs: _containers.RepeatedCompositeFieldContainer[JobState]
    def __init__(self, queued: _Optional[int] = ..., running: _Optional[int] = ..., done: _Optional[int] = ..., retried: _Optional[int] = ..., failed: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerState, _Mapping]]] = ..., lost_updates: _Optional[int] = ..., global_step: _Optional[int] = ..., sync_mode: _Optional[str] = ..., jobs: _Optional[_Iterable[_Union[JobState, _Mapping]]] = ...) -> None: ...
