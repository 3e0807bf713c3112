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
    __slots__ = ("engine_index", "mode")
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    mode: PauseMode
    def __init__(self, engine_index: _Optional[int] = ..., mode: _Optional[_Union[PauseMode, str]] = ...) -> None: ...

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
