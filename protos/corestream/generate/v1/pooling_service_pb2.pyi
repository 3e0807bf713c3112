from corestream.generate.v1 import generate_service_pb2 as _generate_service_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolingType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_TYPE_UNSPECIFIED: _ClassVar[PoolingType]
    POOLING_TYPE_LAST: _ClassVar[PoolingType]
    POOLING_TYPE_MEAN: _ClassVar[PoolingType]
    POOLING_TYPE_CLS: _ClassVar[PoolingType]
    POOLING_TYPE_ALL: _ClassVar[PoolingType]
POOLING_TYPE_UNSPECIFIED: PoolingType
POOLING_TYPE_LAST: PoolingType
POOLING_TYPE_MEAN: PoolingType
POOLING_TYPE_CLS: PoolingType
POOLING_TYPE_ALL: PoolingType

class PoolingInput(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _generate_service_pb2.TokenIds
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[_generate_service_pb2.TokenIds, _Mapping]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("inputs", "dimensions", "pooling_type", "normalize", "truncate", "prompt_name")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    POOLING_TYPE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[PoolingInput]
    dimensions: int
    pooling_type: PoolingType
    normalize: bool
    truncate: bool
    prompt_name: str
    def __init__(self, inputs: _Optional[_Iterable[_Union[PoolingInput, _Mapping]]] = ..., dimensions: _Optional[int] = ..., pooling_type: _Optional[_Union[PoolingType, str]] = ..., normalize: _Optional[bool] = ..., truncate: _Optional[bool] = ..., prompt_name: _Optional[str] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("index", "values", "rows", "num_tokens")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    index: int
    values: _containers.RepeatedScalarFieldContainer[float]
    rows: int
    num_tokens: int
    def __init__(self, index: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ..., rows: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class PoolingUsage(_message.Message):
    __slots__ = ("prompt_tokens", "total_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    total_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "model", "usage", "weight_version")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    model: str
    usage: PoolingUsage
    weight_version: str
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., model: _Optional[str] = ..., usage: _Optional[_Union[PoolingUsage, _Mapping]] = ..., weight_version: _Optional[str] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("inputs", "truncate", "activation")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[PoolingInput]
    truncate: bool
    activation: bool
    def __init__(self, inputs: _Optional[_Iterable[_Union[PoolingInput, _Mapping]]] = ..., truncate: _Optional[bool] = ..., activation: _Optional[bool] = ...) -> None: ...

class Classification(_message.Message):
    __slots__ = ("index", "probs", "label", "num_tokens")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    index: int
    probs: _containers.RepeatedScalarFieldContainer[float]
    label: str
    num_tokens: int
    def __init__(self, index: _Optional[int] = ..., probs: _Optional[_Iterable[float]] = ..., label: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("results", "model", "usage", "weight_version")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[Classification]
    model: str
    usage: PoolingUsage
    weight_version: str
    def __init__(self, results: _Optional[_Iterable[_Union[Classification, _Mapping]]] = ..., model: _Optional[str] = ..., usage: _Optional[_Union[PoolingUsage, _Mapping]] = ..., weight_version: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("query", "documents", "truncate")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    query: PoolingInput
    documents: _containers.RepeatedCompositeFieldContainer[PoolingInput]
    truncate: bool
    def __init__(self, query: _Optional[_Union[PoolingInput, _Mapping]] = ..., documents: _Optional[_Iterable[_Union[PoolingInput, _Mapping]]] = ..., truncate: _Optional[bool] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("index", "score")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    index: int
    score: float
    def __init__(self, index: _Optional[int] = ..., score: _Optional[float] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results", "model", "usage", "weight_version")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    model: str
    usage: PoolingUsage
    weight_version: str
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ..., model: _Optional[str] = ..., usage: _Optional[_Union[PoolingUsage, _Mapping]] = ..., weight_version: _Optional[str] = ...) -> None: ...
