from __future__ import annotations

from services.frontend.generate.detokenizer import IncrementalDetokenizer, StopStringMatcher
from services.frontend.tokenizer import TextTokenizer


def _stream(
    tokenizer: TextTokenizer, text: str, stops: tuple[str, ...], include: bool = False
) -> tuple[list[str], str | None]:
    """Feed `text`'s tokens one at a time; the emitted pieces and the matched stop."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    matcher = StopStringMatcher(stops, include)
    pieces: list[str] = []
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        out, stop = matcher.feed(detok.push([token_id]))
        pieces.append(out)
        if stop is not None:
            return pieces, stop
    pieces.append(matcher.flush())
    return pieces, None


def test_detokenizes_incrementally_like_a_full_decode(tokenizer: TextTokenizer) -> None:
    text = "hello world, the quick brown fox"
    pieces, stop = _stream(tokenizer, text, ())
    assert stop is None
    assert "".join(pieces) == text
    assert sum(1 for p in pieces if p) > 3


def test_multibyte_characters_split_across_tokens(tokenizer: TextTokenizer) -> None:
    text = "héllo 日本語 🙂"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The corpus has none of these characters, so each byte is its own token.
    assert len(ids) > len(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some tokens completed no character


def test_prompt_context_keeps_leading_space(tokenizer: TextTokenizer) -> None:
    prompt = tokenizer.encode("hello", add_special_tokens=True)
    continuation = tokenizer.encode(" world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    assert detok.push(continuation) == " world"


def test_a_prompt_ending_inside_a_character_does_not_leak_into_the_output(
        tokenizer: TextTokenizer) -> None:
    # A prompt given as ids may end with the first byte of a multi-byte character.
    first_byte = tokenizer.encode("é", add_special_tokens=False)[0]
    prompt = tokenizer.encode("hello world", add_special_tokens=False) + [first_byte]
    assert tokenizer.decode(prompt).endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    assert detok.push(tokenizer.encode(" ok", add_special_tokens=False)) == " ok"


def test_special_tokens_skipped_by_default(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("hello", add_special_tokens=True) + [1]
    assert IncrementalDetokenizer(tokenizer).push(ids) == "hello"
    shown = IncrementalDetokenizer(tokenizer, skip_special_tokens=False).push(ids)
    assert shown == "<s>hello</s>"


def test_stop_string_split_across_tokens(tokenizer: TextTokenizer) -> None:
    text = "hello world, the quick brown fox"
    stop = "o wor"
    tokens = tokenizer.token_strings(tokenizer.encode(text, add_special_tokens=False))
    assert not any(stop.replace(" ", "Ġ") in t for t in tokens)  # really split
    pieces, matched = _stream(tokenizer, text, (stop,))
    assert matched == stop
    assert "".join(pieces) == "hell"


def test_stop_string_included_when_asked(tokenizer: TextTokenizer) -> None:
    pieces, matched = _stream(tokenizer, "hello world, the quick", ("world",), include=True)
    assert matched == "world"
    assert "".join(pieces) == "hello world"


def test_text_that_may_start_a_stop_is_held_back() -> None:
    matcher = StopStringMatcher(("STOP",))
    assert matcher.feed("abc S") == ("abc ", None)
    assert matcher.feed("T") == ("", None)
    # The candidate fails: the held text is released.
    assert matcher.feed("x") == ("STx", None)
    assert matcher.feed("ST") == ("", None)
    assert matcher.flush() == "ST"


def test_earliest_of_several_stops_wins() -> None:
    matcher = StopStringMatcher(("cd", "b"))
    assert matcher.feed("abcd") == ("a", "b")


def test_stops_ignored_before_min_tokens() -> None:
    matcher = StopStringMatcher(("x",))
    assert matcher.feed("axb", check=False) == ("axb", None)
    assert matcher.feed("cxd", check=True) == ("c", "x")


def test_no_stops_passes_text_through() -> None:
    matcher = StopStringMatcher(())
    assert matcher.feed("abc") == ("abc", None)
    assert matcher.flush() == ""
