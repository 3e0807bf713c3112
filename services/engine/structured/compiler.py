"""Grammars compiled off the busy loop, on a small worker pool, with an LRU cache.

llguidance builds a grammar's lexer and parser in Rust without the GIL (about a
millisecond for a typical schema, up to a second for a huge one), so the pool's
threads compile while the loop steps. A compiled matcher is kept pristine in the
cache, keyed by the constraint; each request gets its own deep copy, which is
cheap. The tokenizer llguidance needs is built on the first compile, on a worker,
from the model's tokenizer.json with the logits' vocabulary size.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import llguidance

from services.common.constraints import (
    ConstraintError,
    LazyTokenizer,
    OutputConstraint,
    compile_matcher,
    llguidance_grammar,
)
from services.common.model_info import ModelInfo
from services.common.thread_names import name_native_thread
from services.engine.structured.grammar import Grammar


@dataclass(frozen=True, slots=True)
class Compiled:
    grammar: Grammar
    seconds: float
    """Time spent compiling (0 when the cache had it)."""
    cached: bool


@dataclass(frozen=True, slots=True)
class _Pristine:
    """A compiled matcher at the grammar's start, never advanced: copied per request."""

    matcher: llguidance.LLMatcher
    seconds: float


class GrammarCompiler:
    def __init__(self, model: ModelInfo, workers: int = 2, cache_size: int = 256) -> None:
        self._model = model
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="engine-grammar",
                                        initializer=name_native_thread)
        # Compiles done or under way, so that a burst of requests with one schema
        # compiles it once; a failed compile is dropped (its requests fail).
        self._cache: OrderedDict[OutputConstraint, Future[_Pristine]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._tokenizer = LazyTokenizer(self._tokenizer_json, model.vocab_size,
                                        model.eos_token_ids)

    def compile(self, constraint: OutputConstraint) -> Future[Compiled]:
        """The request's grammar, compiled on the pool (or copied from the cache); the
        future fails with ConstraintError for a constraint that cannot be served."""
        with self._lock:
            pristine = self._cache.get(constraint)
            first = pristine is None
            if pristine is None:
                pristine = self._cache[constraint] = self._pool.submit(
                    self._compile_pristine, constraint)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(constraint)
        # The pool's queue is FIFO: the compile this waits for started before it.
        return self._pool.submit(self._copy, pristine, first)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _copy(self, pristine: Future[_Pristine], first: bool) -> Compiled:
        compiled = pristine.result()
        return Compiled(Grammar(compiled.matcher.deep_copy()),
                        compiled.seconds if first else 0.0, cached=not first)

    def _compile_pristine(self, constraint: OutputConstraint) -> _Pristine:
        try:
            tokenizer = self._tokenizer.get()
            start = time.perf_counter()
            matcher = compile_matcher(llguidance_grammar(constraint), tokenizer)
            return _Pristine(matcher, time.perf_counter() - start)
        except ConstraintError as exc:
            with self._lock:
                self._cache.pop(constraint, None)
            raise ConstraintError(f"{constraint.field}: {exc}") from None

    def _tokenizer_json(self) -> str:
        path = Path(self._model.path) / "tokenizer.json"
        if not path.is_file():
            raise ConstraintError(f"this engine's model has no tokenizer.json ({path}), "
                                  "which output constraints need")
        return path.read_text()

    @property
    def vocab_size(self) -> int:
        return self._model.vocab_size
