from __future__ import annotations

import torch

from services.common.sampling import SamplingParams
from services.engine.scheduler.output import ScheduledRequest
from services.engine.worker.sampler import Sampler, TokenMask, allowed_tokens

VOCAB = 50
EOS = 2


def request(
    rid: str = "r",
    output: list[int] | None = None,
    prompt: list[int] | None = None,
    **params: object,
) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=rid, token_ids=[1], start_pos=0, block_ids=[0], sample=True,
        sampling=SamplingParams(**params),  # type: ignore[arg-type]
        prompt_token_ids=prompt or [1], output_token_ids=output or [], eos_token_ids=(EOS,),
    )


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def sample(logits: torch.Tensor, requests: list[ScheduledRequest], seed: int = 0) -> list[int]:
    return Sampler(torch.device("cpu"), seed)(logits, requests).tolist()


def test_greedy_is_argmax() -> None:
    logits = random_logits(3)
    requests = [request(str(i), temperature=0.0) for i in range(3)]
    assert sample(logits, requests) == logits.argmax(-1).tolist()


def test_top_k_one_equals_greedy() -> None:
    logits = random_logits(4)
    requests = [request(str(i), temperature=1.5, top_k=1, seed=i) for i in range(4)]
    assert sample(logits, requests) == logits.argmax(-1).tolist()


def test_seeded_tokens_do_not_depend_on_the_batch() -> None:
    logits = random_logits(1, seed=3)[0]
    seeded = request("s", seed=1234, output=[5, 6, 7])
    alone = sample(logits[None], [seeded], seed=0)
    others = random_logits(3, seed=9)
    batch = torch.stack([others[0], others[1], logits, others[2]])
    crowded = [request("x"), request("y", seed=7), seeded, request("z", temperature=0.0)]
    assert sample(batch, crowded, seed=99)[2] == alone[0]


def test_seeded_draws_vary_with_the_step_and_repeat_after_recompute() -> None:
    flat = torch.zeros(1, VOCAB)
    tokens = [sample(flat, [request(seed=42, output=[0] * n)])[0] for n in range(20)]
    assert len(set(tokens)) > 5
    again = [sample(flat, [request(seed=42, output=[0] * n)])[0] for n in range(20)]
    assert tokens == again


def test_unseeded_requests_follow_the_engine_seed() -> None:
    flat = torch.zeros(8, VOCAB)
    requests = [request(str(i)) for i in range(8)]
    assert sample(flat, requests, seed=1) == sample(flat, requests, seed=1)
    assert sample(flat, requests, seed=1) != sample(flat, requests, seed=2)


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    tokens = torch.tensor(sample(logits, [request(str(i)) for i in range(4000)]))
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03, rtol=0)


def test_top_p_and_min_p_keep_only_the_head() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(300, 1)
    top_p = set(sample(logits, [request(str(i), top_p=0.75) for i in range(300)]))
    assert top_p == {0, 1}
    min_p = set(sample(logits, [request(str(i), min_p=0.35) for i in range(300)]))
    assert min_p == {0, 1}
    top_k = set(sample(logits, [request(str(i), top_k=3) for i in range(300)]))
    assert top_k == {0, 1, 2}


def test_logit_bias_forces_a_token() -> None:
    logits = random_logits(2)
    requests = [request("g", temperature=0.0, logit_bias=((17, 100.0),)),
                request("s", seed=5, logit_bias=((23, 100.0),))]
    assert sample(logits, requests) == [17, 23]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 9], logits[0, 4] = 10.0, 9.0, 8.0
    early = request(temperature=0.0, min_tokens=3, stop_token_ids=(9,), output=[4, 4])
    assert sample(logits, [early]) == [4]
    done = request(temperature=0.0, min_tokens=3, stop_token_ids=(9,), output=[4, 4, 4])
    assert sample(logits, [done]) == [EOS]


def test_penalties() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4], logits[0, 5] = 2.0, 1.9, -1.0
    # Repetition (HF rule): positive logits divided, negative multiplied; prompt counts.
    repeated = request(temperature=0.0, repetition_penalty=2.0, prompt=[3, 5])
    assert sample(logits, [repeated]) == [4]
    # Frequency scales with the count, presence once per distinct output token.
    counted = request(temperature=0.0, frequency_penalty=0.05, output=[3, 3, 3])
    assert sample(logits, [counted]) == [4]
    present = request(temperature=0.0, presence_penalty=0.2, output=[3])
    assert sample(logits, [present]) == [4]
    prompt_only = request(temperature=0.0, presence_penalty=1.0, prompt=[3])
    assert sample(logits, [prompt_only]) == [3]


# ---- output constraints: the token mask --------------------------------------------


def bitmask_of(allowed: list[set[int]]) -> torch.Tensor:
    """Packed int32 rows (bit t % 32 of word t // 32), as llguidance fills them."""
    words = torch.zeros(len(allowed), (VOCAB + 31) // 32, dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            words[row, t // 32] |= 1 << (t % 32)
    # Two's complement into int32, as the bits of a C int32 array.
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def masked_sample(logits: torch.Tensor, requests: list[ScheduledRequest], rows: list[int],
                  allowed: list[set[int]], seed: int = 0) -> list[int]:
    mask = TokenMask(rows, bitmask_of(allowed).numpy())
    return Sampler(torch.device("cpu"), seed)(logits, requests, mask).tolist()


def test_allowed_tokens_unpacks_every_bit_including_the_sign_bit() -> None:
    allowed = [{0, 31, 32, 49}, {5}, set(range(VOCAB))]
    unpacked = allowed_tokens(bitmask_of(allowed).numpy(), VOCAB, torch.device("cpu"))
    for row, tokens in enumerate(allowed):
        assert set(unpacked[row].nonzero().flatten().tolist()) == tokens


def test_masked_rows_sample_only_allowed_tokens_and_other_rows_are_untouched() -> None:
    logits = random_logits(4, seed=5)
    requests = [request("g", temperature=0.0), request("s", temperature=1.0, seed=3),
                request("free", temperature=0.0), request("free_s", temperature=1.0, seed=8)]
    unmasked = sample(logits, requests)
    for trial in range(20):
        allowed = [{trial % VOCAB, 31, 40}, {1, 2 + trial}]
        got = masked_sample(logits, requests, [0, 1], allowed)
        assert got[0] in allowed[0] and got[0] == max(allowed[0], key=lambda t: logits[0, t])
        assert got[1] in allowed[1]
        assert got[2:] == unmasked[2:]


def test_the_mask_wins_over_logit_bias() -> None:
    logits = random_logits(1, seed=1)
    biased = request(temperature=0.0, logit_bias=((7, 1e9),))
    assert sample(logits, [biased]) == [7]
    assert masked_sample(logits, [biased], [0], [{3, 4}]) in ([3], [4])


def test_a_mask_that_min_tokens_empties_falls_back_to_the_mask_alone() -> None:
    # The grammar is complete and only EOS may follow, but min_tokens bans EOS: the
    # grammar wins (the scheduler then ends the request as complete).
    logits = random_logits(2, seed=2)
    requests = [request(str(i), temperature=t, seed=1, min_tokens=5) for i, t in enumerate((0, 1))]
    assert masked_sample(logits, requests, [0, 1], [{EOS}, {EOS}]) == [EOS, EOS]


def test_masking_leaves_the_callers_logits_alone() -> None:
    logits = random_logits(2, seed=4)
    before = logits.clone()
    masked_sample(logits, [request("a", temperature=0.0), request("b", temperature=0.0)],
                  [1], [{0}])
    assert torch.equal(logits, before)  # the runner's logprobs are of these raw logits
