"""One sample of a generation request: engine outputs in, stream chunks out.

Each sample (of `sampling.n`) is its own engine request with its own incremental
detokenizer and stop-string matcher; it ends on its own, when the engine finishes
it or a stop string matches (then the engine must be told to abort it). A sample
whose JSON Schema the grammar only approximates keeps its text, and when the grammar
completes the frontend validates it: a failure ends the sample with
FINISH_REASON_SCHEMA_MISMATCH instead of FINISH_REASON_STOP.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from corestream.common.v1 import common_pb2
from corestream.engine.v1 import engine_core_service_pb2 as engine_pb2
from corestream.generate.v1 import generate_service_pb2 as generate_pb2

from services.common.sampling import SamplingParams
from services.frontend.generate.constraint_check import OutputCheck
from services.frontend.generate.detokenizer import IncrementalDetokenizer, StopStringMatcher
from services.frontend.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


class SampleStream:
    def __init__(
        self,
        index: int,
        engine_request_id: str,
        tokenizer: TextTokenizer,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        skip_special_tokens: bool,
        output_check: OutputCheck | None = None,
    ) -> None:
        self.index = index
        self.engine_request_id = engine_request_id
        self._tokenizer = tokenizer
        self._min_tokens = sampling.min_tokens
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                                   skip_special_tokens)
        self._matcher = StopStringMatcher(sampling.stop, sampling.include_stop_str_in_output)
        self.num_generated = 0
        self.num_cached_tokens = 0
        self.finished = False
        self.stopped_by_string = False
        """Ended here on a stop string while the engine still runs it."""
        self._output_check = output_check
        self._texts: list[str] = []

    def on_output(
        self, request_id: str, output: engine_pb2.RequestOutput
    ) -> generate_pb2.GenerateStreamResponse | None:
        """The chunk the output makes, or None when it adds nothing to show yet."""
        token_ids = list(output.new_token_ids)
        self.num_generated += len(token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        text, stop = self._matcher.feed(
            self._detokenizer.push(token_ids), check=self.num_generated >= self._min_tokens
        )
        chunk = generate_pb2.GenerateStreamResponse(
            request_id=request_id, index=self.index, text=text, token_ids=token_ids,
            logprobs=with_token_text(self._tokenizer, output.new_logprobs),
            weight_version=output.weight_version,
        )
        if stop is not None:
            self.stopped_by_string = True
            chunk.finish_reason = common_pb2.FINISH_REASON_STOP_STRING
            chunk.stop_string = stop
        elif output.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            chunk.text += self._matcher.flush()
            chunk.finish_reason = output.finish_reason
            if output.HasField("stop_token_id"):
                chunk.stop_token_id = output.stop_token_id
        elif not (token_ids or text):
            return None
        if self._output_check is not None:
            self._texts.append(chunk.text)
            if chunk.finish_reason == common_pb2.FINISH_REASON_STOP:
                self._check_output(chunk)
        self.finished = chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        return chunk


    def _check_output(self, chunk: generate_pb2.GenerateStreamResponse) -> None:
        assert self._output_check is not None
        failure = self._output_check.failure("".join(self._texts))
        if failure is not None:
            chunk.finish_reason = common_pb2.FINISH_REASON_SCHEMA_MISMATCH
            log.info("sample %s: the finished output fails its JSON Schema: %s",
                     self.engine_request_id, failure)


def with_token_text(
    tokenizer: TextTokenizer, logprobs: Sequence[common_pb2.PositionLogprobs]
) -> Sequence[common_pb2.PositionLogprobs]:
    """Fills in each token's text, in place (the messages are the engine's, received
    here and not shared), with one tokenizer call for the lot."""
    if not logprobs:
        return logprobs
    ids = []
    for lp in logprobs:
        ids.append(lp.token_id)
        ids.extend(t.token_id for t in lp.top)
    token_texts = tokenizer.token_texts(ids)
    texts = iter(token_texts)
    raw = iter(tokenizer.token_bytes(ids, token_texts))
    for lp in logprobs:
        lp.token, lp.token_bytes = next(texts), next(raw)
        for top in lp.top:
            top.token, top.token_bytes = next(texts), next(raw)
    return logprobs
