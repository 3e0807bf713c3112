"""Our GenerateStream chunks as vLLM's GenerateResponses.

`stream: true`: every chunk of ours with tokens (or logprobs) becomes a
GenerateStreamChunk with the new token ids (`completion_tokens` counts them, as vLLM's
deltas do), tagged with its sample's `index`. Once the request is over, each sample
gets its GenerateComplete, in index order; like vLLM's servicer, a streamed Complete
repeats only the tokens of the chunk that finished the sample (a client accumulates
the chunks), while its `completion_tokens` is the sample's total.

`stream: false`: nothing until the request is over, then one Complete per sample with
all its tokens and logprobs.

The Completes wait for the request's end because only the last chunk carries the
usage (prompt and cached tokens) that every Complete reports; for n = 1 that is the
chunk that finishes the one sample anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from corestream.common.v1 import common_pb2
from corestream.generate.v1 import generate_service_pb2 as generate_pb2
from corestream.vendor.smg_grpc_proto import vllm_engine_pb2 as vllm_pb2

FINISH_REASONS = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_EOS_TOKEN: "stop",
    common_pb2.FINISH_REASON_STOP_TOKEN: "stop",
    common_pb2.FINISH_REASON_STOP_STRING: "stop",
    common_pb2.FINISH_REASON_STOP: "stop",
    # The grammar completed; only the validation of an approximated JSON Schema failed.
    common_pb2.FINISH_REASON_SCHEMA_MISMATCH: "stop",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_PAUSED: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


@dataclass
class _Sample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.PositionLogprobs] = field(default_factory=list)
    last: generate_pb2.GenerateStreamResponse | None = None
    """The chunk that finished the sample."""


class ResponseBuilder:
    """One request's vLLM responses, fed our chunks in order."""

    def __init__(self, prompt_token_ids: Sequence[int], stream: bool,
                 num_logprobs: int | None = None, num_prompt_logprobs: int | None = None
                 ) -> None:
        self._prompt = list(prompt_token_ids)
        self._stream = stream
        self._num_logprobs = num_logprobs
        self._num_prompt_logprobs = num_prompt_logprobs
        self._samples: dict[int, _Sample] = {}
        self._prompt_logprobs: vllm_pb2.InputLogProbs | None = None
        self._usage = common_pb2.Usage(prompt_tokens=len(self._prompt))

    def on_chunk(self, chunk: generate_pb2.GenerateStreamResponse
                 ) -> vllm_pb2.GenerateResponse | None:
        """Record the chunk; the stream chunk to send for it, if any."""
        sample = self._samples.setdefault(chunk.index, _Sample())
        sample.token_ids.extend(chunk.token_ids)
        sample.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            sample.last = chunk
        if chunk.HasField("usage"):
            self._usage.CopyFrom(chunk.usage)
        input_logprobs = None
        if chunk.prompt_logprobs:
            input_logprobs = self._prompt_logprobs = self._input_logprobs(chunk.prompt_logprobs)
        if not self._stream or not (chunk.token_ids or chunk.logprobs or input_logprobs):
            return None
        return vllm_pb2.GenerateResponse(chunk=vllm_pb2.GenerateStreamChunk(
            token_ids=chunk.token_ids, prompt_tokens=len(self._prompt),
            completion_tokens=len(chunk.token_ids),
            cached_tokens=self._usage.cached_tokens,
            output_logprobs=self._output_logprobs(chunk.logprobs),
            input_logprobs=input_logprobs, index=chunk.index))

    def completes(self) -> list[vllm_pb2.GenerateResponse]:
        """Every sample's GenerateComplete, in index order, once the request is over."""
        return [vllm_pb2.GenerateResponse(complete=self._complete(index, sample))
                for index, sample in sorted(self._samples.items())]

    def _complete(self, index: int, sample: _Sample) -> vllm_pb2.GenerateComplete:
        last = sample.last
        if self._stream:
            token_ids = list(last.token_ids) if last is not None else []
            logprobs: Sequence[common_pb2.PositionLogprobs] = (
                last.logprobs if last is not None else [])
        else:
            token_ids, logprobs = sample.token_ids, sample.logprobs
        finish = last.finish_reason if last is not None else common_pb2.FINISH_REASON_ABORT
        complete = vllm_pb2.GenerateComplete(
            output_ids=token_ids, finish_reason=FINISH_REASONS.get(finish, "stop"),
            prompt_tokens=self._usage.prompt_tokens or len(self._prompt),
            completion_tokens=len(sample.token_ids), cached_tokens=self._usage.cached_tokens,
            output_logprobs=self._output_logprobs(logprobs),
            input_logprobs=None if self._stream else self._prompt_logprobs, index=index)
        if last is not None:
            stop = last.WhichOneof("matched_stop")
            if stop == "stop_string":
                complete.matched_stop_str = last.stop_string
            elif stop == "stop_token_id":
                complete.matched_token_id = last.stop_token_id
        return complete

    def _output_logprobs(self, positions: Sequence[common_pb2.PositionLogprobs]
                         ) -> vllm_pb2.OutputLogProbs | None:
        if not positions:
            return None
        return vllm_pb2.OutputLogProbs(
            token_logprobs=[p.logprob for p in positions],
            token_ids=[p.token_id for p in positions],
            top_logprobs=[_top(p) for p in positions] if self._num_logprobs else [])

    def _input_logprobs(self, positions: Sequence[common_pb2.PositionLogprobs]
                        ) -> vllm_pb2.InputLogProbs:
        """Ours cover prompt positions 1..; vLLM's list every prompt token, the first
        with no value (nothing precedes it)."""
        first = vllm_pb2.InputTokenLogProb()
        with_top = bool(self._num_prompt_logprobs)
        return vllm_pb2.InputLogProbs(
            token_logprobs=[first, *(vllm_pb2.InputTokenLogProb(value=p.logprob)
                                     for p in positions)],
            token_ids=[*self._prompt[:1], *(p.token_id for p in positions)],
            top_logprobs=[vllm_pb2.TopLogProbs(), *(_top(p) for p in positions)]
            if with_top else [])


def _top(position: common_pb2.PositionLogprobs) -> vllm_pb2.TopLogProbs:
    return vllm_pb2.TopLogProbs(values=[t.logprob for t in position.top],
                                token_ids=[t.token_id for t in position.top])
