"""SpeculativeConfig: `--speculative-config`, a JSON object in vLLM's shape."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    """ngram: prompt lookup over the request's own tokens; draft_model: a smaller
    checkpoint of the same vocabulary (`model`) proposes greedily."""
    num_speculative_tokens: int
    """Most draft tokens verified per request per step."""
    prompt_lookup_min: int = 2
    """Shortest suffix of the request's tokens that must recur for a proposal."""
    prompt_lookup_max: int = 5
    """Longest suffix looked up (the longest match wins, then the latest)."""
    disable_by_batch_size: int = 4
    """No proposals in a step with more running requests than this: a bigger batch is
    no longer bound by reading the weights, and verifying drafts costs compute."""
    min_acceptance_rate: float = 0.3
    """A request whose recent proposals were accepted less often than this (a moving
    average over its verify steps) stops proposing for a while (see speculator.py)."""
    model: str = ""
    """draft_model: the draft checkpoint (a folder, a GGUF file or a hub id in the local
    cache), with the target's tokenizer."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got "
                             f"{self.method!r}")
        if not isinstance(self.model, str):
            raise ValueError(f"speculative_config: model must be a path, got {self.model!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method draft_model needs a model (the "
                             "draft checkpoint's path)")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config: model is for method draft_model; ngram "
                             "needs none")
        for name, low, high in (("num_speculative_tokens", 1, 16),
                                ("prompt_lookup_min", 1, 64),
                                ("prompt_lookup_max", 1, 64),
                                ("disable_by_batch_size", 1, 1 << 20)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"speculative_config: {name} must be an integer in "
                                 f"[{low}, {high}], got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not "
                f"exceed prompt_lookup_max ({self.prompt_lookup_max})")
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
            raise ValueError("speculative_config: min_acceptance_rate must be a number in "
                             f"[0, 1], got {rate!r}")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig | None:
        """The config of `--speculative-config`'s JSON text; None for an empty one.
        Raises ValueError naming the key at fault."""
        if not text.strip():
            return None
        try:
            raw: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("speculative_config must be a JSON object, got "
                             f"{type(raw).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {known}")
        for required in ("method", "num_speculative_tokens"):
            if required not in raw:
                raise ValueError(f"speculative_config: {required!r} is required")
        if isinstance(raw.get("prompt_lookup_max"), int) and "prompt_lookup_min" not in raw:
            raw["prompt_lookup_min"] = min(cls.prompt_lookup_min, raw["prompt_lookup_max"])
        return cls(**raw)
