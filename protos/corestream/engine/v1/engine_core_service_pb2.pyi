from corestream.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionRequest(_message.Message):
    __slots__ = ("hello", "add", "abort", "utility")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    UTILITY_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    add: AddRequest
    abort: AbortRequests
    utility: UtilityCall
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., add: _Optional[_Union[AddRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequests, _Mapping]] = ..., utility: _Optional[_Union[UtilityCall, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("frontend_id", "protocol_version", "kv_cache_events", "iteration_details")
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_DETAILS_FIELD_NUMBER: _ClassVar[int]
    frontend_id: str
    protocol_version: int
    kv_cache_events: bool
    iteration_details: bool
    def __init__(self, frontend_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., kv_cache_events: _Optional[bool] = ..., iteration_details: _Optional[bool] = ...) -> None: ...

class AddRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "arrival_time", "priority", "cache_salt", "trace_headers", "eos_token_ids", "pooling")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    arrival_time: float
    priority: int
    cache_salt: str
    trace_headers: _containers.ScalarMap[str, str]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    pooling: PoolingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., arrival_time: _Optional[float] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., trace_headers: _Optional[_Mapping[str, str]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., pooling: _Optional[_Union[PoolingParams, _Mapping]] = ...) -> None: ...

class PoolingParams(_message.Message):
    __slots__ = ("task", "pooling_type", "normalize", "dimensions", "activation")
    class Task(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TASK_UNSPECIFIED: _ClassVar[PoolingParams.Task]
        TASK_EMBED: _ClassVar[PoolingParams.Task]
        TASK_CLASSIFY: _ClassVar[PoolingParams.Task]
    TASK_UNSPECIFIED: PoolingParams.Task
    TASK_EMBED: PoolingParams.Task
    TASK_CLASSIFY: PoolingParams.Task
    class PoolingType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        POOLING_TYPE_UNSPECIFIED: _ClassVar[PoolingParams.PoolingType]
        POOLING_TYPE_LAST: _ClassVar[PoolingParams.PoolingType]
        POOLING_TYPE_MEAN: _ClassVar[PoolingParams.PoolingType]
        POOLING_TYPE_CLS: _ClassVar[PoolingParams.PoolingType]
        POOLING_TYPE_ALL: _ClassVar[PoolingParams.PoolingType]
    POOLING_TYPE_UNSPECIFIED: PoolingParams.PoolingType
    POOLING_TYPE_LAST: PoolingParams.PoolingType
    POOLING_TYPE_MEAN: PoolingParams.PoolingType
    POOLING_TYPE_CLS: PoolingParams.PoolingType
    POOLING_TYPE_ALL: PoolingParams.PoolingType
    TASK_FIELD_NUMBER: _ClassVar[int]
    POOLING_TYPE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    task: PoolingParams.Task
    pooling_type: PoolingParams.PoolingType
    normalize: bool
    dimensions: int
    activation: bool
    def __init__(self, task: _Optional[_Union[PoolingParams.Task, str]] = ..., pooling_type: _Optional[_Union[PoolingParams.PoolingType, str]] = ..., normalize: _Optional[bool] = ..., dimensions: _Optional[int] = ..., activation: _Optional[bool] = ...) -> None: ...

class AbortRequests(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class UtilityCall(_message.Message):
    __slots__ = ("call_id", "method", "args_json")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    method: str
    args_json: str
    def __init__(self, call_id: _Optional[int] = ..., method: _Optional[str] = ..., args_json: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("engine_index", "outputs", "scheduler_stats", "timestamp", "utility_result", "engine_state", "kv_cache_snapshot", "kv_cache_events", "weight_version", "iteration_details")
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_STATS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    UTILITY_RESULT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STATE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ITERATION_DETAILS_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    outputs: _containers.RepeatedCompositeFieldContainer[RequestOutput]
    scheduler_stats: SchedulerStats
    timestamp: float
    utility_result: UtilityResult
    engine_state: _common_pb2.EngineState
    kv_cache_snapshot: KvCacheSnapshot
    kv_cache_events: _containers.RepeatedCompositeFieldContainer[KvCacheEvent]
    weight_version: str
    iteration_details: IterationDetails
    def __init__(self, engine_index: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[RequestOutput, _Mapping]]] = ..., scheduler_stats: _Optional[_Union[SchedulerStats, _Mapping]] = ..., timestamp: _Optional[float] = ..., utility_result: _Optional[_Union[UtilityResult, _Mapping]] = ..., engine_state: _Optional[_Union[_common_pb2.EngineState, str]] = ..., kv_cache_snapshot: _Optional[_Union[KvCacheSnapshot, _Mapping]] = ..., kv_cache_events: _Optional[_Iterable[_Union[KvCacheEvent, _Mapping]]] = ..., weight_version: _Optional[str] = ..., iteration_details: _Optional[_Union[IterationDetails, _Mapping]] = ...) -> None: ...

class IterationDetails(_message.Message):
    __slots__ = ("step", "started_at", "num_requests", "num_tokens", "num_prefill_requests", "num_prefill_tokens", "num_decode_requests", "schedule_seconds", "forward_seconds", "sample_seconds", "update_seconds", "wave", "wave_step")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAVE_FIELD_NUMBER: _ClassVar[int]
    WAVE_STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    started_at: float
    num_requests: int
    num_tokens: int
    num_prefill_requests: int
    num_prefill_tokens: int
    num_decode_requests: int
    schedule_seconds: float
    forward_seconds: float
    sample_seconds: float
    update_seconds: float
    wave: int
    wave_step: int
    def __init__(self, step: _Optional[int] = ..., started_at: _Optional[float] = ..., num_requests: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_prefill_requests: _Optional[int] = ..., num_prefill_tokens: _Optional[int] = ..., num_decode_requests: _Optional[int] = ..., schedule_seconds: _Optional[float] = ..., forward_seconds: _Optional[float] = ..., sample_seconds: _Optional[float] = ..., update_seconds: _Optional[float] = ..., wave: _Optional[int] = ..., wave_step: _Optional[int] = ...) -> None: ...

class KvCacheSnapshot(_message.Message):
    __slots__ = ("epoch", "seq", "block_size", "block_hashes")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    seq: int
    block_size: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, epoch: _Optional[str] = ..., seq: _Optional[int] = ..., block_size: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KvCacheEvent(_message.Message):
    __slots__ = ("seq", "stored", "removed", "cleared")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stored: BlockStored
    removed: BlockRemoved
    cleared: CacheCleared
    def __init__(self, seq: _Optional[int] = ..., stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[CacheCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hash", "parent_hash", "token_ids")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    parent_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hash",)
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    def __init__(self, block_hash: _Optional[bytes] = ...) -> None: ...

class CacheCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequestOutput(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "finish_reason", "stop_token_id", "num_cached_tokens", "error_code", "error_message", "new_logprobs", "prompt_logprobs", "weight_version", "pooled", "pooled_shape")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NEW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    POOLED_SHAPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    num_cached_tokens: int
    error_code: int
    error_message: str
    new_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PositionLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PositionLogprobs]
    weight_version: str
    pooled: bytes
    pooled_shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., new_logprobs: _Optional[_Iterable[_Union[_common_pb2.PositionLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.PositionLogprobs, _Mapping]]] = ..., weight_version: _Optional[str] = ..., pooled: _Optional[bytes] = ..., pooled_shape: _Optional[_Iterable[int]] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_cache_usage", "step_counter", "prefix_cache_queries", "prefix_cache_hits")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_COUNTER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    step_counter: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., step_counter: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ...) -> None: ...

class UtilityResult(_message.Message):
    __slots__ = ("call_id", "result_json", "failure_message")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    FAILURE_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    result_json: str
    failure_message: str
    def __init__(self, call_id: _Optional[int] = ..., result_json: _Optional[str] = ..., failure_message: _Optional[str] = ...) -> None: ...

class GetEngineInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetEngineInfoResponse(_message.Message):
    __slots__ = ("engine_index", "model", "max_model_len", "vocab_size", "num_kv_blocks", "block_size", "dtype", "device", "state", "tensor_parallel_size", "weight_version", "sleep_level", "tasks")
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    model: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    dtype: str
    device: str
    state: _common_pb2.EngineState
    tensor_parallel_size: int
    weight_version: str
    sleep_level: int
    tasks: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine_index: _Optional[int] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.EngineState, str]] = ..., tensor_parallel_size: _Optional[int] = ..., weight_version: _Optional[str] = ..., sleep_level: _Optional[int] = ..., tasks: _Optional[_Iterable[str]] = ...) -> None: ...
