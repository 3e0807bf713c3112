"""A request as the engine core tracks it, free of protobuf and torch.

The server converts each wire AddRequest into a `Request`; the scheduler moves it
between its waiting and running queues and appends the sampled tokens; the
engine core reports `RequestUpdate`s back per session.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.common.pooling import PoolingParams, PoolingType
from services.common.sampling import SamplingParams
from services.engine.scheduler.output import PositionLogprobs

# google.rpc.Code values carried by error outputs (RequestUpdate.error_code).
INVALID_ARGUMENT = 3
FAILED_PRECONDITION = 9
RESOURCE_EXHAUSTED = 8
INTERNAL = 13
UNAVAILABLE = 14


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class FinishReason(enum.IntEnum):
    """Mirrors corestream.common.v1.FinishReason, so the edge converts by value."""

    LENGTH = 1
    EOS_TOKEN = 2
    STOP_TOKEN = 3
    ABORT = 5
    ERROR = 6
    STOP = 7
    """The output constraint is complete."""
    PAUSED = 9
    """Ended by a pause in mode abort; the tokens so far are the output."""


class TokenGrammar(Protocol):
    """A constrained request's grammar state (structured/grammar.py), as the
    scheduler uses it: advanced by each sampled token."""

    def accept(self, token: int) -> bool: ...

    def valid_prefix(self, tokens: list[int]) -> int: ...

    @property
    def is_stopped(self) -> bool: ...

    @property
    def error(self) -> str: ...


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    """Lower values are served first under the priority policy."""
    session_id: str = ""
    """The Session that added the request; its outputs go back there."""
    cache_salt: str = ""
    """Prefix-cache isolation: only requests with equal salts share cached blocks."""
    trace_headers: dict[str, str] = field(default_factory=dict)
    """W3C traceparent/tracestate of the caller's span: the engine's span continues it."""

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose keys and values are in the KV cache."""
    num_inflight_tokens: int = 0
    """Tokens scheduled in batches that have not come back yet (a batch queue deeper
    than 1 schedules the next step while the previous one executes)."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache when the request was first admitted."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained hashes of the request's full blocks so far; tokens never change, so
    they stay valid across preemptions."""
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    """Gathered over the prefill chunks until the first output carries them."""
    grammar: TokenGrammar | None = None
    """The compiled output constraint, set before the scheduler sees the request; it
    has consumed every output token (a preemption keeps it: the tokens stay)."""
    grammar_compile: tuple[float, float] | None = None
    """Wall-clock start and end of the constraint's compile, for the trace."""
    pooling: PoolingParams | None = None
    """Set for a pooling request (a pooling engine takes only these): its prompt is
    prefilled and pooled, and nothing is generated."""
    num_draft_tokens: int = 0
    """Draft tokens of the batch in flight (speculative decoding): fed to the model with
    the last token and verified, so they count as in flight without being tokens of
    the request yet."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to feed the model: a (rest of a) prompt, or the last sampled token.
        Tokens of batches in flight are not counted: they are being computed."""
        return self.num_tokens - self.num_scheduled_end

    @property
    def num_scheduled_end(self) -> int:
        """Where the next scheduled chunk starts: past the computed and in-flight tokens
        (draft tokens in flight are not the request's: they may be rejected)."""
        return self.num_computed_tokens + self.num_inflight_tokens - self.num_draft_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and not yet reported (they go with the first
        output, so a recompute after that needs none)."""
        return self.sampling.prompt_logprobs is not None and not self.output_token_ids

    @property
    def pools_every_token(self) -> bool:
        """A pooling request whose result reads every token's hidden state (all but
        LAST pooling): no prefix-cache hit may skip computing some of them. Its
        `pooling.pooling_type` is resolved (set) by the engine."""
        return (self.pooling is not None
                and self.pooling.pooling_type is not PoolingType.LAST)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without concatenating the whole history."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n_prompt]


@dataclass(frozen=True, slots=True)
class RequestUpdate:
    """What one step (or an abort or a rejection) changed for one request."""

    request_id: str
    session_id: str
    new_token_ids: Sequence[int] = ()
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    error_code: int = 0
    """A google.rpc.Code for FinishReason.ERROR."""
    error_message: str = ""
    num_cached_tokens: int = 0
    new_logprobs: Sequence[PositionLogprobs] = ()
    """One per new token, when the request asked for logprobs."""
    prompt_logprobs: Sequence[PositionLogprobs] = ()
    """Prompt positions 1.., with the request's first output."""
    pooled: bytes = b""
    """A pooling request's result, float32 (little-endian) values of `pooled_shape`."""
    pooled_shape: tuple[int, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
