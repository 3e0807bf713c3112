"""TextTokenizer's per-token text and raw bytes, as logprobs report them."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from services.frontend.tokenizer import TextTokenizer

DASH = "\u2014"  # e2 80 94: three bytes, split over two tokens below


def _byte_level() -> TextTokenizer:
    # GPT-2's stand-ins: 0xE2 -> 'â', 0x80 -> 'Ģ', 0x94 -> 'Ķ', 0x20 -> 'Ġ'.
    vocab = {"â": 0, "Ģ": 1, "Ķ": 2, "âĢ": 3, "Ġ": 4, "h": 5, "i": 6, "hi": 7, "Ġhi": 8}
    merges = [("â", "Ģ"), ("h", "i"), ("Ġ", "hi")]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return TextTokenizer(tok)


def _byte_fallback() -> TextTokenizer:
    vocab = {"<unk>": 0, "<0xE2>": 1, "<0x80>": 2, "<0x94>": 3, "▁hi": 4, "▁": 5, "h": 6,
             "i": 7, "hi": 8}
    tok = Tokenizer(models.BPE(vocab, [("h", "i"), ("▁", "hi")], unk_token="<unk>",
                               byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Metaspace()])
    return TextTokenizer(tok)


def test_byte_level_pieces_of_a_character_give_their_bytes() -> None:
    tokenizer = _byte_level()
    ids = tokenizer.encode(DASH + " hi")
    assert ids == [3, 2, 8]
    texts = tokenizer.token_texts(ids)
    assert texts == ["\ufffd", "\ufffd", " hi"]
    raw = tokenizer.token_bytes(ids, texts)
    assert raw == [b"\xe2\x80", b"\x94", b" hi"]
    assert b"".join(raw).decode() == DASH + " hi"


def test_byte_fallback_pieces_give_their_byte() -> None:
    tokenizer = _byte_fallback()
    ids = tokenizer.encode(DASH)
    assert [tokenizer.token_strings([i])[0] for i in ids][-3:] == ["<0xE2>", "<0x80>", "<0x94>"]
    texts = tokenizer.token_texts(ids)
    raw = tokenizer.token_bytes(ids, texts)
    assert raw[-3:] == [b"\xe2", b"\x80", b"\x94"]
    hi = tokenizer.encode("hi")
    assert tokenizer.token_bytes(hi, tokenizer.token_texts(hi)) == [
        t.encode() for t in tokenizer.token_texts(hi)]


def test_an_unknown_id_has_no_bytes() -> None:
    tokenizer = _byte_level()
    assert tokenizer.token_bytes([999], tokenizer.token_texts([999])) == [b""]
