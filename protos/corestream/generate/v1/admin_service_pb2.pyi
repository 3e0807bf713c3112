from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_UNSPECIFIED: _ClassVar[PauseMode]
    PAUSE_MODE_ABORT: _ClassVar[PauseMode]
    PAUSE_MODE_WAIT: _ClassVar[PauseMode]
    PAUSE_MODE_KEEP: _ClassVar[PauseMode]
PAUSE_MODE_UNSPECIFIED: PauseMode
PAUSE_MODE_ABORT: PauseMode
PAUSE_MODE_WAIT: PauseMode
PAUSE_MODE_KEEP: PauseMode

class EngineResult(_message.Message):
    __slots__ = ("engine_index", "address", "ok", "code", "message", "result_json")
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    address: str
    ok: bool
    code: int
    message: str
    result_json: str
    def __init__(self, engine_index: _Optional[int] = ..., address: _Optional[str] = ..., ok: _Optional[bool] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., result_json: _Optional[str] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ("engine_index",)
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    def __init__(self, engine_index: _Optional[int] = ...) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class GetEngineStatsRequest(_message.Message):
    __slots__ = ("engine_index",)
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    def __init__(self, engine_index: _Optional[int] = ...) -> None: ...

class GetEngineStatsResponse(_message.Message):
    __slots__ = ("results", "restarts")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    restarts: _containers.RepeatedCompositeFieldContainer[ProcessRestarts]
    def __init__(self, results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ..., restarts: _Optional[_Iterable[_Union[ProcessRestarts, _Mapping]]] = ...) -> None: ...

class ProcessRestarts(_message.Message):
    __slots__ = ("part", "restarts", "last_exit", "given_up")
    PART_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_EXIT_FIELD_NUMBER: _ClassVar[int]
    GIVEN_UP_FIELD_NUMBER: _ClassVar[int]
    part: str
    restarts: int
    last_exit: str
    given_up: bool
    def __init__(self, part: _Optional[str] = ..., restarts: _Optional[int] = ..., last_exit: _Optional[str] = ..., given_up: _Optional[bool] = ...) -> None: ...

class PauseSchedulingRequest(_message.Message):
    __slots__ = ("engine_index", "mode", "timeout_s", "clear_cache")
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CLEAR_CACHE_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    mode: PauseMode
    timeout_s: float
    clear_cache: bool
    def __init__(self, engine_index: _Optional[int] = ..., mode: _Optional[_Union[PauseMode, str]] = ..., timeout_s: _Optional[float] = ..., clear_cache: _Optional[bool] = ...) -> None: ...

class PauseSchedulingResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class ResumeSchedulingRequest(_message.Message):
    __slots__ = ("engine_index",)
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    def __init__(self, engine_index: _Optional[int] = ...) -> None: ...

class ResumeSchedulingResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class StartProfileRequest(_message.Message):
    __slots__ = ("engine_index",)
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    def __init__(self, engine_index: _Optional[int] = ...) -> None: ...

class StartProfileResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ("engine_index",)
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    def __init__(self, engine_index: _Optional[int] = ...) -> None: ...

class StopProfileResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class IsPausedRequest(_message.Message):
    __slots__ = ("engine_index",)
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    def __init__(self, engine_index: _Optional[int] = ...) -> None: ...

class IsPausedResponse(_message.Message):
    __slots__ = ("is_paused", "results")
    IS_PAUSED_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    is_paused: bool
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, is_paused: _Optional[bool] = ..., results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class UpdateWeightsFromDiskRequest(_message.Message):
    __slots__ = ("path", "weight_version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    weight_version: str
    def __init__(self, path: _Optional[str] = ..., weight_version: _Optional[str] = ...) -> None: ...

class UpdateWeightsFromDiskResponse(_message.Message):
    __slots__ = ("ok", "weight_version", "results")
    OK_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    weight_version: str
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, ok: _Optional[bool] = ..., weight_version: _Optional[str] = ..., results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class InitWeightTransferRequest(_message.Message):
    __slots__ = ("master_address", "master_port", "rank_offset", "world_size", "timeout_s")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank_offset: _Optional[int] = ..., world_size: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class InitWeightTransferResponse(_message.Message):
    __slots__ = ("ok", "results")
    OK_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, ok: _Optional[bool] = ..., results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class StartWeightUpdateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartWeightUpdateResponse(_message.Message):
    __slots__ = ("ok", "results")
    OK_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, ok: _Optional[bool] = ..., results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class TensorShape(_message.Message):
    __slots__ = ("dims",)
    DIMS_FIELD_NUMBER: _ClassVar[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dims: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("names", "dtype_names", "shapes", "shared_memory_path", "offsets")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_NAMES_FIELD_NUMBER: _ClassVar[int]
    SHAPES_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    dtype_names: _containers.RepeatedScalarFieldContainer[str]
    shapes: _containers.RepeatedCompositeFieldContainer[TensorShape]
    shared_memory_path: str
    offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, names: _Optional[_Iterable[str]] = ..., dtype_names: _Optional[_Iterable[str]] = ..., shapes: _Optional[_Iterable[_Union[TensorShape, _Mapping]]] = ..., shared_memory_path: _Optional[str] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("ok", "results")
    OK_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, ok: _Optional[bool] = ..., results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class FinishWeightUpdateRequest(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    def __init__(self, weight_version: _Optional[str] = ...) -> None: ...

class FinishWeightUpdateResponse(_message.Message):
    __slots__ = ("ok", "weight_version", "results")
    OK_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    weight_version: str
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, ok: _Optional[bool] = ..., weight_version: _Optional[str] = ..., results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class AbortWeightUpdateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortWeightUpdateResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class GetWeightInfoRequest(_message.Message):
    __slots__ = ("engine_index",)
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    def __init__(self, engine_index: _Optional[int] = ...) -> None: ...

class GetWeightInfoResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("engine_index", "level")
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    level: int
    def __init__(self, engine_index: _Optional[int] = ..., level: _Optional[int] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ("ok", "results")
    OK_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, ok: _Optional[bool] = ..., results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("engine_index", "tags")
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine_index: _Optional[int] = ..., tags: _Optional[_Iterable[str]] = ...) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ("ok", "results")
    OK_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, ok: _Optional[bool] = ..., results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class IsSleepingRequest(_message.Message):
    __slots__ = ("engine_index",)
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    def __init__(self, engine_index: _Optional[int] = ...) -> None: ...

class IsSleepingResponse(_message.Message):
    __slots__ = ("is_sleeping", "results")
    IS_SLEEPING_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    is_sleeping: bool
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, is_sleeping: _Optional[bool] = ..., results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class GetFaultStatusRequest(_message.Message):
    __slots__ = ("engine_index",)
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    def __init__(self, engine_index: _Optional[int] = ...) -> None: ...

class GetFaultStatusResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class RecoverFaultRequest(_message.Message):
    __slots__ = ("engine_index",)
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    def __init__(self, engine_index: _Optional[int] = ...) -> None: ...

class RecoverFaultResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class AbortFaultRequest(_message.Message):
    __slots__ = ("engine_index",)
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    def __init__(self, engine_index: _Optional[int] = ...) -> None: ...

class AbortFaultResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...
