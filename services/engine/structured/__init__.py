"""Structured output in the engine: grammars compiled off the busy loop, matchers
that follow each constrained request's tokens, and each step's token bitmask."""
