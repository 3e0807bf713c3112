"""Chained hashes that name full KV-cache blocks by their contents.

A block's key and values depend on every token before it, not only on its own
tokens, so its hash covers its parent's hash as well as its own token ids: two
blocks match only if the whole prefix up to their end matches. The request's
cache_salt enters the first block, and through the chain every later one, so
requests with different salts never share a block. sha256 rather than Python's
hash(): a collision would silently hand one request another's keys and values,
and across salts (tenants) that is a leak, not just a wrong answer.

It lives in common because two services hash: engines name the blocks they cache,
and frontends hash prompts the same way to find which engine already holds them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

BlockHash = bytes
NO_PARENT = b""
"""How events name the missing parent of a request's first block."""

_ROOT = b"\x00" * 32


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], cache_salt: str = ""
) -> BlockHash:
    """The hash of one full block; `parent` is None for a request's first block."""
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    if parent is None:
        salt = cache_salt.encode()
        # Length-prefixed so that a salt can never be mistaken for token bytes.
        h.update(len(salt).to_bytes(4, "little"))
        h.update(salt)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_slice: Callable[[int, int], Sequence[int]],
    num_tokens: int,
    block_size: int,
    cache_salt: str = "",
) -> None:
    """Append to `hashes` the hashes of the full blocks among the first num_tokens tokens.

    Incremental: blocks already hashed are not hashed again, so a request pays
    once per block over its whole life (including after a preemption).
    """
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[i - 1] if i else None
        tokens = token_slice(i * block_size, (i + 1) * block_size)
        hashes.append(hash_block(parent, tokens, cache_salt))


def prompt_block_hashes(token_ids: Sequence[int], block_size: int,
                        cache_salt: str = "") -> list[BlockHash]:
    """The hashes of the prompt's blocks that an engine could serve from its cache: the
    full blocks before the last token, whose logits must always be computed."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, lambda start, end: token_ids[start:end],
                        max(len(token_ids) - 1, 0), block_size, cache_salt)
    return hashes
