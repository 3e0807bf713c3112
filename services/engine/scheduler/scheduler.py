"""Scheduler: continuous batching over a paged KV cache, in plain Python.

Each step hands out a token budget. There is no prefill or decode phase: every
request simply has `num_uncomputed_tokens` (a whole or partial prompt, or the one
token sampled last step), and the scheduler gives each as many as the budget
allows. Running requests go first, in the policy's order (FCFS: admission;
priority: most important first), so that decodes and unfinished prefill chunks
never starve; waiting requests are then admitted by the policy while the
budget, `max_num_seqs` and free blocks allow. When a running request cannot get
a block, the policy's victim (FCFS: the newest running request; priority: the
least important) is preempted by recompute: its blocks are freed and it waits
again with nothing computed, so its prompt and its generated tokens form one
longer prompt when it is readmitted.

Prefix caching: an admitted request starts on its longest cached prefix of full
blocks and computes only the rest; the blocks each step fills are cached after
the step. A preempted request's blocks stay cached until evicted, so on
readmission it usually recomputes only what was evicted. A request that wants
prompt logprobs skips the lookup: cached positions would have no logits.

A waiting request whose next uncached blocks, at least `WAIT_FOR_PREFIX_TOKENS` of
them, are ones that running requests are computing right now (requests sharing a
new prefix that arrive together) waits for them instead of computing them a
second time: it stays queued, later requests may overtake it, and it is admitted
on the cached blocks once their owner's step has filled them. The owner is
running, so the wait lasts at most its prefill. A shorter shared run is not
worth the step of latency.

Speculative decoding (with a `Speculator`): a decoding request may be scheduled with
draft tokens after its last token. They take budget and KV slots like tokens, but
only when the slots are free (a draft never preempts anyone); the step verifies them,
the accepted ones become the request's tokens with their KV, and the slots of the
rejected ones are given back (blocks past the request's tokens are freed).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from services.engine.request import (
    INVALID_ARGUMENT,
    FinishReason,
    Request,
    RequestStatus,
    RequestUpdate,
)
from services.engine.scheduler.kv_cache_manager import KVCacheManager
from services.engine.scheduler.output import (
    PositionLogprobs,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from services.engine.scheduler.policy import make_request_queue
from services.engine.speculative.speculator import SpeculationStats, Speculator

logger = logging.getLogger(__name__)

WAIT_FOR_PREFIX_TOKENS = 64
"""The shortest run of in-progress shared blocks (in tokens) a waiting request waits for."""


class RequestRejected(ValueError):
    """The request can never run on this engine (an INVALID_ARGUMENT for the client)."""


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    step_counter: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prefix_waits: int = 0
    speculation: SpeculationStats | None = None
    """Drafts proposed and accepted, with speculative decoding on."""


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_model_len: int,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        policy: str = "fcfs",
        wait_for_prefix_tokens: int = WAIT_FOR_PREFIX_TOKENS,
        speculator: Speculator | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.speculator = speculator
        self.wait_for_prefix_tokens = wait_for_prefix_tokens
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = make_request_queue(policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_counter = 0
        # Cumulative over the scheduler's life, counted when a request is admitted
        # (again after each preemption): tokens looked up and tokens found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0  # cumulative, for the metrics
        # Cumulative: steps a waiting request spent waiting for a block in progress.
        self.num_prefix_waits = 0
        self._finished_since_last_step: set[str] = set()
        # False while the engine is paused in "wait" mode: new requests stay queued
        # until admission resumes; running ones finish, and so do preempted ones (they
        # were running when the pause came) once they are at the head of the queue.
        self.admitting = True

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise RequestRejected naming the limit it breaks."""
        self.check_admissible(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def check_admissible(self, request: Request) -> None:
        """RequestRejected naming the limit the request breaks, if it can never run."""
        n_prompt = request.num_prompt_tokens
        if request.request_id in self.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        if n_prompt == 0:
            raise RequestRejected("prompt is empty")
        if request.pooling is not None:
            # Pooled, not continued: the whole context is the prompt's.
            if n_prompt > self.max_model_len:
                raise RequestRejected(f"input has {n_prompt} tokens; max_model_len is "
                                      f"{self.max_model_len}")
        elif n_prompt >= self.max_model_len:
            raise RequestRejected(
                f"prompt has {n_prompt} tokens; max_model_len is {self.max_model_len} "
                "and at least one token must be generated"
            )
        max_tokens = request.sampling.max_tokens
        total = n_prompt + (0 if request.pooling is not None
                            else max_tokens if max_tokens is not None else 1)
        needed = self.kv_cache.blocks_needed(min(total, self.max_model_len))
        if needed > self.kv_cache.num_blocks:
            raise RequestRejected(
                f"prompt ({n_prompt} tokens) + max_tokens needs {needed} KV blocks; "
                f"the whole KV cache holds {self.kv_cache.num_blocks} "
                f"({self.kv_cache.capacity_tokens} tokens)"
            )

    def abort_requests(self, request_ids: list[str]) -> list[RequestUpdate]:
        """Drop unfinished requests; unknown and finished ids are ignored (aborts race
        with finishing)."""
        updates = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status is RequestStatus.WAITING:
                self.waiting.remove(req)
            else:
                self.running.remove(req)
            self._finish(req, FinishReason.ABORT)
            updates.append(RequestUpdate(rid, req.session_id, finish_reason=FinishReason.ABORT))
        return updates

    def finish_all(self, reason: FinishReason, error_code: int = 0,
                   error_message: str = "") -> list[RequestUpdate]:
        """End every request (shutdown or a fatal error)."""
        updates = []
        for req in list(self.requests.values()):
            if req.status is RequestStatus.WAITING:
                self.waiting.remove(req)
            else:
                self.running.remove(req)
            self._finish(req, reason)
            updates.append(RequestUpdate(req.request_id, req.session_id, finish_reason=reason,
                                         error_code=error_code, error_message=error_message))
        return updates

    def has_work(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache.usage,
            step_counter=self.step_counter,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_prefix_waits=self.num_prefix_waits,
            speculation=self.speculator.stats() if self.speculator is not None else None,
        )

    # ---- one step ------------------------------------------------------------------

    def schedule(self, admit: bool = True) -> SchedulerOutput:
        """The next step's batch. `admit` False starts no waiting request (no new
        prefill): only running ones advance (a throttled expert-parallel rank)."""
        self.step_counter += 1
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False

        # Running requests first: each gets what it still needs, up to the budget.
        speculate = self.speculator is not None and self.speculator.active(len(self.running))
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_uncomputed_tokens, budget)
            if n <= 0:
                i += 1
                continue  # its tokens are in a batch still executing
            drafts = self._drafts(req, budget - n) if speculate and n == 1 else []
            num_running = len(self.running)
            room = self._make_room(req, req.num_scheduled_end + n, unscheduled_from=i)
            preempted |= len(self.running) < num_running
            if not room:
                continue  # req itself was the victim; running[i] is now the next one
            if drafts and not self.kv_cache.allocate_slots(
                    req.request_id, req.num_scheduled_end + n + len(drafts)):
                drafts = []  # no free slots for them: plain decode, nobody preempted
            scheduled.append(self._scheduled(req, n, drafts))
            budget -= n + len(drafts)
            i += 1

        # Then admit waiting requests. Not after a preemption: the freed blocks are
        # for the survivors, and readmitting the victim now would thrash.
        computing: set[bytes] | None = None  # blocks running requests have yet to cache
        deferred: list[Request] = []
        while (
            admit
            and not preempted
            and budget > 0
            and self.waiting
            and (self.admitting or self.waiting.peek().num_preemptions > 0)
            and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting.peek()
            cached = self._cached_prefix(req)
            if computing is None:
                computing = {h for r in self.running for h in self.kv_cache.uncached_hashes(r)}
            if self._awaits_block(req, len(cached), computing):
                deferred.append(self.waiting.pop())
                continue
            admitted = self._admit(req, cached, budget)
            if admitted is None:
                break  # head-of-line: later requests do not overtake one that lacks blocks
            computing.update(self.kv_cache.uncached_hashes(req))
            scheduled.append(admitted)
            budget -= len(admitted.token_ids)
        self.waiting.requeue(deferred)
        self.num_prefix_waits += len(deferred)

        # An empty output is not executed, so keep the finished ids for the next one.
        if not scheduled:
            return SchedulerOutput(requests=())
        if self.speculator is not None and self.speculator.runner_drafts is not None:
            scheduled = self._with_lookahead(scheduled)
        finished, self._finished_since_last_step = self._finished_since_last_step, set()
        return SchedulerOutput(requests=scheduled, finished_request_ids=frozenset(finished),
                               step=self.step_counter)

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """Draft tokens to verify after a decoding request's last token, within the
        step's budget, max_model_len and its max_tokens (the step yields one token more
        than it accepts drafts)."""
        assert self.speculator is not None
        if req.num_output_tokens == 0 or req.pooling is not None:
            return []  # the first token (prompt logprobs) as without speculation
        limit = min(budget, self.max_model_len - req.num_tokens)
        if req.sampling.max_tokens is not None:
            limit = min(limit, req.sampling.max_tokens - req.num_output_tokens - 1)
        drafts = self.speculator.propose(req, limit) if limit > 0 else []
        if drafts and req.grammar is not None:
            # Under an output constraint the first draft it rejects ends the proposal:
            # the step's masks (one per position) follow the drafts it accepts.
            del drafts[req.grammar.valid_prefix(drafts):]
        return drafts

    def _cached_prefix(self, req: Request) -> list[int]:
        return [] if _computes_every_token(req) else self.kv_cache.find_cached_prefix(req)

    def _awaits_block(self, req: Request, num_cached_blocks: int,
                      computing: set[bytes]) -> bool:
        """Whether the request's next blocks to compute, enough of them, are ones that
        running requests are computing (so they are cached after those steps)."""
        if _computes_every_token(req):
            return False
        num_blocks = self.kv_cache.num_blocks_in(req, num_cached_blocks, computing)
        return num_blocks > 0 and (
            num_blocks * self.kv_cache.block_size >= self.wait_for_prefix_tokens)

    def _admit(self, req: Request, cached: list[int], budget: int) -> ScheduledRequest | None:
        """Start the head waiting request on its longest cached prefix (`cached`, from
        _cached_prefix) plus up to `budget` computed tokens; None (and no change) if the
        blocks are lacking."""
        num_cached = len(cached) * self.kv_cache.block_size
        n = min(req.num_tokens - num_cached, budget)
        if not self.kv_cache.allocate_slots(req.request_id, num_cached + n, cached):
            return None
        self.waiting.pop()
        if not _computes_every_token(req):
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += num_cached
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_cached
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.RUNNING
        self.waiting.place_running(self.running, req)
        return self._scheduled(req, n)

    def _with_lookahead(self, scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """The step's requests, those that sample with a draft model's proposals wanted
        after it, when the batch that runs next (this one's requests, admissions
        included) is small enough to speculate."""
        assert self.speculator is not None
        if not self.speculator.active(len(self.running)):
            return scheduled
        return [self._lookahead(sr) if sr.sample and sr.pooling is None else sr
                for sr in scheduled]

    def _lookahead(self, sr: ScheduledRequest) -> ScheduledRequest:
        """`sr` asking the runner for the request's next drafts, with KV slots for the
        draft's own pass over them held (free ones only; none, no ask)."""
        assert self.speculator is not None
        req = self.requests[sr.request_id]
        end = sr.start_pos + len(sr.token_ids)
        k = min(self.speculator.lookahead(req), self.max_model_len - end)
        if k <= 0 or not self.kv_cache.allocate_slots(req.request_id, end + k):
            return sr
        return dataclasses.replace(sr, num_lookahead=k,
                                   block_ids=list(self.kv_cache.block_ids(req.request_id)))

    def _make_room(self, req: Request, num_tokens: int, unscheduled_from: int) -> bool:
        """Grow req's blocks to num_tokens, preempting unscheduled running requests
        (those at index >= unscheduled_from) as needed. False if req itself was preempted."""
        while not self.kv_cache.allocate_slots(req.request_id, num_tokens):
            victim = self.waiting.pick_victim(self.running[unscheduled_from:])
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv_cache.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_inflight_tokens = 0  # what is in flight will be dropped (see attempt)
        req.num_draft_tokens = 0
        req.prompt_logprobs.clear()  # the recompute gathers them again
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.add_preempted(req)
        logger.debug("preempted %s (%d tokens to recompute)", req.request_id, req.num_tokens)

    def _scheduled(self, req: Request, n: int, drafts: list[int] | None = None,
                   ) -> ScheduledRequest:
        start = req.num_scheduled_end
        token_ids = req.token_slice(start, start + n)
        if drafts:
            token_ids = token_ids + drafts
            req.num_draft_tokens += len(drafts)
        req.num_inflight_tokens += len(token_ids)
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=token_ids,
            start_pos=start,
            block_ids=list(self.kv_cache.block_ids(req.request_id)),
            sample=start + n == req.num_tokens,
            sampling=req.sampling,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=tuple(req.output_token_ids),
            eos_token_ids=req.eos_token_ids,
            prompt_logprobs=req.sampling.prompt_logprobs if req.wants_prompt_logprobs else None,
            attempt=req.num_preemptions,
            pooling=req.pooling,
            num_draft_tokens=len(drafts) if drafts else 0,
        )

    def unschedule(self, out: SchedulerOutput) -> None:
        """Take back a step that failed before its update: its tokens go back to being
        uncomputed, to be scheduled again (its requests keep their blocks), and the
        requests that ended before it are reported again with the next step."""
        for sr in out.requests:
            req = self.requests.get(sr.request_id)
            if (req is not None and req.status is RequestStatus.RUNNING
                    and req.num_preemptions == sr.attempt):
                req.num_inflight_tokens -= len(sr.token_ids)
                req.num_draft_tokens -= sr.num_draft_tokens
        self._finished_since_last_step |= out.finished_request_ids

    def update_from_output(
        self, out: SchedulerOutput, result: RunnerOutput
    ) -> list[RequestUpdate]:
        """Advance what ran, append sampled (and accepted draft) tokens and finish
        requests that stop."""
        updates = []
        for sr in out.requests:
            req = self.requests.get(sr.request_id)
            if (req is None or req.status is not RequestStatus.RUNNING
                    or req.num_preemptions != sr.attempt):
                continue  # aborted or preempted since it was scheduled
            req.num_inflight_tokens -= len(sr.token_ids)
            if sr.num_draft_tokens:
                updates.append(self._verified(req, sr, result))
                self._keep_drafts(req, sr, result)
                continue
            req.num_computed_tokens += len(sr.token_ids)
            self.kv_cache.cache_full_blocks(req)
            if sr.prompt_logprobs is not None:
                req.prompt_logprobs.extend(result.prompt_logprobs.get(sr.request_id, ()))
            if not sr.sample:
                continue  # a prefill chunk: nothing to report yet
            if req.pooling is not None:
                updates.append(self._pooled(req, result))
                continue
            prompt_logprobs: list[PositionLogprobs] = []
            if sr.prompt_logprobs is not None:
                prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, []
            logprobs = result.logprobs.get(sr.request_id)
            updates.append(self._append(req, [result.sampled[sr.request_id]],
                                        [logprobs] if logprobs is not None else [],
                                        prompt_logprobs))
            self._keep_drafts(req, sr, result)
        return updates

    def _keep_drafts(self, req: Request, sr: ScheduledRequest, result: RunnerOutput) -> None:
        """The runner's drafts for the request's next step (a draft model's), and back
        with the slots its pass over them held."""
        if not sr.num_lookahead or req.is_finished:
            return
        assert self.speculator is not None and self.speculator.runner_drafts is not None
        drafts = result.draft_tokens.get(req.request_id)
        if drafts:
            self.speculator.runner_drafts.store(req.request_id, req.num_tokens, drafts)
        self.kv_cache.trim(req.request_id, req.num_tokens)

    def _verified(self, req: Request, sr: ScheduledRequest,
                  result: RunnerOutput) -> RequestUpdate:
        """A decode step with drafts: the accepted drafts and the target's token are the
        request's new tokens, and the KV of the last token and the accepted drafts is
        computed; the slots of the rejected drafts are given back."""
        req.num_draft_tokens -= sr.num_draft_tokens
        tokens = result.verified[sr.request_id]
        num_accepted = len(tokens) - 1
        assert self.speculator is not None
        self.speculator.record(req.request_id, sr.num_draft_tokens, num_accepted)
        req.num_computed_tokens += 1  # the last token; each accepted draft adds its own
        update = self._append(req, tokens, result.verified_logprobs.get(sr.request_id, []),
                              [], num_computed=num_accepted)
        if not req.is_finished:
            self.kv_cache.trim(req.request_id, req.num_tokens)
        return update

    def _append(self, req: Request, tokens: list[int], logprobs: list[PositionLogprobs],
                prompt_logprobs: list[PositionLogprobs], num_computed: int = 0,
                ) -> RequestUpdate:
        """Append new tokens up to the first that stops the request. The first
        `num_computed` of them (accepted drafts) have their KV computed already."""
        reason: FinishReason | None = None
        appended = 0
        for token in tokens:
            req.output_token_ids.append(token)
            appended += 1
            if appended <= num_computed:
                req.num_computed_tokens += 1
            if req.grammar is not None and not req.grammar.accept(token):
                # The mask allowed the token and the matcher then refused it. The fuzzers
                # found the causes in the constraint, not here: llguidance's limits
                # (a row of more than 2,000 items, too many lexer expressions) reached
                # mid-output, or a constraint that spells a special token's text. So the
                # client hears it as its constraint's fault; only this request fails.
                self.running.remove(req)
                self._finish(req, FinishReason.ERROR)
                constraint = req.sampling.constraint
                field = constraint.field if constraint is not None else "constraint"
                return RequestUpdate(
                    req.request_id, req.session_id, finish_reason=FinishReason.ERROR,
                    error_code=INVALID_ARGUMENT,
                    error_message=f"{field}: the output constraint could not be followed "
                                  f"after {len(req.output_token_ids) - 1} tokens (too "
                                  f"complex for the constraint engine's limits, or it "
                                  f"spells a special token's text): {req.grammar.error}")
            reason = self._stop_reason(req, token)
            if reason is not None:
                if reason is FinishReason.STOP_TOKEN:
                    req.stop_token_id = token
                break
        if num_computed:
            self.kv_cache.cache_full_blocks(req)
        if reason is not None:
            self.running.remove(req)
            self._finish(req, reason)
        return RequestUpdate(
            req.request_id, req.session_id, new_token_ids=tuple(tokens[:appended]),
            finish_reason=reason, stop_token_id=req.stop_token_id,
            num_cached_tokens=req.num_cached_tokens, new_logprobs=tuple(logprobs[:appended]),
            prompt_logprobs=prompt_logprobs,
        )

    def _pooled(self, req: Request, result: RunnerOutput) -> RequestUpdate:
        """A pooling request's prompt is done: it ends with its pooled values, and its
        blocks go back at once (full ones stay cached for later prompts)."""
        self.running.remove(req)
        self._finish(req, FinishReason.LENGTH)
        values, shape = result.pooled[req.request_id]
        return RequestUpdate(req.request_id, req.session_id, finish_reason=FinishReason.LENGTH,
                             num_cached_tokens=req.num_cached_tokens, pooled=values,
                             pooled_shape=shape)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        sp = req.sampling
        # A complete constraint ends the request whatever else allows it to go on
        # (ignore_eos, min_tokens): nothing more would be valid.
        if req.grammar is not None and req.grammar.is_stopped:
            return FinishReason.STOP
        # The sampler masks EOS and stop tokens until min_tokens exist; this only
        # guards against a runner that does not.
        if req.num_output_tokens > sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                return FinishReason.EOS_TOKEN
            if token in sp.stop_token_ids:
                return FinishReason.STOP_TOKEN
        if sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens:
            return FinishReason.LENGTH
        if req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.kv_cache.free(req.request_id)
        if self.speculator is not None:
            self.speculator.forget(req.request_id)
        del self.requests[req.request_id]
        self._finished_since_last_step.add(req.request_id)


def _computes_every_token(req: Request) -> bool:
    """Whether the request needs every prompt token's output (prompt logprobs, or
    pooling over all of them), so that no cached prefix may stand in for them."""
    return req.wants_prompt_logprobs or req.pools_every_token
