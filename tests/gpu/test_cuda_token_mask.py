"""The structured-output token mask on a CUDA device: unpacked there from the packed
words, it must equal the host's unpacking, and masked sampling must pick the same
tokens as on the CPU. `CORESTREAM_TEST_DEVICE=cpu` runs it on the CPU."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from services.common.sampling import SamplingParams
from services.engine.scheduler.output import ScheduledRequest
from services.engine.worker.sampler import Sampler, TokenMask, allowed_tokens

DEVICE = os.environ.get("CORESTREAM_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
VOCAB = 1000


def random_bitmask(rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 1 << 32, size=(rows, (VOCAB + 31) // 32), dtype=np.uint64)
    # Sparse rows too: a grammar often allows a handful of tokens.
    words[rows // 2:] &= rng.integers(0, 1 << 32, size=words[rows // 2:].shape, dtype=np.uint64)
    return words.astype(np.uint32).view(np.int32)


def test_unpacking_on_the_device_equals_the_host() -> None:
    bitmask = random_bitmask(16, seed=1)
    host = allowed_tokens(bitmask, VOCAB, torch.device("cpu"))
    device = allowed_tokens(bitmask, VOCAB, torch.device(DEVICE))
    assert device.device.type == DEVICE
    assert torch.equal(device.cpu(), host)


def test_masked_greedy_sampling_matches_the_cpu() -> None:
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(3))
    requests = [ScheduledRequest(str(i), [1], 0, [0], True, SamplingParams(temperature=0.0),
                                 [1], []) for i in range(8)]
    mask = TokenMask([0, 2, 3, 7], random_bitmask(4, seed=2))
    expected = Sampler(torch.device("cpu"), 0)(logits, requests, mask).tolist()
    got = Sampler(torch.device(DEVICE), 0)(logits.to(DEVICE), requests, mask).tolist()
    assert got == expected
    allowed = allowed_tokens(mask.bitmask, VOCAB, torch.device("cpu"))
    for i, row in enumerate(mask.rows):
        assert allowed[i, got[row]]
