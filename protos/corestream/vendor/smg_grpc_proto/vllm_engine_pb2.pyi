from corestream.vendor.smg_grpc_proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids", "skip_special_tokens", "spaces_between_special_tokens", "ignore_eos", "n", "logprobs", "prompt_logprobs", "seed", "include_stop_str_in_output", "logit_bias", "truncate_prompt_tokens", "grammar_from_first_token", "json_schema", "regex", "grammar", "structural_tag", "json_object", "choice")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FROM_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    ignore_eos: bool
    n: int
    logprobs: int
    prompt_logprobs: int
    seed: int
    include_stop_str_in_output: bool
    logit_bias: _containers.ScalarMap[int, float]
    truncate_prompt_tokens: int
    grammar_from_first_token: bool
    json_schema: str
    regex: str
    grammar: str
    structural_tag: str
    json_object: bool
    choice: ChoiceConstraint
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., n: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., seed: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., truncate_prompt_tokens: _Optional[int] = ..., grammar_from_first_token: _Optional[bool] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., structural_tag: _Optional[str] = ..., json_object: _Optional[bool] = ..., choice: _Optional[_Union[ChoiceConstraint, _Mapping]] = ...) -> None: ...

class ChoiceConstraint(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenizedInput(_message.Message):
    __slots__ = ("original_text", "input_ids")
    ORIGINAL_TEXT_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    original_text: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, original_text: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorData(_message.Message):
    __slots__ = ("shape", "dtype", "inline", "shm", "remote")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    inline: bytes
    shm: _common_pb2.ShmHandle
    remote: _common_pb2.RemoteTensorHandle
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., inline: _Optional[bytes] = ..., shm: _Optional[_Union[_common_pb2.ShmHandle, _Mapping]] = ..., remote: _Optional[_Union[_common_pb2.RemoteTensorHandle, _Mapping]] = ...) -> None: ...

class PlaceholderRange(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class MultimodalInputs(_message.Message):
    __slots__ = ("pixel_values", "model_specific_tensors", "im_token_id", "mm_placeholders", "mm_hashes", "batched_keys", "flat_keys", "keep_on_cpu_keys", "modality", "encoder_input_key")
    class ModelSpecificTensorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TensorData
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TensorData, _Mapping]] = ...) -> None: ...
    class FlatKeysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    MODEL_SPECIFIC_TENSORS_FIELD_NUMBER: _ClassVar[int]
    IM_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MM_PLACEHOLDERS_FIELD_NUMBER: _ClassVar[int]
    MM_HASHES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_KEYS_FIELD_NUMBER: _ClassVar[int]
    FLAT_KEYS_FIELD_NUMBER: _ClassVar[int]
    KEEP_ON_CPU_KEYS_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    ENCODER_INPUT_KEY_FIELD_NUMBER: _ClassVar[int]
    pixel_values: TensorData
    model_specific_tensors: _containers.MessageMap[str, TensorData]
    im_token_id: int
    mm_placeholders: _containers.RepeatedCompositeFieldContainer[PlaceholderRange]
    mm_hashes: _containers.RepeatedScalarFieldContainer[str]
    batched_keys: _containers.RepeatedScalarFieldContainer[str]
    flat_keys: _containers.ScalarMap[str, str]
    keep_on_cpu_keys: _containers.RepeatedScalarFieldContainer[str]
    modality: _common_pb2.Modality
    encoder_input_key: str
    def __init__(self, pixel_values: _Optional[_Union[TensorData, _Mapping]] = ..., model_specific_tensors: _Optional[_Mapping[str, TensorData]] = ..., im_token_id: _Optional[int] = ..., mm_placeholders: _Optional[_Iterable[_Union[PlaceholderRange, _Mapping]]] = ..., mm_hashes: _Optional[_Iterable[str]] = ..., batched_keys: _Optional[_Iterable[str]] = ..., flat_keys: _Optional[_Mapping[str, str]] = ..., keep_on_cpu_keys: _Optional[_Iterable[str]] = ..., modality: _Optional[_Union[_common_pb2.Modality, str]] = ..., encoder_input_key: _Optional[str] = ...) -> None: ...

class MediaRef(_message.Message):
    __slots__ = ("modality", "url")
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    modality: _common_pb2.Modality
    url: str
    def __init__(self, modality: _Optional[_Union[_common_pb2.Modality, str]] = ..., url: _Optional[str] = ...) -> None: ...

class MediaRefs(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[MediaRef]
    def __init__(self, items: _Optional[_Iterable[_Union[MediaRef, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "tokenized", "text", "sampling_params", "stream", "kv_transfer_params", "mm_inputs", "extra_mm_inputs", "kv_transfer_params_json", "data_parallel_rank", "media_refs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZED_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    MM_INPUTS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_MM_INPUTS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    MEDIA_REFS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokenized: TokenizedInput
    text: str
    sampling_params: SamplingParams
    stream: bool
    kv_transfer_params: KvTransferParams
    mm_inputs: MultimodalInputs
    extra_mm_inputs: _containers.RepeatedCompositeFieldContainer[MultimodalInputs]
    kv_transfer_params_json: str
    data_parallel_rank: int
    media_refs: MediaRefs
    def __init__(self, request_id: _Optional[str] = ..., tokenized: _Optional[_Union[TokenizedInput, _Mapping]] = ..., text: _Optional[str] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., stream: _Optional[bool] = ..., kv_transfer_params: _Optional[_Union[KvTransferParams, _Mapping]] = ..., mm_inputs: _Optional[_Union[MultimodalInputs, _Mapping]] = ..., extra_mm_inputs: _Optional[_Iterable[_Union[MultimodalInputs, _Mapping]]] = ..., kv_transfer_params_json: _Optional[str] = ..., data_parallel_rank: _Optional[int] = ..., media_refs: _Optional[_Union[MediaRefs, _Mapping]] = ...) -> None: ...

class KvTransferParams(_message.Message):
    __slots__ = ("remote_host", "remote_port")
    REMOTE_HOST_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PORT_FIELD_NUMBER: _ClassVar[int]
    remote_host: str
    remote_port: int
    def __init__(self, remote_host: _Optional[str] = ..., remote_port: _Optional[int] = ...) -> None: ...

class OutputLogProbs(_message.Message):
    __slots__ = ("token_logprobs", "token_ids", "top_logprobs")
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogProbs]
    def __init__(self, token_logprobs: _Optional[_Iterable[float]] = ..., token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogProbs, _Mapping]]] = ...) -> None: ...

class InputLogProbs(_message.Message):
    __slots__ = ("token_logprobs", "token_ids", "top_logprobs")
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_logprobs: _containers.RepeatedCompositeFieldContainer[InputTokenLogProb]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogProbs]
    def __init__(self, token_logprobs: _Optional[_Iterable[_Union[InputTokenLogProb, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogProbs, _Mapping]]] = ...) -> None: ...

class InputTokenLogProb(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: float
    def __init__(self, value: _Optional[float] = ...) -> None: ...

class TopLogProbs(_message.Message):
    __slots__ = ("values", "token_ids")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, values: _Optional[_Iterable[float]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "complete")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    chunk: GenerateStreamChunk
    complete: GenerateComplete
    def __init__(self, chunk: _Optional[_Union[GenerateStreamChunk, _Mapping]] = ..., complete: _Optional[_Union[GenerateComplete, _Mapping]] = ...) -> None: ...

class GenerateStreamChunk(_message.Message):
    __slots__ = ("token_ids", "prompt_tokens", "completion_tokens", "cached_tokens", "output_logprobs", "input_logprobs", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_logprobs: OutputLogProbs
    input_logprobs: InputLogProbs
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., output_logprobs: _Optional[_Union[OutputLogProbs, _Mapping]] = ..., input_logprobs: _Optional[_Union[InputLogProbs, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class GenerateComplete(_message.Message):
    __slots__ = ("output_ids", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "output_logprobs", "input_logprobs", "index", "kv_transfer_params", "matched_token_id", "matched_stop_str", "kv_transfer_params_json", "spec_accepted_tokens", "spec_draft_tokens", "media_identity")
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_STR_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEDIA_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_logprobs: OutputLogProbs
    input_logprobs: InputLogProbs
    index: int
    kv_transfer_params: KvTransferParams
    matched_token_id: int
    matched_stop_str: str
    kv_transfer_params_json: str
    spec_accepted_tokens: int
    spec_draft_tokens: int
    media_identity: MediaIdentity
    def __init__(self, output_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., output_logprobs: _Optional[_Union[OutputLogProbs, _Mapping]] = ..., input_logprobs: _Optional[_Union[InputLogProbs, _Mapping]] = ..., index: _Optional[int] = ..., kv_transfer_params: _Optional[_Union[KvTransferParams, _Mapping]] = ..., matched_token_id: _Optional[int] = ..., matched_stop_str: _Optional[str] = ..., kv_transfer_params_json: _Optional[str] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_draft_tokens: _Optional[int] = ..., media_identity: _Optional[_Union[MediaIdentity, _Mapping]] = ...) -> None: ...

class MediaIdentity(_message.Message):
    __slots__ = ("prompt_token_ids", "mm_inputs", "extra_mm_inputs")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MM_INPUTS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_MM_INPUTS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    mm_inputs: MultimodalInputs
    extra_mm_inputs: _containers.RepeatedCompositeFieldContainer[MultimodalInputs]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., mm_inputs: _Optional[_Union[MultimodalInputs, _Mapping]] = ..., extra_mm_inputs: _Optional[_Iterable[_Union[MultimodalInputs, _Mapping]]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "tokenized")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokenized: TokenizedInput
    def __init__(self, request_id: _Optional[str] = ..., tokenized: _Optional[_Union[TokenizedInput, _Mapping]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embedding", "prompt_tokens", "embedding_dim")
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIM_FIELD_NUMBER: _ClassVar[int]
    embedding: _containers.RepeatedScalarFieldContainer[float]
    prompt_tokens: int
    embedding_dim: int
    def __init__(self, embedding: _Optional[_Iterable[float]] = ..., prompt_tokens: _Optional[int] = ..., embedding_dim: _Optional[int] = ...) -> None: ...

class HealthCheckRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthCheckResponse(_message.Message):
    __slots__ = ("healthy", "message")
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    message: str
    def __init__(self, healthy: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_path", "is_generation", "max_context_length", "vocab_size", "supports_vision", "served_model_name", "tokenizer_path", "model_type", "architectures", "eos_token_ids", "pad_token_id", "bos_token_id", "max_req_input_len", "default_sampling_params_json")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    IS_GENERATION_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_VISION_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURES_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_REQ_INPUT_LEN_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SAMPLING_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    is_generation: bool
    max_context_length: int
    vocab_size: int
    supports_vision: bool
    served_model_name: str
    tokenizer_path: str
    model_type: str
    architectures: _containers.RepeatedScalarFieldContainer[str]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    pad_token_id: int
    bos_token_id: int
    max_req_input_len: int
    default_sampling_params_json: str
    def __init__(self, model_path: _Optional[str] = ..., is_generation: _Optional[bool] = ..., max_context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., supports_vision: _Optional[bool] = ..., served_model_name: _Optional[str] = ..., tokenizer_path: _Optional[str] = ..., model_type: _Optional[str] = ..., architectures: _Optional[_Iterable[str]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., pad_token_id: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., max_req_input_len: _Optional[int] = ..., default_sampling_params_json: _Optional[str] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("active_requests", "is_paused", "last_receive_timestamp", "uptime_seconds", "server_type", "kv_connector", "kv_role", "kv_engine_id", "data_parallel_size", "shm_namespace_id", "kv_cache_dtype", "block_size", "attention_backend", "model_dtype", "pairing_protocol", "mm_processor", "mm_media_ref_schemes", "mm_processor_source", "mm_device_do_normalize", "max_num_seqs", "mm_item_limits", "multimodal_encoder_dtype", "engine_reasoning_parser", "constrained_decoding_start", "mm_encoder_budget")
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    IS_PAUSED_FIELD_NUMBER: _ClassVar[int]
    LAST_RECEIVE_TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SERVER_TYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    KV_ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHM_NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAIRING_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    MM_PROCESSOR_FIELD_NUMBER: _ClassVar[int]
    MM_MEDIA_REF_SCHEMES_FIELD_NUMBER: _ClassVar[int]
    MM_PROCESSOR_SOURCE_FIELD_NUMBER: _ClassVar[int]
    MM_DEVICE_DO_NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MM_ITEM_LIMITS_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_ENCODER_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_REASONING_PARSER_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINED_DECODING_START_FIELD_NUMBER: _ClassVar[int]
    MM_ENCODER_BUDGET_FIELD_NUMBER: _ClassVar[int]
    active_requests: int
    is_paused: bool
    last_receive_timestamp: float
    uptime_seconds: float
    server_type: str
    kv_connector: str
    kv_role: str
    kv_engine_id: str
    data_parallel_size: int
    shm_namespace_id: str
    kv_cache_dtype: str
    block_size: int
    attention_backend: str
    model_dtype: str
    pairing_protocol: str
    mm_processor: str
    mm_media_ref_schemes: str
    mm_processor_source: str
    mm_device_do_normalize: bool
    max_num_seqs: int
    mm_item_limits: str
    multimodal_encoder_dtype: str
    engine_reasoning_parser: str
    constrained_decoding_start: str
    mm_encoder_budget: int
    def __init__(self, active_requests: _Optional[int] = ..., is_paused: _Optional[bool] = ..., last_receive_timestamp: _Optional[float] = ..., uptime_seconds: _Optional[float] = ..., server_type: _Optional[str] = ..., kv_connector: _Optional[str] = ..., kv_role: _Optional[str] = ..., kv_engine_id: _Optional[str] = ..., data_parallel_size: _Optional[int] = ..., shm_namespace_id: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., attention_backend: _Optional[str] = ..., model_dtype: _Optional[str] = ..., pairing_protocol: _Optional[str] = ..., mm_processor: _Optional[str] = ..., mm_media_ref_schemes: _Optional[str] = ..., mm_processor_source: _Optional[str] = ..., mm_device_do_normalize: _Optional[bool] = ..., max_num_seqs: _Optional[int] = ..., mm_item_limits: _Optional[str] = ..., multimodal_encoder_dtype: _Optional[str] = ..., engine_reasoning_parser: _Optional[str] = ..., constrained_decoding_start: _Optional[str] = ..., mm_encoder_budget: _Optional[int] = ...) -> None: ...

class GetLoadsRequest(_message.Message):
    __slots__ = ("dp_rank", "include")
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    include: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, dp_rank: _Optional[int] = ..., include: _Optional[_Iterable[str]] = ...) -> None: ...

class GetLoadsResponse(_message.Message):
    __slots__ = ("timestamp", "version", "dp_rank_count", "loads")
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_COUNT_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    timestamp: str
    version: str
    dp_rank_count: int
    loads: _containers.RepeatedCompositeFieldContainer[SchedulerLoad]
    def __init__(self, timestamp: _Optional[str] = ..., version: _Optional[str] = ..., dp_rank_count: _Optional[int] = ..., loads: _Optional[_Iterable[_Union[SchedulerLoad, _Mapping]]] = ...) -> None: ...

class SchedulerLoad(_message.Message):
    __slots__ = ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens", "max_total_num_tokens", "token_usage", "gen_throughput", "cache_hit_rate", "utilization", "max_running_requests", "num_waiting_uncached_tokens")
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_USAGE_FIELD_NUMBER: _ClassVar[int]
    GEN_THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_UNCACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    num_running_reqs: int
    num_waiting_reqs: int
    num_total_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    token_usage: float
    gen_throughput: float
    cache_hit_rate: float
    utilization: float
    max_running_requests: int
    num_waiting_uncached_tokens: int
    def __init__(self, dp_rank: _Optional[int] = ..., num_running_reqs: _Optional[int] = ..., num_waiting_reqs: _Optional[int] = ..., num_total_reqs: _Optional[int] = ..., num_used_tokens: _Optional[int] = ..., max_total_num_tokens: _Optional[int] = ..., token_usage: _Optional[float] = ..., gen_throughput: _Optional[float] = ..., cache_hit_rate: _Optional[float] = ..., utilization: _Optional[float] = ..., max_running_requests: _Optional[int] = ..., num_waiting_uncached_tokens: _Optional[int] = ...) -> None: ...
