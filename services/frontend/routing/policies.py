"""How the balancer chooses among the engines that may take a request.

- `least_load`: the lowest load score (see balancer.load_score).
- `round_robin`: each engine in turn, whatever its load.
- `cache_aware`: the lowest cost, where cost = load score + the prompt tokens the
  engine would still have to prefill (those it does not hold in its prefix cache)
  weighted by `prefill_tokens_per_request`. A long shared prefix thus keeps its
  requests on the engine that holds it, while a request nobody holds goes to the
  least loaded engine. When loads are badly imbalanced load wins: an engine loaded
  well beyond the least loaded one (by `BALANCE_RATIO` and `BALANCE_SLACK`) is not
  chosen for its cache, or a popular prefix would pile every request onto one engine.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

# An engine is "badly" more loaded than the least loaded one past ratio * least + slack.
BALANCE_RATIO = 1.5
BALANCE_SLACK = 4.0
# Costs closer than this are a tie (sums of counts and weights).
TIE = 1e-9


class RoutingPolicy(enum.StrEnum):
    CACHE_AWARE = "cache_aware"
    LEAST_LOAD = "least_load"
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True, slots=True)
class Option:
    """One engine that may take the request."""

    load: float
    cached_tokens: int = 0
    """Leading prompt tokens the engine holds in its prefix cache (from the index)."""


@dataclass(frozen=True, slots=True)
class Choice:
    index: int
    reason: str


def least_load(options: Sequence[Option]) -> Choice:
    """The first of the least loaded (the caller orders options to rotate ties)."""
    lowest = min(o.load for o in options)
    index = next(i for i, o in enumerate(options) if o.load <= lowest + TIE)
    return Choice(index, "least_load")


def cache_aware(options: Sequence[Option], num_prompt_tokens: int,
                prefill_tokens_per_request: float) -> Choice:
    """The lowest load plus uncached prefill, among the engines not badly overloaded."""
    lowest = min(o.load for o in options)
    limit = lowest * BALANCE_RATIO + BALANCE_SLACK
    best_cached = max(o.cached_tokens for o in options)
    costs = [o.load + (num_prompt_tokens - o.cached_tokens) / prefill_tokens_per_request
             if o.load <= limit + TIE else float("inf") for o in options]
    cheapest = min(costs)
    index = next(i for i, cost in enumerate(costs) if cost <= cheapest + TIE)
    cached = options[index].cached_tokens
    if best_cached == 0:
        reason = "least_load: no engine holds a prefix of the prompt"
    elif cached == best_cached:
        reason = f"cache_aware: holds {cached} of {num_prompt_tokens} prompt tokens"
    elif any(o.cached_tokens == best_cached and c == float("inf")
             for o, c in zip(options, costs, strict=True)):
        reason = (f"cache_aware: load imbalance; the engine holding {best_cached} prompt "
                  f"tokens is overloaded, this one holds {cached}")
    else:
        reason = (f"cache_aware: lower load outweighs prefill; holds {cached}, another "
                  f"{best_cached} of {num_prompt_tokens} prompt tokens")
    return Choice(index, reason)
