"""The busy loop's hooks for metrics and tracing; this base class does nothing.

EngineCore calls these on the loop thread, so an implementation must be cheap:
record timestamps and counts, and leave anything slow (building spans) to
another thread. services/engine/metrics.py has the real one.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.engine.core.iteration_details import IterationDetails
from services.engine.request import Request, RequestUpdate
from services.engine.scheduler.output import SchedulerOutput


class EngineObserver:
    def on_added(self, request: Request) -> None:
        """The scheduler accepted `request`."""

    def on_scheduled(self, out: SchedulerOutput) -> None:
        """A step is about to execute `out` (not called for empty steps)."""

    def on_updates(self, updates: Sequence[RequestUpdate]) -> None:
        """Outputs are going to the Sessions: new tokens, endings, rejections."""

    def on_iteration(self, details: IterationDetails) -> None:
        """A step's details (only while they are recorded: see iteration_details.py)."""

    def on_grammar_compiled(self, seconds: float, cached: bool) -> None:
        """A request's output constraint compiled in `seconds` (or came from the cache)."""

    def on_grammar_mask(self, seconds: float, rows: int) -> None:
        """A step's token bitmask of `rows` constrained requests took `seconds` (called
        on the mask thread)."""
