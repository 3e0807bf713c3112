"""Ways to cut a text into streamed deltas, for the incremental parsers' tests."""

from __future__ import annotations

import random
from collections.abc import Iterator


def random_chunks(text: str, rng: random.Random) -> list[str]:
    chunks: list[str] = []
    pos = 0
    while pos < len(text):
        size = rng.randint(1, 8)
        chunks.append(text[pos : pos + size])
        pos += size
    return chunks


def chunkings(text: str) -> Iterator[list[str]]:
    """The text whole, a character at a time, split at every point, and randomly."""
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    rng = random.Random(20240611)
    for _ in range(20):
        yield random_chunks(text, rng)
