"""vLLM's GenerateRequest as ours: the translation at the door, before the request path.

The vLLM message is proto3 without `optional` on most sampling scalars, so zero means
"unset" there (vLLM's own servicer reads it so: top_p 0 is 1.0, repetition_penalty 0
is 1.0, n 0 is 1); the few `optional` ones (temperature, max_tokens, logprobs,
prompt_logprobs, seed, truncate_prompt_tokens) keep their presence. Everything that
has a meaning here becomes our GenerateStreamRequest and is validated by the one
request path (pipeline.py), whose errors are then renamed to the vLLM field names
(`vllm_field_names`). Fields that ask for what corestream cannot do (multimodal
inputs, KV transfer for prefill/decode disaggregation, structural tags, "all"
logprobs) are refused with INVALID_ARGUMENT naming the field; fields whose effect is
already ours or only shapes text that this API never returns are ignored
(`IGNORED_FIELDS`, listed in the README).
"""

from __future__ import annotations

import json
import re

from corestream.common.v1 import common_pb2
from corestream.generate.v1 import generate_service_pb2 as generate_pb2
from corestream.vendor.smg_grpc_proto import vllm_engine_pb2 as vllm_pb2

from services.frontend.errors import RequestError, invalid_argument

_INT32_MAX = (1 << 31) - 1

IGNORED_FIELDS = (
    # Only the detokenized text's spacing, which this API never returns (stop strings
    # are matched on the text as our detokenizer writes it).
    "sampling_params.spaces_between_special_tokens",
    # Our grammars always start at the first generated token: what the flag asks for.
    "sampling_params.grammar_from_first_token",
    # Only for debugging in vLLM: the ids are what runs.
    "tokenized.original_text",
)

# Our field names (pipeline.py, generate/validation.py) -> vLLM's, longest first.
_RENAMES = (
    ("token_ids.ids", "tokenized.input_ids"),
    ("sampling.", "sampling_params."),
)
_RENAME_PATTERN = re.compile(
    "|".join(r"(?<![\w.])" + re.escape(ours) for ours, _ in _RENAMES))


def vllm_field_names(error: RequestError) -> RequestError:
    """`error` with our request's field names (in its field and its message) spelled
    as vLLM's GenerateRequest spells them."""
    def rename(text: str) -> str:
        return _RENAME_PATTERN.sub(lambda m: dict(_RENAMES)[m.group(0)], text)

    return RequestError(error.code, rename(error.message), field=rename(error.field),
                        reason=error.reason, retry_after_s=error.retry_after_s)


def check_unsupported(request: vllm_pb2.GenerateRequest) -> None:
    """INVALID_ARGUMENT for a field set to something corestream cannot honour. Empty
    messages carry nothing and pass."""
    multimodal = {"mm_inputs": request.mm_inputs.ByteSize(),
                  "extra_mm_inputs": len(request.extra_mm_inputs),
                  "media_refs": request.media_refs.ByteSize()}
    for field, size in multimodal.items():
        if size:
            raise invalid_argument(field, f"{field}: this server serves text-only models; "
                                   "multimodal inputs are not supported")
    if request.kv_transfer_params.ByteSize():
        raise _no_kv_transfer("kv_transfer_params")
    if request.HasField("kv_transfer_params_json"):
        try:
            params = json.loads(request.kv_transfer_params_json or "null")
        except RecursionError:
            raise invalid_argument("kv_transfer_params_json",
                                   "kv_transfer_params_json is nested too deeply") from None
        except ValueError as exc:
            raise invalid_argument("kv_transfer_params_json",
                                   f"kv_transfer_params_json is not JSON: {exc}") from None
        if params:
            raise _no_kv_transfer("kv_transfer_params_json")


def _no_kv_transfer(field: str) -> RequestError:
    return invalid_argument(field, f"{field}: this server has no KV connector; prefill/decode "
                            "disaggregation (KV transfer between workers) is not supported")


def to_generate_request(request_id: str, request: vllm_pb2.GenerateRequest
                        ) -> generate_pb2.GenerateStreamRequest:
    """Our request for the vLLM one (prompt as given: text or ids); raises RequestError
    (vLLM field names) for what cannot be mapped. Values are checked on our request
    path afterwards."""
    check_unsupported(request)
    params = request.sampling_params
    ours = generate_pb2.GenerateStreamRequest(
        request_id=request_id, sampling=to_sampling(params),
        skip_special_tokens=params.skip_special_tokens)
    kind = request.WhichOneof("input")
    if kind == "tokenized" and request.tokenized.input_ids:
        ours.token_ids.ids.extend(request.tokenized.input_ids)
    elif kind == "text" and request.text:
        ours.text = request.text
    else:
        field = "tokenized.input_ids" if kind == "tokenized" else kind or "input"
        raise invalid_argument(field, f"{field}: the prompt is empty; give "
                               "tokenized.input_ids or text")
    if request.HasField("data_parallel_rank"):
        if request.data_parallel_rank < 0:
            raise invalid_argument("data_parallel_rank", "data_parallel_rank must be >= 0, "
                                   f"got {request.data_parallel_rank}")
        ours.data_parallel_rank = request.data_parallel_rank
    return ours


def to_sampling(params: vllm_pb2.SamplingParams) -> common_pb2.SamplingParams:
    """Our SamplingParams for vLLM's, zeros read as vLLM reads them."""
    ours = common_pb2.SamplingParams(
        stop=params.stop, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output)
    if params.HasField("temperature"):
        ours.temperature = params.temperature
    # Unset (zero) scalars keep our defaults, which are vLLM's.
    for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        value = getattr(params, name)
        if value:
            setattr(ours, name, value)
    if params.top_k:
        ours.top_k = min(params.top_k, _INT32_MAX)  # beyond any vocabulary: the same
    if params.HasField("max_tokens"):
        ours.max_tokens = _int32("sampling_params.max_tokens", params.max_tokens)
    if params.min_tokens:
        ours.min_tokens = _int32("sampling_params.min_tokens", params.min_tokens)
    if params.n:
        ours.n = _int32("sampling_params.n", params.n)
    if params.HasField("seed"):
        ours.seed = params.seed
    for name in ("logprobs", "prompt_logprobs"):
        if params.HasField(name):
            value = getattr(params, name)
            if value == -1:
                raise invalid_argument(
                    f"sampling_params.{name}", f"sampling_params.{name} = -1 (the whole "
                    "vocabulary) is not supported; ask for at most 20 alternatives")
            setattr(ours, name, value)
    for token_id, bias in sorted(params.logit_bias.items()):
        if token_id < 0:
            raise invalid_argument("sampling_params.logit_bias",
                                   f"sampling_params.logit_bias has token id {token_id}; "
                                   "token ids are >= 0")
        ours.logit_bias[token_id] = bias
    _set_constraint(params, ours)
    return ours


def _set_constraint(params: vllm_pb2.SamplingParams, ours: common_pb2.SamplingParams) -> None:
    kind = params.WhichOneof("constraint")
    if kind is None:
        return
    if kind == "structural_tag":
        raise invalid_argument(
            "sampling_params.structural_tag", "sampling_params.structural_tag is not "
            "supported; use json_schema, regex, grammar, choice or json_object")
    if kind == "choice":
        ours.choice.choices.extend(params.choice.choices)
    else:  # json_schema, regex, grammar, json_object: the same field here
        setattr(ours, kind, getattr(params, kind))


def _int32(field: str, value: int) -> int:
    if value > _INT32_MAX:
        raise invalid_argument(field, f"{field} must be <= {_INT32_MAX}, got {value}")
    return value


def truncated(token_ids: list[int], params: vllm_pb2.SamplingParams,
              max_model_len: int) -> list[int]:
    """The prompt cut to its last `truncate_prompt_tokens` tokens (-1: the model's
    context), as vLLM truncates; unchanged when the field is unset."""
    if not params.HasField("truncate_prompt_tokens"):
        return token_ids
    keep = params.truncate_prompt_tokens
    if keep == -1:
        keep = max_model_len
    elif keep < 1:
        raise invalid_argument(
            "sampling_params.truncate_prompt_tokens",
            f"sampling_params.truncate_prompt_tokens must be >= 1, or -1 for the model's "
            f"context, got {keep}")
    return token_ids[-keep:]
