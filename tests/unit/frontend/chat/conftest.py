"""Fixtures over the chat-template corpus (template_corpus.py): transformers, a fixed
clock for both renderers, and each checkpoint's pair of tokenizers."""

from __future__ import annotations

from typing import Any

import pytest

from services.frontend.chat import template as chat_template_module
from services.frontend.chat.template import load_chat_templates
from services.frontend.tokenizer import TextTokenizer
from tests.unit.frontend.chat.template_corpus import (
    CHECKPOINTS,
    TEMPLATES_DIR,
    FixedClock,
    Pair,
    write_checkpoint,
)


@pytest.fixture(scope="module")
def transformers_module() -> Any:
    return pytest.importorskip("transformers")


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch, transformers_module: Any) -> None:
    """Both renderers see the same `strftime_now` date (Llama prints it)."""
    from transformers.utils import chat_template_utils

    monkeypatch.setattr(chat_template_utils, "datetime", FixedClock)
    monkeypatch.setattr(chat_template_module, "datetime", FixedClock)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory, transformers_module: Any) -> dict[str, Pair]:
    if not TEMPLATES_DIR.is_dir():
        pytest.skip(f"shared chat templates not found at {TEMPLATES_DIR}")
    result = {}
    for name, checkpoint in CHECKPOINTS.items():
        folder = tmp_path_factory.mktemp(name)
        template = (TEMPLATES_DIR / checkpoint.file).read_text(encoding="utf-8")
        write_checkpoint(folder, checkpoint, template)
        hf = transformers_module.PreTrainedTokenizerFast.from_pretrained(str(folder))
        result[name] = Pair(hf, TextTokenizer.from_dir(folder), load_chat_templates(folder))
    return result
