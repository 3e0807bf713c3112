from __future__ import annotations

import llguidance
import pytest

from services.common.constraints import build_tokenizer
from services.common.model_info import load_model_info
from services.common.tiny_checkpoint import resolve_model


@pytest.fixture(scope="module")
def tokenizer() -> llguidance.LLTokenizer:
    """The built-in tiny checkpoint's tokenizer, as the engine's matchers take it."""
    path = resolve_model(None)
    info = load_model_info(path)
    return build_tokenizer((path / "tokenizer.json").read_text(), info.vocab_size,
                           info.eos_token_ids)
