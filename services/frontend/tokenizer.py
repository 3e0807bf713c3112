"""The served model's tokenizer (a Hugging Face tokenizer.json), torch-free."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class TextTokenizer:
    """Text <-> token ids with the `tokenizers` library; thread-safe for encode/decode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def from_dir(cls, model_dir: Path) -> TextTokenizer:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        return cls(Tokenizer.from_file(str(path)))

    @property
    def backend(self) -> Tokenizer:
        """The wrapped `tokenizers.Tokenizer` (the streaming decoder needs it)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Two texts as one input, joined by the tokenizer's pair template (a
        cross-encoder's query and document)."""
        return self._tokenizer.encode(first, second, add_special_tokens=True).ids

    def token_strings(self, token_ids: list[int]) -> list[str]:
        # Ids the tokenizer does not know (the model's vocab may be padded) show as "".
        return [self._tokenizer.id_to_token(i) or "" for i in token_ids]

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text, decoded alone (`Ġme` is " me"; a piece of a multi-byte
        character is U+FFFD), as logprobs report tokens."""
        decoder = self._tokenizer.decoder
        pieces = self.token_strings(token_ids)
        if decoder is None:
            return pieces
        return [decoder.decode([piece]) if piece else "" for piece in pieces]

    def token_bytes(self, token_ids: list[int], texts: list[str]) -> list[bytes]:
        """Each token's raw bytes, given its `token_texts`. A token holding part of a
        multi-byte character decodes to U+FFFD; its bytes come from the piece itself: a
        byte-fallback piece (`<0xE2>`) or byte-level characters (`âĢ`)."""
        out = []
        for token_id, text in zip(token_ids, texts, strict=True):
            if "\ufffd" in text:
                piece = self._tokenizer.id_to_token(token_id) or ""
                raw = _piece_bytes(piece)
                out.append(raw if raw is not None else text.encode())
            else:
                out.append(text.encode())
        return out

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()


def _piece_bytes(piece: str) -> bytes | None:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    if piece and all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return None
