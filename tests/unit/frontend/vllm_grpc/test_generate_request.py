"""vLLM's GenerateRequest -> ours: zeros read as vLLM reads them, refusals name the field."""

from __future__ import annotations

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.vendor.smg_grpc_proto import common_pb2 as smg_common_pb2
from corestream.vendor.smg_grpc_proto import vllm_engine_pb2 as vllm_pb2

from services.frontend.errors import RequestError, invalid_argument
from services.frontend.generate.validation import check_sampling
from services.frontend.vllm_grpc.generate_request import (
    to_generate_request,
    to_sampling,
    truncated,
    vllm_field_names,
)


def request(**fields: object) -> vllm_pb2.GenerateRequest:
    fields.setdefault("tokenized", vllm_pb2.TokenizedInput(input_ids=[5, 6, 7]))
    return vllm_pb2.GenerateRequest(request_id="r", **fields)  # type: ignore[arg-type]


def refusal(message: vllm_pb2.GenerateRequest) -> RequestError:
    with pytest.raises(RequestError) as info:
        to_generate_request("r", message)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    return info.value


def test_unset_sampling_params_keep_every_default() -> None:
    # proto3 zeros: top_p 0 is 1.0, repetition_penalty 0 is 1.0, n 0 is 1 (vLLM's reading).
    ours = to_sampling(vllm_pb2.SamplingParams())
    assert ours == common_pb2.SamplingParams()
    assert check_sampling(ours, vocab_size=100) == check_sampling(common_pb2.SamplingParams(),
                                                                  vocab_size=100)


def test_every_meaningful_field_is_carried() -> None:
    params = vllm_pb2.SamplingParams(
        temperature=0.0, top_p=0.9, top_k=5, min_p=0.1, frequency_penalty=0.5,
        presence_penalty=-0.5, repetition_penalty=1.2, max_tokens=7, min_tokens=2,
        stop=["x"], stop_token_ids=[3], ignore_eos=True, n=2, logprobs=3, prompt_logprobs=1,
        seed=42, include_stop_str_in_output=True, logit_bias={4: -5.0}, regex="a+")
    ours = to_sampling(params)
    assert ours == common_pb2.SamplingParams(
        # float32 on both wires: the same values, bit for bit.
        temperature=0.0, top_p=0.9, top_k=5, min_p=0.1,
        frequency_penalty=0.5, presence_penalty=-0.5, repetition_penalty=1.2,
        max_tokens=7, min_tokens=2, stop=["x"], stop_token_ids=[3], ignore_eos=True, n=2,
        logprobs=3, prompt_logprobs=1, seed=42, include_stop_str_in_output=True,
        logit_bias={4: -5.0}, regex="a+")
    assert ours.HasField("temperature")  # 0.0 set: greedy, not "unset"


@pytest.mark.parametrize("constraint", [
    {"json_schema": '{"type": "integer"}'}, {"regex": "[ab]+"}, {"grammar": "start: 'a'"},
    {"json_object": True}, {"choice": vllm_pb2.ChoiceConstraint(choices=["yes", "no"])}])
def test_constraints_map_one_to_one(constraint: dict[str, object]) -> None:
    ours = to_sampling(vllm_pb2.SamplingParams(**constraint))  # type: ignore[arg-type]
    (name,) = constraint
    assert ours.WhichOneof("constraint") == name
    if name == "choice":
        assert list(ours.choice.choices) == ["yes", "no"]
    else:
        assert getattr(ours, name) == constraint[name]


def test_prompt_as_ids_or_text_and_the_rank() -> None:
    ours = to_generate_request("r", request(data_parallel_rank=1, stream=True))
    assert list(ours.token_ids.ids) == [5, 6, 7] and ours.data_parallel_rank == 1
    assert not ours.HasField("text")
    ours = to_generate_request("r", vllm_pb2.GenerateRequest(text="hi"))
    assert ours.text == "hi" and not ours.HasField("data_parallel_rank")
    # vLLM's skip_special_tokens is a plain bool: unset means False there.
    assert ours.HasField("skip_special_tokens") and not ours.skip_special_tokens


@pytest.mark.parametrize(("fields", "field"), [
    ({"mm_inputs": vllm_pb2.MultimodalInputs(mm_hashes=["h"])}, "mm_inputs"),
    ({"extra_mm_inputs": [vllm_pb2.MultimodalInputs()]}, "extra_mm_inputs"),
    ({"media_refs": vllm_pb2.MediaRefs(items=[vllm_pb2.MediaRef(url="http://x")])},
     "media_refs"),
    ({"kv_transfer_params": vllm_pb2.KvTransferParams(remote_host="h")},
     "kv_transfer_params"),
    ({"kv_transfer_params_json": '{"do_remote_prefill": true}'}, "kv_transfer_params_json"),
    ({"kv_transfer_params_json": "{not json"}, "kv_transfer_params_json"),
    ({"data_parallel_rank": -1}, "data_parallel_rank"),
    ({"sampling_params": vllm_pb2.SamplingParams(structural_tag="{}")},
     "sampling_params.structural_tag"),
    ({"sampling_params": vllm_pb2.SamplingParams(logprobs=-1)}, "sampling_params.logprobs"),
    ({"sampling_params": vllm_pb2.SamplingParams(prompt_logprobs=-1)},
     "sampling_params.prompt_logprobs"),
    ({"sampling_params": vllm_pb2.SamplingParams(logit_bias={-3: 1.0})},
     "sampling_params.logit_bias"),
    ({"sampling_params": vllm_pb2.SamplingParams(max_tokens=1 << 31)},
     "sampling_params.max_tokens"),
    ({"sampling_params": vllm_pb2.SamplingParams(n=1 << 31)}, "sampling_params.n"),
])
def test_what_cannot_be_honoured_is_refused_by_name(fields: dict[str, object],
                                                    field: str) -> None:
    error = refusal(request(**fields))
    assert error.field == field
    assert field in error.message


def test_no_prompt_or_an_empty_one_is_refused() -> None:
    assert refusal(vllm_pb2.GenerateRequest(request_id="r")).field == "input"
    assert refusal(vllm_pb2.GenerateRequest(text="")).field == "text"
    assert refusal(request(tokenized=vllm_pb2.TokenizedInput(original_text="x"))).field == \
        "tokenized.input_ids"


def test_empty_or_null_values_of_unsupported_fields_pass() -> None:
    # They carry nothing: ignoring them changes nothing.
    to_generate_request("r", request(mm_inputs=vllm_pb2.MultimodalInputs(),
                                     kv_transfer_params=vllm_pb2.KvTransferParams(),
                                     kv_transfer_params_json="{}"))
    to_generate_request("r", request(kv_transfer_params_json="null"))
    to_generate_request("r", request(media_refs=vllm_pb2.MediaRefs()))


def test_ignored_fields_change_nothing() -> None:
    plain = to_generate_request("r", request())
    ignored = to_generate_request("r", request(
        tokenized=vllm_pb2.TokenizedInput(original_text="whatever", input_ids=[5, 6, 7]),
        sampling_params=vllm_pb2.SamplingParams(spaces_between_special_tokens=True,
                                                grammar_from_first_token=True)))
    assert ignored == plain


def test_huge_top_k_means_off_as_it_does_in_vllm() -> None:
    assert to_sampling(vllm_pb2.SamplingParams(top_k=(1 << 32) - 1)).top_k == (1 << 31) - 1


def test_our_errors_speak_vllm_field_names() -> None:
    renamed = vllm_field_names(invalid_argument(
        "sampling.temperature", "sampling.temperature must be >= 0, got -1"))
    assert renamed.field == "sampling_params.temperature"
    assert renamed.message == "sampling_params.temperature must be >= 0, got -1"
    renamed = vllm_field_names(invalid_argument(
        "token_ids.ids", "token_ids.ids[2] = 999 is out of the vocabulary"))
    assert (renamed.field, renamed.message) == (
        "tokenized.input_ids", "tokenized.input_ids[2] = 999 is out of the vocabulary")
    # Already vLLM's, or unrelated: unchanged.
    kept = vllm_field_names(invalid_argument("sampling_params.n", "sampling_params.n bad"))
    assert (kept.field, kept.message) == ("sampling_params.n", "sampling_params.n bad")


@pytest.mark.parametrize(("keep", "expected"), [(2, [8, 9]), (10, [5, 6, 7, 8, 9]),
                                                (-1, [6, 7, 8, 9])])
def test_truncation_keeps_the_prompts_end(keep: int, expected: list[int]) -> None:
    params = vllm_pb2.SamplingParams(truncate_prompt_tokens=keep)
    assert truncated([5, 6, 7, 8, 9], params, max_model_len=4) == expected
    assert truncated([5, 6], vllm_pb2.SamplingParams(), max_model_len=1) == [5, 6]


@pytest.mark.parametrize("keep", [0, -2])
def test_truncation_to_nothing_is_refused(keep: int) -> None:
    with pytest.raises(RequestError) as info:
        truncated([5], vllm_pb2.SamplingParams(truncate_prompt_tokens=keep), 4)
    assert info.value.field == "sampling_params.truncate_prompt_tokens"


def test_vendored_common_proto_is_the_one_vllm_engine_imports() -> None:
    # The edited import resolves to the vendored common.proto (one descriptor, one name).
    field = vllm_pb2.TensorData.DESCRIPTOR.fields_by_name["shm"]
    assert field.message_type is smg_common_pb2.ShmHandle.DESCRIPTOR
