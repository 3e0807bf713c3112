"""A GGUF file as a checkpoint: the view's config, tokenizer and chat template agree with
transformers' own reading of the same file (SmolLM2-135M-Instruct Q4_1, the real model).

llama.cpp's ids on the same file: test_gguf_tokenizer_vs_llama_cpp.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from services.common.gguf_checkpoint import (
    GGUF_FILE_KEY,
    ensure_gguf_view,
    gguf_file_of,
    view_dir,
)
from services.common.model_info import load_model_info
from services.common.tiny_checkpoint import resolve_model
from services.frontend.chat.template import load_chat_templates, render_chat

transformers = pytest.importorskip("transformers")

VIEW_FILES = ["chat_template.jinja", "config.json", "generation_config.json",
              "tokenizer.json", "tokenizer_config.json"]
CONFIG_FIELDS = [
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
    "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
    "model_type",
]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Die Straße war überfüllt; Jürgen aß Käsespätzle.",
    "Où est la bibliothèque ? L'élève a répondu : « à gauche ».",
    "机器学习是人工智能的一个分支。",
    "東京は日本の首都です。カタカナとひらがな。",
    "اللغة العربية جميلة جداً.",
    "Москва — столица России, 2024 год.",
    "한국어 텍스트도 잘 처리됩니다.",
    "हिन्दी में एक वाक्य।",
    "Ελληνικά: γειά σου κόσμε",
    "Emoji: 🚀🔥👍🏽 👨‍👩‍👧‍👦 ❤️",
    "def add(a: int, b: int) -> int:\n    return a + b  # sum\n",
    'class Foo:\n\tdef __init__(self):\n\t\tself.x = {"k": [1, 2, 3]}\n',
    '{"name": "corestream", "version": "0.1.0", "ok": true, "n": null}',
    "for f in *.gguf; do echo \"$f\" | sed -e 's/x/y/g' > /dev/null 2>&1; done",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\t\tand\n\n\nnewlines\r\n mixed  \t \n",
    "numbers 1234567890 3.14159 -42 1e-5 0x1F 1,000,000",
    "don't won't it's they're we've I'm you'll he'd",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|>",
    "a<repo_name>b<file_sep>c",
    "",
    " ",
    "\n",
]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Capital of Italy?"},
     {"role": "assistant", "content": "Rome"},
     {"role": "user", "content": "And of Spain?"}],
]


@pytest.fixture(scope="module")
def view(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_gguf_view(smollm2_gguf, tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent,
                                                      gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def tokenizer(view: Path) -> Tokenizer:
    return Tokenizer.from_file(str(view / "tokenizer.json"))


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def test_view_holds_metadata_files_and_names_the_weights(view: Path, smollm2_gguf: Path) -> None:
    assert sorted(p.name for p in view.iterdir()) == VIEW_FILES
    config = read_json(view / "config.json")
    assert config[GGUF_FILE_KEY] == str(smollm2_gguf.resolve())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "float32"
    info = load_model_info(view)
    assert (info.vocab_size, info.max_model_len, info.eos_token_ids, info.bos_token_id) == (
        49152, 8192, (2,), 1)


def test_config_agrees_with_transformers(view: Path, smollm2_gguf: Path) -> None:
    ours = read_json(view / "config.json")
    theirs = transformers.AutoConfig.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name).to_dict()
    for field in CONFIG_FIELDS:
        assert ours[field] == theirs[field], field
    assert ours["rope_theta"] == theirs["rope_parameters"]["rope_theta"]
    assert theirs["rope_parameters"]["rope_type"] == "default"
    assert "rope_scaling" not in ours


def test_view_is_written_once_per_file_version(view: Path, smollm2_gguf: Path,
                                               tmp_path: Path) -> None:
    written = (view / "config.json").stat().st_mtime_ns
    assert ensure_gguf_view(smollm2_gguf, view.parent.parent) == view
    assert (view / "config.json").stat().st_mtime_ns == written
    # A copy elsewhere, or the same path with a new mtime, is another key.
    copy = tmp_path / smollm2_gguf.name
    shutil.copyfile(smollm2_gguf, copy)
    first = view_dir(copy, tmp_path)
    assert first != view_dir(smollm2_gguf, tmp_path)
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert view_dir(copy, tmp_path) != first


def test_resolve_model_takes_a_file_or_its_folder(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORESTREAM_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / smollm2_gguf.name).symlink_to(smollm2_gguf)
    assert gguf_file_of(folder) == folder / smollm2_gguf.name
    by_file = resolve_model(str(smollm2_gguf))
    assert by_file.parent == tmp_path / "cache" / "gguf"
    # The link resolves to the same file, hence the same view.
    assert resolve_model(str(folder)) == by_file
    (folder / "other.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model(str(folder))


def test_token_ids_agree_with_transformers(tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    for text in CORPUS:
        for special in (True, False):
            theirs = hf_tokenizer(text, add_special_tokens=special)["input_ids"]
            assert tokenizer.encode(text, add_special_tokens=special).ids == theirs, text


def test_decode_round_trips(tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    for text in CORPUS:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        assert tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(
            ids, skip_special_tokens=True), text


def test_special_tokens_and_bos_flag(view: Path, tokenizer: Tokenizer) -> None:
    config = read_json(view / "tokenizer_config.json")
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == (
        "<|im_start|>", "<|im_end|>", False)
    assert tokenizer.encode("<|im_start|>").ids == [1]
    assert tokenizer.decode([1, 19556, 2], skip_special_tokens=True) == "Hello"


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_renders_as_transformers(view: Path, hf_tokenizer: Any,
                                               messages: list[dict[str, Any]]) -> None:
    templates = load_chat_templates(view)
    template = templates.select(has_tools=False)
    assert template == hf_tokenizer.chat_template
    ours = render_chat(template, messages, tools=None, add_generation_prompt=True,
                       continue_final_message=False, template_kwargs={},
                       special_tokens=templates.special_tokens)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=True)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")
