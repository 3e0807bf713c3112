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

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
