"""What the streaming answer parsers share: text that may be the start of a marker."""

from __future__ import annotations


def marker_prefix_length(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
