from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from services.common.model_info import load_model_info
from services.common.tiny_checkpoint import (
    TINY_CHECKPOINT_NAME,
    ensure_tiny_checkpoint,
    resolve_model,
)

FILES = (
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
TEXTS = [
    "Hello, world!",
    "  spaces\tand\nnewlines ",
    "ünïcödé 漢字 🚀🚀",
    "",
    "tabs\t\t, digits 0123456789",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("cache"))


def test_writes_are_byte_identical(checkpoint: Path, tmp_path: Path) -> None:
    again = ensure_tiny_checkpoint(tmp_path)
    assert again.name == TINY_CHECKPOINT_NAME
    assert sorted(p.name for p in again.iterdir()) == sorted(FILES)
    for name in FILES:
        assert (again / name).read_bytes() == (checkpoint / name).read_bytes(), name


def test_existing_checkpoint_is_reused(checkpoint: Path) -> None:
    before = (checkpoint / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_checkpoint(checkpoint.parent) == checkpoint
    assert (checkpoint / "model.safetensors").stat().st_mtime_ns == before
    assert [p.name for p in checkpoint.parent.iterdir()] == [TINY_CHECKPOINT_NAME]


def test_cache_dir_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORESTREAM_CACHE_DIR", str(tmp_path))
    assert resolve_model(None) == tmp_path / TINY_CHECKPOINT_NAME
    assert resolve_model("") == tmp_path / TINY_CHECKPOINT_NAME


def test_resolve_model_rejects_a_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))
    assert resolve_model(str(ensure_tiny_checkpoint(tmp_path))) == tmp_path / TINY_CHECKPOINT_NAME


def test_a_hub_id_is_served_from_the_local_hugging_face_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"reads local checkpoints only.*hf download Org/Model"):
        resolve_model("Org/Model")
    repo = tmp_path / "hf" / "hub" / "models--Org--Model"
    for revision in ("aaa", "bbb"):
        (repo / "snapshots" / revision).mkdir(parents=True)
        (repo / "snapshots" / revision / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("aaa\n")
    assert resolve_model("Org/Model") == repo / "snapshots" / "aaa"
    (repo / "refs" / "main").unlink()
    found = resolve_model("Org/Model")
    assert found.parent == repo / "snapshots" and (found / "config.json").is_file()


def test_a_missing_path_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such folder"):
        resolve_model(str(tmp_path / "not" / "here"))


def test_model_info(checkpoint: Path) -> None:
    info = load_model_info(checkpoint)
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    assert info.architectures == ("LlamaForCausalLM",)
    assert info.vocab_size == tokenizer.get_vocab_size()
    assert info.max_model_len == 2048
    assert info.eos_token_ids == (tokenizer.token_to_id("</s>"),)
    assert info.bos_token_id == tokenizer.token_to_id("<s>")
    assert info.dtype == "float32"


def test_model_info_reads_eos_lists_and_new_dtype_key(tmp_path: Path) -> None:
    config = {"architectures": ["X"], "vocab_size": 10, "max_position_embeddings": 32,
              "eos_token_id": 3, "dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_model_info(tmp_path).eos_token_ids == (3,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 5]}))
    info = load_model_info(tmp_path)
    assert (info.eos_token_ids, info.bos_token_id, info.dtype) == ((4, 5), None, "bfloat16")


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_and_streams(checkpoint: Path, text: str) -> None:
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    ids = tokenizer.encode(text).ids
    assert ids[0] == tokenizer.token_to_id("<s>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    stream = DecodeStream(skip_special_tokens=True)
    pieces = [stream.step(tokenizer, i) for i in ids]
    assert "".join(p for p in pieces if p) == text


def test_transformers_loads_it(checkpoint: Path) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(checkpoint)
    assert model.config.vocab_size == load_model_info(checkpoint).vocab_size
    assert not model.config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer("Hello, world!")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello, world!"
    assert tokenizer.eos_token == "</s>"


def test_module_does_not_import_torch() -> None:
    import subprocess

    code = ("import sys; import services.common.tiny_checkpoint, services.common.model_info; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[3])


def test_concurrent_writers_agree(tmp_path: Path) -> None:
    import subprocess

    code = ("import sys; from pathlib import Path; "
            "from services.common.tiny_checkpoint import ensure_tiny_checkpoint; "
            "print(ensure_tiny_checkpoint(Path(sys.argv[1])))")
    root = Path(__file__).parents[3]
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=root,
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outputs = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert outputs == {str(tmp_path / TINY_CHECKPOINT_NAME)}
    # Losers clean up their staging folders.
    assert [p.name for p in tmp_path.iterdir()] == [TINY_CHECKPOINT_NAME]
    assert load_model_info(tmp_path / TINY_CHECKPOINT_NAME).vocab_size > 256


def test_the_chat_template_is_served_and_matches_transformers(checkpoint: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from services.frontend.chat.template import load_chat_templates, render_chat

    templates = load_chat_templates(checkpoint)
    hf = transformers.AutoTokenizer.from_pretrained(checkpoint)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "-3 C"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    for chat, chat_tools in ((messages, tools), (messages[1:2], None)):
        ours = render_chat(templates.default or "", chat, tools=chat_tools,
                           add_generation_prompt=True, continue_final_message=False,
                           template_kwargs={}, special_tokens=templates.special_tokens)
        theirs = hf.apply_chat_template(chat, tools=chat_tools, tokenize=False,
                                        add_generation_prompt=True)
        assert ours == theirs
    assert ours == "<s><|user|>\nWeather?</s>\n<|assistant|>\n"
