"""A `tokenizers` tokenizer rebuilt from a GGUF file's metadata, as llama.cpp tokenizes.

A GGUF stores its tokenizer as llama.cpp's key-value fields (`tokenizer.ggml.*`), not as a
tokenizer.json. Two models are rebuilt here:

- `gpt2`: byte-level BPE from `tokens` and `merges`. How text is split before the merges
  run is not stored as a rule but named (`tokenizer.ggml.pre`); `_PRE_TOKENIZERS` maps
  each name we know to llama.cpp's regular expressions for it. An unknown name is refused
  rather than guessed, since a wrong split silently changes every id.
- `llama` (SentencePiece): BPE with byte fallback whose merges are recovered from the
  token scores (llama.cpp merges the adjacent pair whose union scores highest), the text
  prefixed with `▁` when `tokenizer.ggml.add_space_prefix` says so.

Tokens the file marks CONTROL become special added tokens (`<|im_start|>` stays whole and
is skipped on decode); USER_DEFINED ones become plain added tokens. BOS/EOS are added to
encodings as `tokenizer.ggml.add_bos_token` / `add_eos_token` say.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama_token_type in llama.cpp.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's split rules (src/llama-vocab.cpp), by `tokenizer.ggml.pre`.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Each name -> the regular expressions applied one after another, each splitting the
# pieces the previous one left (matches become pieces of their own).
_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "mpt", "olmo", "jais"), (_GPT2_SPLIT,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"),
                    (r"\p{N}", _GPT2_SPLIT)),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe"),
                    (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), (_QWEN2_SPLIT,)),
}
# llama.cpp matches a whole piece against the vocabulary before merging, for these.
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3"})


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """The tokenizer GGUF `metadata` describes (`tokenizer.ggml.model` gpt2 or llama)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(metadata)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(metadata)
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; "
                         "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece)")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                  for t, kind in zip(tokens, types, strict=True)
                                  if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False)
                          for t, kind in zip(tokens, types, strict=True)
                          if kind == _USER_DEFINED])
    if post_processor := _post_processor(metadata):
        tokenizer.post_processor = post_processor
    return tokenizer


def tokenizer_config(metadata: dict[str, Any], max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: the named special tokens and whether encodings get BOS/EOS."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _adds(metadata, "bos"),
        "add_eos_token": _adds(metadata, "eos"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        if (token_id := metadata.get(f"tokenizer.ggml.{key}")) is not None:
            config[name] = tokens[int(token_id)]
    return config


def _adds(metadata: dict[str, Any], which: str) -> bool:
    """Whether encodings start with BOS (`which` "bos") or end with EOS ("eos"); a
    SentencePiece vocabulary that does not say adds BOS, as llama.cpp does."""
    default = which == "bos" and metadata.get("tokenizer.ggml.model") == "llama"
    return bool(metadata.get(f"tokenizer.ggml.add_{which}_token", default))


def _post_processor(metadata: dict[str, Any]) -> processors.TemplateProcessing | None:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    ends = []
    for which in ("bos", "eos"):
        token_id = metadata.get(f"tokenizer.ggml.{which}_token_id")
        if _adds(metadata, which) and token_id is not None:
            ends.append((tokens[int(token_id)], int(token_id)))
        else:
            ends.append(None)
    bos, eos = ends
    if bos is None and eos is None:
        return None
    head = f"{bos[0]} " if bos else ""
    tail = f" {eos[0]}" if eos else ""
    return processors.TemplateProcessing(
        single=f"{head}$A{tail}",
        pair=f"{head}$A{tail} {head}$B{tail}",
        special_tokens=[end for end in (bos, eos) if end is not None],
    )


def _byte_level_bpe(metadata: dict[str, Any]) -> Tokenizer:
    pre = str(metadata.get("tokenizer.ggml.pre") or "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not known to corestream; known: "
                         f"{sorted(_PRE_TOKENIZERS)}")
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    vocab = {}
    for token_id, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        # A regular token spelled in raw text (not in the byte alphabet) could never come
        # out of the byte-level merges; respell it. Added tokens match raw text: keep them.
        if kind not in (_CONTROL, _USER_DEFINED) and not set(token) <= alphabet:
            token = _byte_spelling(token)
        vocab[token] = token_id
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or ()]
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
    splits = [pre_tokenizers.Split(Regex(rule), behavior="isolated")
              for rule in _PRE_TOKENIZERS[pre]]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_spelling(text: str) -> str:
    table = _bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _sentencepiece_bpe(metadata: dict[str, Any]) -> Tokenizer:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    scores: list[float] = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(models.BPE(
        vocab, _merges_from_scores(vocab, dict(zip(tokens, scores, strict=True))),
        unk_token=tokens[int(unk_id)] if unk_id is not None else None,
        fuse_unk=True, byte_fallback=True,
    ))
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_from_scores(
    vocab: dict[str, int], scores: dict[str, float]
) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, ranked by the union's score, best first
    (llama.cpp's SentencePiece tokenizer joins the best-scoring adjacent pair first);
    ties as transformers' GGUF converter breaks them: the longer left part, the longer
    right part, then the union's id and the parts' ids."""
    ranked = []
    for token, score in scores.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append(((-score, -len(left), -len(right), vocab[token], vocab[left],
                                vocab[right]), left, right))
    ranked.sort(key=lambda entry: entry[0])
    return [(left, right) for _, left, right in ranked]
