"""Checks that run before a request reaches any engine.

Each failure is INVALID_ARGUMENT whose message names the field, the limit and the
value (`sampling.temperature must be >= 0, got -1`), so that a client can fix the
request from the message alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from corestream.common.v1 import common_pb2

from services.common.convert import sampling_from_proto
from services.common.sampling import SamplingParams
from services.frontend.errors import RequestError, invalid_argument

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
PENALTY_RANGE = 2.0
MAX_SAMPLES = 16
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class RequestLimits:
    """The server's caps on one request (FrontendConfig's flags)."""

    max_n: int = MAX_SAMPLES
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_string_chars: int = MAX_STOP_STRING_CHARS
    max_tokens: int = 0
    """Cap on sampling.max_tokens; 0 means only the model's context bounds it."""


def _fmt(value: float) -> str:
    return f"{value:g}"


def _check_float(
    field: str, value: float, *, low: float, high: float, low_open: bool, high_open: bool
) -> None:
    """value in the interval; brackets in the message follow the openness of each end."""
    if math.isinf(value):
        raise invalid_argument(field, f"{field} must be finite, got {_fmt(value)}")
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if math.isnan(value) or below or above:
        if high == math.inf:
            bound = f"> {_fmt(low)}" if low_open else f">= {_fmt(low)}"
            raise invalid_argument(field, f"{field} must be {bound}, got {_fmt(value)}")
        interval = (
            f"{'(' if low_open else '['}{_fmt(low)}, {_fmt(high)}{')' if high_open else ']'}"
        )
        raise invalid_argument(field, f"{field} must be in {interval}, got {_fmt(value)}")


def _check_token_ids(field: str, token_ids: Iterable[int], vocab_size: int) -> None:
    for i, token_id in enumerate(token_ids):
        if token_id >= vocab_size:
            raise invalid_argument(
                field,
                f"{field}[{i}] = {token_id} is out of the vocabulary "
                f"(token ids must be < vocab_size {vocab_size})",
            )


def check_request_id(request_id: str, max_chars: int) -> None:
    """The id is echoed as `x-request-id` metadata, whose values are printable ASCII."""
    if len(request_id) > max_chars:
        raise invalid_argument(
            "request_id",
            f"request_id has {len(request_id)} characters, at most {max_chars} are allowed",
        )
    for i, char in enumerate(request_id):
        if not " " <= char <= "~":
            raise invalid_argument(
                "request_id",
                f"request_id must be printable ASCII (it is echoed as x-request-id "
                f"metadata), got U+{ord(char):04X} at index {i}",
            )


def check_prompt_text(text: str) -> None:
    if not text:
        raise invalid_argument("text", "prompt is empty: give a non-empty text or token_ids")


def check_prompt_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    if not token_ids:
        raise invalid_argument(
            "token_ids.ids", "prompt is empty: give a non-empty text or token_ids"
        )
    _check_token_ids("token_ids.ids", token_ids, vocab_size)


def check_sampling(
    pb: common_pb2.SamplingParams, vocab_size: int, limits: RequestLimits = RequestLimits()
) -> SamplingParams:
    """Validate the wire message and convert it; unset fields take the defaults."""
    if pb.HasField("temperature"):
        _check_float("sampling.temperature", pb.temperature,
                     low=0, high=math.inf, low_open=False, high_open=True)
    if pb.HasField("top_p"):
        _check_float("sampling.top_p", pb.top_p, low=0, high=1, low_open=True, high_open=False)
    if pb.HasField("top_k") and pb.top_k < -1:
        raise invalid_argument(
            "sampling.top_k", f"sampling.top_k must be >= -1 (0 or -1 = off), got {pb.top_k}"
        )
    if pb.HasField("min_p"):
        _check_float("sampling.min_p", pb.min_p, low=0, high=1, low_open=False, high_open=False)
    if pb.HasField("repetition_penalty"):
        _check_float("sampling.repetition_penalty", pb.repetition_penalty,
                     low=0, high=math.inf, low_open=True, high_open=True)
    for name in ("presence_penalty", "frequency_penalty"):
        if pb.HasField(name):
            _check_float(f"sampling.{name}", getattr(pb, name),
                         low=-PENALTY_RANGE, high=PENALTY_RANGE, low_open=False, high_open=False)
    if pb.HasField("max_tokens") and pb.max_tokens < 1:
        raise invalid_argument(
            "sampling.max_tokens", f"sampling.max_tokens must be >= 1, got {pb.max_tokens}"
        )
    if limits.max_tokens and pb.HasField("max_tokens") and pb.max_tokens > limits.max_tokens:
        raise invalid_argument(
            "sampling.max_tokens",
            f"sampling.max_tokens must be <= {limits.max_tokens} (this server's "
            f"max_tokens_limit), got {pb.max_tokens}",
        )
    if pb.HasField("min_tokens"):
        if pb.min_tokens < 0:
            raise invalid_argument(
                "sampling.min_tokens", f"sampling.min_tokens must be >= 0, got {pb.min_tokens}"
            )
        if pb.HasField("max_tokens") and pb.min_tokens > pb.max_tokens:
            raise invalid_argument(
                "sampling.min_tokens",
                f"sampling.min_tokens must be <= sampling.max_tokens ({pb.max_tokens}), "
                f"got {pb.min_tokens}",
            )
    _check_int("n", pb, low=1, high=limits.max_n)
    _check_int("logprobs", pb, low=0, high=MAX_LOGPROBS)
    _check_int("prompt_logprobs", pb, low=0, high=MAX_LOGPROBS)
    _check_stops(pb, limits)
    _check_token_ids("sampling.stop_token_ids", pb.stop_token_ids, vocab_size)
    for token_id, bias in sorted(pb.logit_bias.items()):
        if token_id >= vocab_size:
            raise invalid_argument(
                "sampling.logit_bias",
                f"sampling.logit_bias has token id {token_id}, out of the vocabulary "
                f"(token ids must be < vocab_size {vocab_size})",
            )
        if not math.isfinite(bias):
            raise invalid_argument(
                "sampling.logit_bias",
                f"sampling.logit_bias[{token_id}] must be finite, got {_fmt(bias)}",
            )
    return sampling_from_proto(pb)


def _check_int(name: str, pb: common_pb2.SamplingParams, *, low: int, high: int) -> None:
    """An optional integer field, when set, in [low, high]."""
    if not pb.HasField(name):
        return
    value = getattr(pb, name)
    if not low <= value <= high:
        field = f"sampling.{name}"
        raise invalid_argument(field, f"{field} must be in [{low}, {high}], got {value}")


def _check_stops(pb: common_pb2.SamplingParams, limits: RequestLimits) -> None:
    if len(pb.stop) > limits.max_stop_strings:
        raise invalid_argument(
            "sampling.stop",
            f"sampling.stop has {len(pb.stop)} strings, at most {limits.max_stop_strings} "
            "are allowed",
        )
    for i, stop in enumerate(pb.stop):
        if not stop:
            raise invalid_argument("sampling.stop", f"sampling.stop[{i}] is empty")
        if len(stop) > limits.max_stop_string_chars:
            raise invalid_argument(
                "sampling.stop",
                f"sampling.stop[{i}] has {len(stop)} characters, "
                f"at most {limits.max_stop_string_chars} are allowed",
            )
    if len(pb.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid_argument(
            "sampling.stop_token_ids",
            f"sampling.stop_token_ids has {len(pb.stop_token_ids)} ids, "
            f"at most {MAX_STOP_TOKEN_IDS} are allowed",
        )


def check_length(
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    max_prompt_tokens: int = 0,
    max_tokens_limit: int = 0,
) -> int:
    """The number of tokens the request may generate, or an error naming the limit hit
    (unset max_tokens means as many as fit, up to `max_tokens_limit` when set)."""
    if max_prompt_tokens and num_prompt_tokens > max_prompt_tokens:
        raise _too_long(
            f"prompt has {num_prompt_tokens} tokens, more than this server's "
            f"max_prompt_tokens ({max_prompt_tokens})"
        )
    if num_prompt_tokens >= max_model_len:
        raise _too_long(
            f"prompt has {num_prompt_tokens} tokens, but the model's context (max_model_len) "
            f"is {max_model_len} tokens, leaving no room to generate"
        )
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        return min(room, max_tokens_limit) if max_tokens_limit else room
    if max_tokens > room:
        raise invalid_argument(
            "sampling.max_tokens",
            f"prompt ({num_prompt_tokens} tokens) + sampling.max_tokens ({max_tokens}) exceeds "
            f"the model's context (max_model_len) of {max_model_len} tokens; "
            f"sampling.max_tokens must be <= {room}",
            reason="PROMPT_TOO_LONG",
        )
    return max_tokens


def _too_long(message: str) -> RequestError:
    return invalid_argument("prompt", message, reason="PROMPT_TOO_LONG")
