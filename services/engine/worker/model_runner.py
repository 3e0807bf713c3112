"""ModelRunner: loads the model, owns the KV cache, and runs one step per call.

A step flattens every scheduled request into one batch (tokens, positions, cache
slots, block tables) built on the host in one pass (batch.py), runs a single forward
over all of them, samples from the last position of each request that asks for a
token, and brings the sampled ids to the host with the step's only device sync. The
KV cache gets the blocks that its memory budget holds (kv_cache_memory.py). Requests
that ask for logprobs (of sampled or of prompt tokens) cost extra work and copies;
a step where none asks does none of it. On CPU, a decode step whose every row is
plain greedy skips all of that: the scheduler's numbers go as lists to the C++ decode
op, which returns each row's argmax (`_greedy_decode`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from corestream_kernels.cpu_linear import is_panels_only, warm_onednn

from services.common.model_info import ModelInfo, load_model_info
from services.common.pooling import Pooler, PoolingParams, PoolingType
from services.common.sampling import SamplingParams
from services.common.tiny_checkpoint import resolve_model
from services.engine.models.attention_metadata import AttentionMetadata
from services.engine.models.checkpoint_layout import CheckpointLayout
from services.engine.models.decoder_config import DecoderConfig
from services.engine.models.linear import linear_layers, panels_of, quantized_blocks
from services.engine.models.loader import load_experts, load_model, torch_dtype
from services.engine.models.moe import SparseMoeForCausalLM
from services.engine.models.protocol import CausalLM, GreedyDecoder
from services.engine.parallel.collectives import Collectives
from services.engine.parallel.dp_group import current_dp_group
from services.engine.parallel.expert_parallel import uneven_split
from services.engine.scheduler.output import (
    GrammarMask,
    PositionLogprobs,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from services.engine.weights.sources import SourceSpec, open_source
from services.engine.weights.staging import (
    WeightStaging,
    WeightUpdateError,
    drop_weights,
    dropped_parameters,
    why_not_updatable,
)
from services.engine.weights.transfer_group import TransferGroupSpec, join_transfer_group
from services.engine.worker.batch import (
    HostBatch,
    PromptRows,
    StepArrays,
    flatten_batch,
    greedy_decode_rows,
)
from services.engine.worker.config import RunnerConfig
from services.engine.worker.cpu_threads import release_openmp_pool, resolve_num_threads
from services.engine.worker.draft_model import DraftModel, resolve_draft
from services.engine.worker.dummy_batch import dummy_forward
from services.engine.worker.heap import release_free_memory
from services.engine.worker.huge_pages import HugePageReport, collapse_in_background
from services.engine.worker.kv_cache_dtype import kv_cache_dtype
from services.engine.worker.kv_cache_memory import KVCacheLayout, available_host_memory
from services.engine.worker.logprobs import position_logprobs, prompt_logprobs
from services.engine.worker.pooling import PoolingHead
from services.engine.worker.profiler import Profiler
from services.engine.worker.resident_pages import resident_bytes
from services.engine.worker.sampler import Sampler, TokenMask

logger = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but torch sees no CUDA device")
    return torch.device(name)


class Followers(Protocol):
    """The other tensor-parallel ranks, which mirror this runner's model calls (see
    `services.engine.executor.step_channel`); None at tensor_parallel_size 1."""

    def forward(self, arrays: StepArrays) -> None: ...

    def logits(self, rows: Sequence[int]) -> None: ...

    def dummy(self) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class _Batch:
    """A step's batch on the device, with the host batch it came from."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    host: HostBatch

    @property
    def arrays(self) -> StepArrays:
        return self.host.arrays


class ModelRunner:
    def __init__(self, config: RunnerConfig, followers: Followers | None = None,
                 pooler: Pooler | None = None, draft_model: str = "") -> None:
        """`followers`: the tensor-parallel ranks that mirror this one's model calls,
        when this runner is rank 0 of several. `pooler`: run the model as a pooling
        model (services/common/pooling.py): no LM head, no sampler. `draft_model`: the
        checkpoint that proposes draft tokens (speculative decoding's draft_model)."""
        self.config = config
        self._followers = followers
        self.pooler = pooler
        path = resolve_model(config.model)
        info = load_model_info(path)
        if config.max_model_len > info.max_model_len:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the checkpoint's "
                f"{info.max_model_len}"
            )
        if config.max_model_len:
            info = dataclasses.replace(info, max_model_len=config.max_model_len)
        self._model_info = info
        self._device = pick_device(config.device)
        # torch.device.type builds its string anew on every read: this runs per tensor
        # per step.
        self._on_cpu = self._device.type == "cpu"
        num_threads = resolve_num_threads(config.num_threads)
        if self._on_cpu and num_threads is not None:
            # The intra-op pool is per process: this sets it for every runner in it.
            torch.set_num_threads(num_threads)
        self._dtype = torch_dtype(info.dtype if config.dtype == "auto" else config.dtype)
        self._kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self._dtype, self._device,
                                        info.gguf)
        if draft_model and (followers is not None or pooler is not None):
            raise ValueError("speculative_config: a draft model runs with "
                             "tensor_parallel_size 1 on a generating engine")
        # Checked before anything loads (a bad draft is a flag to fix, found at once).
        draft = resolve_draft(draft_model, info) if draft_model else None
        with torch.inference_mode():
            self.model: CausalLM = load_model(path, self._dtype, self._device, info.max_model_len,
                                              config.quantization, pooler)
        self._pooling = (PoolingHead(pooler, getattr(self.model, "score", None))
                         if pooler is not None else None)
        self.kv_caches = self._allocate_kv_cache(self.model.config)
        self.draft = (DraftModel(draft, info, self._dtype, self._device, self.num_blocks,
                                 self.block_size) if draft is not None else None)
        self.huge_pages: Future[HugePageReport] | None = None
        if self._on_cpu and config.huge_pages:
            # Only once nothing above can fail: a process that exits while the thread
            # copies weights aborts (a flag error must end in its one-line message).
            # Plain weights, the panels of the packed ones (opaque to everything else)
            # and of the panels-only ones (stand-ins, with nothing behind them), and the
            # quantized layers' blocks (grouped copies on the heap; a file's memory map
            # is not anonymous memory and stays as it is); the draft model's alike.
            models = self._models()
            self.huge_pages = collapse_in_background(
                [p for m in models for p in m.parameters()
                 if not p.is_mkldnn and not is_panels_only(p)]
                + [t for m in models for t in (*panels_of(m), *quantized_blocks(m))])
        self.sampler = Sampler(self._device, config.seed)
        # A model that runs a whole greedy decode step from the scheduler's lists (the C++
        # decode op with its head, on CPU); tensor-parallel followers must mirror every
        # forward and logits call, so not with them.
        self._decode_greedy = (self.model.decode_greedy
                               if followers is None and self._on_cpu and pooler is None
                               and isinstance(self.model, GreedyDecoder) else None)
        self._profiler: Profiler | None = None
        self._staging: WeightStaging | None = None
        self._transfer_group: Collectives | None = None
        logger.info(
            "model runner ready: %s on %s (%s, %d CPU threads), %d KV blocks of %d tokens",
            info.name, self.device, self.dtype, torch.get_num_threads(), self.num_blocks,
            self.block_size,
        )

    def settle(self) -> None:
        """Wait for what the runner does in the background (the weights' move onto huge
        pages): benchmarks time steps only after it."""
        if self.huge_pages is not None:
            self.huge_pages.exception()

    def execute_dummy(self) -> None:
        """A forward over zero tokens: an idle expert-parallel rank's share of a step."""
        if self._followers is not None:
            self._followers.dummy()
        dummy_forward(self.model, self.kv_caches)

    def close(self) -> None:
        """Nothing to release: the model and cache go with the process."""

    def describe_stall(self) -> str:
        return ""  # one process: the stacks the watchdog dumps say it all

    def rank_progress(self) -> list[int]:
        return []  # rank 0 of several reports through its TensorParallelExecutor

    # ---- live weight updates (services/engine/weights) -----------------------------

    def open_weight_update(self) -> None:
        """Start staging an update (any earlier one not committed is dropped)."""
        self._staging = WeightStaging(self.model, self._dtype, self._device)

    def join_weight_transfer(self, spec: TransferGroupSpec) -> None:
        """Join a trainer's weight-transfer group (blocks until every rank has); any thread.
        A group joined before is dropped (its trainer may be gone)."""
        self._transfer_group = None
        tp = self.model.tp
        self._transfer_group = join_transfer_group(
            spec, tp.rank if tp is not None else 0, tp.world_size if tp is not None else 1,
            self._device)

    def stage_weights(self, spec: SourceSpec) -> dict[str, Any]:
        """Check the source's announced tensors, then take them all; any thread (the model
        serves on meanwhile). Raises WeightUpdateError (naming the tensor) for an update
        that does not fit, after taking what the sender sends anyway."""
        staging = self._staging
        if staging is None:
            raise WeightUpdateError("no weight update is open (start one first)")
        source = open_source(spec, self._model_info.architectures, self._transfer_group)
        try:
            staging.check_all(source.wanted)
        except WeightUpdateError:
            source.drain()
            raise
        for name, tensor in source.tensors():
            staging.add(name, tensor)
        staging.prepare()  # here, off the loop, rather than in the commit between steps
        return {"num_tensors": staging.num_tensors, "num_bytes": staging.num_bytes}

    def commit_weights(self) -> list[str]:
        """Swap the staged tensors in; only between steps. Returns the parameters
        replaced."""
        staging, self._staging = self._staging, None
        if staging is None:
            raise WeightUpdateError("no weight update is open (start one first)")
        return staging.commit()

    def discard_weights(self) -> None:
        self._staging = None

    # ---- sleep (services/engine/core/sleep.py) --------------------------------------

    def sleep(self, level: int) -> dict[str, int]:
        """Free the KV cache (level 1), and the weights too (level 2), between steps with
        no request holding KV blocks. Returns the bytes freed of each (and of the cache,
        on CPU, those its pages held: the pages written so far)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if level == 2 and (why := why_not_updatable(self.model)):
            raise WeightUpdateError(
                "sleep level 2 drops the weights, which an update or a reload from the "
                f"checkpoint must bring back, and this engine can do neither: {why}")
        freed = {"kv_cache_bytes": 0, "kv_cache_resident_bytes": 0, "weights_bytes": 0}
        if self.kv_caches:
            freed["kv_cache_bytes"] = sum(c.numel() * c.element_size() for c in self.kv_caches)
            if self._on_cpu:
                freed["kv_cache_resident_bytes"] = sum(
                    resident_bytes(c.data_ptr(), c.numel() * c.element_size())
                    for c in self.kv_caches)
            # The only references: the C++ decode op's binding goes with the next line.
            self.kv_caches = []
        self.model.model.forget_decode_op()
        if self.draft is not None:
            freed["kv_cache_bytes"] += self.draft.cache_bytes
            self.draft.sleep()
        if level == 2:
            self._staging = None
            freed["weights_bytes"] = drop_weights(self.model)
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            # A large cache was mapped on its own and is unmapped as it is freed; a small
            # one (or the weights) went back to the heap, which keeps what steps free
            # (heap.py): trimmed here, so the process's RSS drops at once either way.
            release_free_memory()
        return freed

    def wake_kv_cache(self) -> dict[str, int]:
        """Allocate the KV cache again, as at start (zeros, same blocks)."""
        if not self.kv_caches:
            self.kv_caches = [self._zeros(self._kv_shape)
                              for _ in range(self.model.config.num_hidden_layers)]
        num_bytes = sum(c.numel() * c.element_size() for c in self.kv_caches)
        if self.draft is not None:
            self.draft.wake()
            num_bytes += self.draft.cache_bytes
        return {"kv_cache_bytes": num_bytes}

    @property
    def weights_dropped(self) -> bool:
        return bool(dropped_parameters(self.model))

    def weight_layout(self) -> CheckpointLayout | None:
        return getattr(self.model, "checkpoint_layout", None)

    def limit_num_blocks(self, num_blocks: int) -> None:
        """Keep only the first `num_blocks` KV blocks: tensor-parallel ranks allocate
        the least that any of them can afford, so that one block table fits all."""
        if num_blocks < self.num_blocks:
            self.kv_caches = [cache[:, :num_blocks].clone() for cache in self.kv_caches]
            self._kv_shape = (self._kv_shape[0], num_blocks, *self._kv_shape[2:])
            logger.info("KV cache: %d blocks, the least any tensor-parallel rank affords",
                        num_blocks)

    def any_rank_has_work(self, has_work: bool) -> bool:
        """Whether any rank of the DP group has work (this rank's answer alone without
        a group); every rank must call it at the same step."""
        group = current_dp_group()
        if group is None:
            return has_work
        return bool(group.all_reduce(torch.tensor([int(has_work)], dtype=torch.int64)).item())

    def reform_group(self, state: list[int], shrink: bool = False,
                     members: list[int] | None = None) -> tuple[int, list[list[int]]]:
        """Re-form the DP group after a failed step (every live rank calls this) and
        gather each rank's `state`: (the new epoch, every rank's state in rank order).
        Without a group: (0, [state]).

        `shrink`: the missing ranks had their time; the group may go on without them
        (`Collectives.reform`) if the ranks that are back can hold every expert between
        them, each loading from the checkpoint the experts it owns in the smaller group.
        `members`: the group goes on as these first ranks (decided by the group of this
        engine's rank 0; this is a tensor-parallel worker's group)."""
        group = current_dp_group()
        if group is None:
            return 0, [state]
        before = group.members
        imposed = members if members is not None and members != before else None
        epoch = group.reform(self._can_hold_experts if shrink else None, imposed)
        if group.members != before and isinstance(self.model, SparseMoeForCausalLM):
            with torch.inference_mode():
                load_experts(self.model, resolve_model(self.config.model), self._dtype,
                             self._device)
            self._staging = None  # staged against the experts it held before
        gathered = group.all_gather(torch.tensor(state, dtype=torch.int64))
        return epoch, gathered.tolist()

    def _can_hold_experts(self, members: list[int]) -> str | None:
        """Why `members` ranks cannot serve this model's experts between them; None if
        they can."""
        moe = getattr(self.model.config, "moe", None)
        if moe is None:
            return None
        return uneven_split(moe.num_experts, len(members))

    def start_profile(self, folder: Path, name: str) -> dict[str, Any]:
        """Start the torch profiler (the profile utility call)."""
        if self._profiler is None or not self._profiler.running:
            self._profiler = Profiler(folder, name)
        return self._profiler.start()

    def stop_profile(self) -> dict[str, Any]:
        if self._profiler is None:
            raise ValueError("no profile is running; start one first")
        return self._profiler.stop()

    @property
    def num_blocks(self) -> int:
        return self._kv_shape[1]  # also while asleep, with the cache freed

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def device(self) -> str:
        return str(self._device)

    @property
    def dtype(self) -> str:
        return str(self._dtype).removeprefix("torch.")

    def _allocate_kv_cache(self, model_config: DecoderConfig) -> list[torch.Tensor]:
        layout = KVCacheLayout(model_config.num_hidden_layers, self.block_size,
                               self.model.local_kv_heads, model_config.head_dim,
                               self._kv_dtype.itemsize)
        budget = self.config.kv_cache_budget
        kv_bytes = budget.resolve(self._free_memory)
        tp = self.model.tp
        if tp is not None and self._device.type == "cpu":
            # Tensor-parallel ranks on CPU share the host's memory: the budget is the
            # engine's, and each rank holds 1/N of it (on CUDA each rank has a device).
            kv_bytes //= tp.world_size
        if self.pooler is not None and budget.is_auto:
            # A pooling request holds its blocks only until its last chunk is pooled, so
            # beyond max_num_seqs whole prompts the cache would hold nothing but prefix
            # entries, and on CPU each block's first write costs page faults (the pooling
            # benchmark ran ~10% slower on a fresh 4 GiB cache).
            prompt_blocks = layout.sequence_blocks(self.model_info.max_model_len)
            kv_bytes = min(kv_bytes, layout.block_bytes * prompt_blocks * self.config.max_num_seqs)
        num_blocks = layout.num_blocks(kv_bytes, self.model_info.max_model_len,
                                       self.config.kv_cache_memory)
        logger.info("KV cache: kv_cache_memory %r = %d bytes = %d blocks of %d tokens, %s",
                    self.config.kv_cache_memory, kv_bytes, num_blocks, self.block_size,
                    str(self._kv_dtype).removeprefix("torch."))
        # Zeros, not empty: attention multiplies masked-out slots by zero weights, and
        # uninitialized memory may hold NaN, which would survive that product.
        self._kv_shape = layout.block_shape(num_blocks)
        return [self._zeros(self._kv_shape) for _ in range(model_config.num_hidden_layers)]

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A KV cache tensor of `shape`, zeros."""
        if self._device.type != "cpu":
            return torch.zeros(shape, dtype=self._kv_dtype, device=self._device)
        # numpy's zeros is calloc: a large block comes from fresh zero pages that the
        # kernel maps only when first written, so a cache of several GiB costs the
        # memory its used blocks take (torch.zeros would write, and commit, all of it).
        # Over-allocated by a cache line so that the cache can start on one (calloc
        # aligns to 16 bytes), as torch's own allocator does.
        num_bytes = math.prod(shape) * self._kv_dtype.itemsize
        raw = np.zeros(num_bytes + 64, dtype=np.uint8)
        start = -raw.ctypes.data % 64
        return torch.from_numpy(raw[start:start + num_bytes]).view(self._kv_dtype).view(shape)

    def _free_memory(self) -> int:
        """Bytes still free on the device, after the weights are loaded."""
        if self._device.type == "cuda":
            return torch.cuda.mem_get_info(self._device)[0]
        return available_host_memory()

    def _models(self) -> list[torch.nn.Module]:
        """The target model, and the draft model where there is one."""
        return [self.model] + ([self.draft.model] if self.draft is not None else [])

    def warm_onednn(self, max_rows: int) -> None:
        """oneDNN's primitives for inputs of up to `max_rows` rows, built now (CPU only;
        `corestream_kernels.cpu_linear.warm_onednn`)."""
        if not self._on_cpu or max_rows < 1:
            return
        start = time.perf_counter()
        calls = warm_onednn([layer for m in self._models() for layer in linear_layers(m)],
                            max_rows)
        if calls:
            logger.info("oneDNN: %d layer shapes x row buckets, up to %d rows, built in "
                        "%.2f s", calls, max_rows, time.perf_counter() - start)

    def warmup(self, onednn_rows: int = 0) -> None:
        """One small prefill and one decode, so first-request latency excludes lazy setup;
        first oneDNN's primitives for up to `onednn_rows` rows (`warm_onednn`).

        On CPU it ends by releasing the calling thread's OpenMP workers
        (`cpu_threads.release_openmp_pool`): the engine loads and warms the model on one
        thread and then steps it on its busy loop's, and two pools would throttle both.
        """
        self.warm_onednn(onednn_rows)
        num_tokens = min(8, self.model_info.max_model_len - 1)
        blocks = list(range(-(-(num_tokens + 1) // self.block_size)))
        greedy = SamplingParams(temperature=0.0)
        prompt = [0] * num_tokens

        pooling = (PoolingParams(self.pooler.task, PoolingType.LAST, normalize=False)
                   if self.pooler is not None else None)

        def step(tokens: list[int], start: int, lookahead: int = 0) -> None:
            request = ScheduledRequest(
                "warmup", tokens, start, blocks, True, greedy, prompt, [], pooling=pooling,
                num_lookahead=lookahead)
            self.execute(SchedulerOutput([request]))

        step(prompt, 0)
        if pooling is None:
            # The draft model's first proposals too (its lookahead fits the blocks).
            step([0], num_tokens, 1 if self.draft is not None else 0)
            if self.draft is not None:
                self.draft.forget(["warmup"])
        if self._device.type == "cpu":
            release_openmp_pool()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run every scheduled request in one forward; the sampled token of each that
        samples, and the logprobs that requests asked for (and the draft model's
        proposals for those that want them)."""
        if self.draft is None:
            return self._run(out)
        self.draft.forget(list(out.finished_request_ids))
        result = self._run(out)
        wanted = [(sr, result.verified.get(sr.request_id) or [result.sampled[sr.request_id]])
                  for sr in out.requests if sr.num_lookahead]
        if wanted:
            start = time.perf_counter()
            result.draft_tokens.update(self.draft.propose(wanted))
            result = dataclasses.replace(
                result, sample_s=result.sample_s + time.perf_counter() - start)
        return result

    def _run(self, out: SchedulerOutput) -> RunnerOutput:
        if self._pooling is not None:
            self._pooling.forget(out.finished_request_ids)
        if out.is_empty:
            return RunnerOutput()
        if self._pooling is not None:
            with torch.inference_mode():
                return self._execute_pooling(out.requests, self._pooling)
        if self._decode_greedy is not None and out.grammar_mask is None:
            greedy = self._greedy_decode(out.requests)
            if greedy is not None:
                return greedy
        with torch.inference_mode():
            return self._execute(out)

    def _greedy_decode(self, requests: Sequence[ScheduledRequest]) -> RunnerOutput | None:
        """A decode step whose every row is greedy without logit processors or logprobs,
        straight from the scheduler's numbers to the model's argmax (`decode_greedy`):
        no batch tensors, no logits or sampler in Python, no inference mode to enter.
        These cost ~0.2 ms of a ~4.5 ms single-stream step, on the caches the weights
        have just streamed through. None (nothing run) where it does not apply."""
        assert self._decode_greedy is not None
        start = time.perf_counter()
        rows = greedy_decode_rows(requests, self.block_size, self.model_info.max_model_len)
        if rows is None:
            return None
        tokens = self._decode_greedy(self.kv_caches, rows.input_ids, rows.positions,
                                     rows.slot_mapping, rows.block_tables, rows.seq_lens)
        if tokens is None:
            return None
        # The argmax is part of the one call: all of it counts as the forward.
        result = RunnerOutput(forward_s=time.perf_counter() - start)
        row = 0
        for r in requests:
            k = r.num_draft_tokens
            if k:
                result.verified[r.request_id] = accepted_prefix(
                    tokens[row : row + k + 1], r.token_ids[1:])
            else:
                result.sampled[r.request_id] = tokens[row]
            row += k + 1
        return result

    def _execute(self, out: SchedulerOutput) -> RunnerOutput:
        start = time.perf_counter()
        batch = self._prepare(out.requests)
        if self._followers is not None:
            self._followers.forward(batch.arrays)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_caches)
        forwarded = time.perf_counter()
        host = batch.host
        prompt_logprobs = self._prompt_logprobs(hidden, host.prompt)
        if not host.sampled:
            return RunnerOutput(prompt_logprobs=prompt_logprobs, forward_s=forwarded - start,
                                sample_s=time.perf_counter() - forwarded)
        if any(r.num_draft_tokens for r in host.sampled):
            return self._verify(hidden, out.grammar_mask, host, prompt_logprobs,
                                forwarded - start)
        logits = self.logits_at(hidden, host.sample_rows)
        mask = self._token_mask(out.grammar_mask, host.sampled)
        token_tensor = self.sampler(logits, host.sampled, mask)
        tokens = token_tensor.tolist()
        return RunnerOutput(
            sampled={r.request_id: t for r, t in zip(host.sampled, tokens, strict=True)},
            logprobs=self._sampled_logprobs(logits, token_tensor, host.sampled),
            prompt_logprobs=prompt_logprobs, forward_s=forwarded - start,
            sample_s=time.perf_counter() - forwarded)

    def _verify(self, hidden: torch.Tensor, grammar_mask: GrammarMask | None,
                host: HostBatch, prompt_logprobs: dict[str, list[PositionLogprobs]],
                forward_s: float) -> RunnerOutput:
        """Sampling for a step with draft tokens: every position of a request with
        drafts is sampled as if the drafts before it had been generated (so penalties,
        min_tokens and a seed's per-token draws see what they would without drafts), and
        its drafts are kept up to the first one its sample differs from, whose sample
        takes its place. A draft is accepted exactly when the target would have drawn
        it, so the output has the target's distribution (and, greedy or seeded, its
        very tokens)."""
        started = time.perf_counter()
        rows: list[int] = []
        row_requests: list[ScheduledRequest] = []
        for r, last in zip(host.sampled, host.sample_rows, strict=True):
            k = r.num_draft_tokens
            drafts = r.token_ids[len(r.token_ids) - k:]
            for i in range(k + 1):
                rows.append(last - k + i)
                row_requests.append(r if i == 0 else dataclasses.replace(
                    r, output_token_ids=(*r.output_token_ids, *drafts[:i])))
        logits = self.logits_at(hidden, rows)
        token_tensor = self.sampler(logits, row_requests,
                                    self._token_mask(grammar_mask, row_requests))
        tokens = token_tensor.tolist()
        logprobs = self._row_logprobs(logits, token_tensor, row_requests)
        result = RunnerOutput(prompt_logprobs=prompt_logprobs, forward_s=forward_s)
        row = 0
        for r in host.sampled:
            k = r.num_draft_tokens
            targets = tokens[row : row + k + 1]
            if not k:
                result.sampled[r.request_id] = targets[0]
                if (lp := logprobs[row]) is not None:
                    result.logprobs[r.request_id] = lp
                row += 1
                continue
            verified = result.verified[r.request_id] = accepted_prefix(
                targets, r.token_ids[len(r.token_ids) - k:])
            if r.sampling.logprobs is not None:
                result.verified_logprobs[r.request_id] = [
                    lp for lp in logprobs[row : row + len(verified)] if lp is not None]
            row += k + 1
        return dataclasses.replace(result, sample_s=time.perf_counter() - started)

    def _execute_pooling(self, requests: Sequence[ScheduledRequest],
                         pooling: PoolingHead) -> RunnerOutput:
        """A pooling engine's step: the forward's hidden states go into each request's
        pool; requests whose prompt ended get their result."""
        start = time.perf_counter()
        batch = self._prepare(requests)
        if self._followers is not None:
            self._followers.forward(batch.arrays)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_caches)
        pooled = pooling.pool(hidden, requests, batch.host.query_start_loc)
        return RunnerOutput(pooled=pooled, forward_s=time.perf_counter() - start)

    def _token_mask(self, grammar_mask: GrammarMask | None,
                    sampled: list[ScheduledRequest]) -> TokenMask | None:
        """The step's grammar bitmask (waited for only now: it was built while the model
        ran), addressed by sampled row."""
        if grammar_mask is None:
            return None
        bitmask = grammar_mask.bitmask.result()
        # A request with drafts has consecutive rows, and so many mask rows in a row.
        row_of: dict[str, int] = {}
        for i, r in enumerate(sampled):
            row_of.setdefault(r.request_id, i)
        seen: dict[str, int] = {}
        rows = []
        for rid in grammar_mask.request_ids:
            rows.append(row_of[rid] + seen.get(rid, 0))
            seen[rid] = seen.get(rid, 0) + 1
        return TokenMask(rows, bitmask)

    def _sampled_logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, requests: list[ScheduledRequest]
    ) -> dict[str, PositionLogprobs]:
        found = self._row_logprobs(logits, tokens, requests)
        return {r.request_id: lp for r, lp in zip(requests, found, strict=True)
                if lp is not None}

    def _row_logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, requests: list[ScheduledRequest]
    ) -> list[PositionLogprobs | None]:
        """Each row's sampled token's logprobs, None for rows whose request did not ask.
        The sampler leaves `logits` untouched, so these are the raw ones."""
        asking = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
        out: list[PositionLogprobs | None] = [None] * len(requests)
        if not asking:
            return out
        rows = torch.tensor(asking, device=logits.device)
        num_top = [requests[i].sampling.logprobs or 0 for i in asking]
        found = position_logprobs(logits[rows], tokens[rows], num_top)
        for i, lp in zip(asking, found, strict=True):
            out[i] = lp
        return out

    def _prompt_logprobs(
        self, hidden: torch.Tensor, prompt: PromptRows
    ) -> dict[str, list[PositionLogprobs]]:
        if not prompt.spans:
            return {}
        found = prompt_logprobs(prompt.rows, prompt.next_token_ids, prompt.num_top,
                                lambda rows: self.logits_at(hidden, rows))
        out: dict[str, list[PositionLogprobs]] = {}
        start = 0
        for request_id, count in prompt.spans:
            out[request_id] = found[start : start + count]
            start += count
        return out

    def logits_at(self, hidden: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """float32 logits `[len(rows), vocab]` at `rows` of a forward's hidden states."""
        if self._followers is not None:
            self._followers.logits(rows)
        if len(rows) == hidden.shape[0] and list(rows) == list(range(len(rows))):
            return self.model.compute_logits(hidden)  # every row in order (decode): no gather
        index = self._to_device(np.asarray(rows, dtype=np.int64))
        return self.model.compute_logits(hidden.index_select(0, index))

    @torch.inference_mode()
    def forward(self, arrays: StepArrays) -> torch.Tensor:
        """A follower's forward over the batch its leader sent: hidden states `[T, H]`."""
        input_ids, positions, meta = self._device_inputs(
            arrays, arrays.seq_lens.tolist(), arrays.query_start_loc.tolist())
        return self.model(input_ids, positions, meta, self.kv_caches)

    def _device_inputs(
        self, arrays: StepArrays, seq_lens: list[int], query_start_loc: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(token ids, positions, attention metadata) of `arrays` on the device; the two
        lists are the same numbers as their arrays, for the host-side attention loop."""
        meta = AttentionMetadata(
            slot_mapping=self._to_device(arrays.slot_mapping),
            block_tables=self._to_device(arrays.block_tables),
            seq_lens=self._to_device(arrays.seq_lens),
            query_start_loc=self._to_device(arrays.query_start_loc),
            seq_lens_host=seq_lens,
            query_start_loc_host=query_start_loc,
        )
        return self._to_device(arrays.input_ids), self._to_device(arrays.positions), meta

    def _prepare(self, requests: Sequence[ScheduledRequest]) -> _Batch:
        host = flatten_batch(requests, self.block_size, self.model_info.max_model_len)
        input_ids, positions, meta = self._device_inputs(host.arrays, host.seq_lens,
                                                         host.query_start_loc)
        return _Batch(input_ids, positions, meta, host)

    def _to_device(self, values: np.ndarray) -> torch.Tensor:
        # numpy, not torch.tensor, on the host: it turns Python lists into arrays
        # several times faster.
        tensor = torch.from_numpy(values)
        if self._on_cpu:
            return tensor
        # Pinned source + non_blocking: the copy overlaps and does not sync the host.
        return tensor.pin_memory().to(self._device, non_blocking=True)


def accepted_prefix(targets: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The verified tokens of a request with drafts: the target's tokens (one per
    position, `len(drafts) + 1`) up to and with the first that differs from its draft."""
    accepted = 0
    while accepted < len(drafts) and targets[accepted] == drafts[accepted]:
        accepted += 1
    return list(targets[: accepted + 1])
