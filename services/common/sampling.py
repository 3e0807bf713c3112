"""Sampling parameters as the services see them, free of protobuf and torch.

The frontend converts the wire message into this dataclass, validates it, and the
engine converts it back on arrival. Defaults live here, so that an unset proto
field and an absent Python argument mean the same thing everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.constraints import OutputConstraint


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 keeps every token."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1 on the wire) keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top probability."""
    seed: int | None = None
    """Per-request seed; None draws from the engine's generator."""
    max_tokens: int | None = None
    """Tokens to generate at most; None means up to the end of the context."""
    min_tokens: int = 0
    """EOS and stop tokens are masked until this many tokens exist."""
    stop: tuple[str, ...] = ()
    """Stop strings, matched by the frontend on detokenized text."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation, besides the model's EOS."""
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    """(token id, bias) pairs; a tuple so that the dataclass stays hashable."""
    n: int = 1
    """Independent samples of the prompt; the frontend fans them out, engines see 1."""
    logprobs: int | None = None
    """Report each generated token's logprob plus this many top alternatives; None: none."""
    prompt_logprobs: int | None = None
    """Report each prompt token's logprob plus this many top alternatives; None: none."""
    constraint: OutputConstraint | None = None
    """Structured output: the output follows this constraint; None: free text."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
