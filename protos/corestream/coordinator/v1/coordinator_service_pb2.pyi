from corestream.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterEngineRequest(_message.Message):
    __slots__ = ("engine_index", "address", "model", "max_model_len", "max_num_seqs", "state", "tensor_parallel_size")
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    address: str
    model: str
    max_model_len: int
    max_num_seqs: int
    state: _common_pb2.EngineState
    tensor_parallel_size: int
    def __init__(self, engine_index: _Optional[int] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., state: _Optional[_Union[_common_pb2.EngineState, str]] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class RegisterEngineResponse(_message.Message):
    __slots__ = ("engine_id", "report_interval_s", "lease_timeout_s")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REPORT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    report_interval_s: float
    lease_timeout_s: float
    def __init__(self, engine_id: _Optional[str] = ..., report_interval_s: _Optional[float] = ..., lease_timeout_s: _Optional[float] = ...) -> None: ...

class ReportLoadRequest(_message.Message):
    __slots__ = ("engine_id", "num_waiting", "num_running", "kv_cache_usage", "state", "step_counter", "wave", "wave_running", "sleep_level")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_COUNTER_FIELD_NUMBER: _ClassVar[int]
    WAVE_FIELD_NUMBER: _ClassVar[int]
    WAVE_RUNNING_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    state: _common_pb2.EngineState
    step_counter: int
    wave: int
    wave_running: bool
    sleep_level: int
    def __init__(self, engine_id: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., state: _Optional[_Union[_common_pb2.EngineState, str]] = ..., step_counter: _Optional[int] = ..., wave: _Optional[int] = ..., wave_running: _Optional[bool] = ..., sleep_level: _Optional[int] = ...) -> None: ...

class ReportLoadResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("engine_id", "engine_index", "address", "model", "num_waiting", "num_running", "kv_cache_usage", "state", "step_counter", "max_num_seqs", "wave", "wave_running", "tensor_parallel_size", "sleep_level")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_COUNTER_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    WAVE_FIELD_NUMBER: _ClassVar[int]
    WAVE_RUNNING_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    engine_index: int
    address: str
    model: str
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    state: _common_pb2.EngineState
    step_counter: int
    max_num_seqs: int
    wave: int
    wave_running: bool
    tensor_parallel_size: int
    sleep_level: int
    def __init__(self, engine_id: _Optional[str] = ..., engine_index: _Optional[int] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., state: _Optional[_Union[_common_pb2.EngineState, str]] = ..., step_counter: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., wave: _Optional[int] = ..., wave_running: _Optional[bool] = ..., tensor_parallel_size: _Optional[int] = ..., sleep_level: _Optional[int] = ...) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchLoadResponse(_message.Message):
    __slots__ = ("engines", "generation")
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineLoad]
    generation: int
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineLoad, _Mapping]]] = ..., generation: _Optional[int] = ...) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("engines", "generation")
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineLoad]
    generation: int
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineLoad, _Mapping]]] = ..., generation: _Optional[int] = ...) -> None: ...

class StartWaveRequest(_message.Message):
    __slots__ = ("model", "engine_index", "wave")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    WAVE_FIELD_NUMBER: _ClassVar[int]
    model: str
    engine_index: int
    wave: int
    def __init__(self, model: _Optional[str] = ..., engine_index: _Optional[int] = ..., wave: _Optional[int] = ...) -> None: ...

class StartWaveResponse(_message.Message):
    __slots__ = ("num_relayed",)
    NUM_RELAYED_FIELD_NUMBER: _ClassVar[int]
    num_relayed: int
    def __init__(self, num_relayed: _Optional[int] = ...) -> None: ...

class WatchWavesRequest(_message.Message):
    __slots__ = ("model", "engine_index")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    model: str
    engine_index: int
    def __init__(self, model: _Optional[str] = ..., engine_index: _Optional[int] = ...) -> None: ...

class WatchWavesResponse(_message.Message):
    __slots__ = ("wave", "started_by")
    WAVE_FIELD_NUMBER: _ClassVar[int]
    STARTED_BY_FIELD_NUMBER: _ClassVar[int]
    wave: int
    started_by: int
    def __init__(self, wave: _Optional[int] = ..., started_by: _Optional[int] = ...) -> None: ...
