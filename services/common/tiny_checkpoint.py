"""A tiny random-weight Llama checkpoint that corestream writes for itself.

`corestream serve` with no `--model` and most tests run on it, so it has to exist
without a network: weights come from a seeded numpy generator and the tokenizer is
a byte-level BPE trained on a short embedded text (training is deterministic), so
every write gives the same bytes. It is torch-free because the frontend calls it too.
Several processes may ask for it at once; each writes into its own temporary folder
and renames it into place, and the first rename wins.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from services.common.cache_folder import ensure_folder
from services.common.gguf_checkpoint import ensure_gguf_view, gguf_file_of

# Bump the suffix whenever the bytes written below change, so stale caches are ignored.
TINY_CHECKPOINT_NAME = "tiny-llama-v2"
CACHE_DIR_ENV = "CORESTREAM_CACHE_DIR"

_SEED = 20240607
_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
_UNK_ID, _BOS_ID, _EOS_ID = 0, 1, 2
_TARGET_VOCAB = 512
_ARCH: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 172,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}

# Training text for the BPE merges; any prose works, it only shapes which merges exist.
_CORPUS = """\
The engine keeps a paged cache of keys and values. Each request owns a list of blocks,
and every block holds the same number of tokens. When a request finishes, its blocks go
back to the pool; when two requests share a prefix, they share the blocks that hold it.
A scheduler decides, at every step, which requests advance and by how many tokens. Long
prompts are split into chunks so that short requests are not kept waiting behind them.
The model runner turns the chosen requests into one flat batch of tokens and positions,
runs the network once, and samples one new token for every request that reached the end
of its known text. The frontend turns those tokens back into text as they arrive.
Streams carry the results to clients, who may cancel at any time. A watchdog notices a
loop that stopped making progress. Health checks report whether a service is ready.
Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 64, 128, 256, 512 and 1024
appear in configuration files, together with names like block_size, max_model_len,
temperature, top_p, top_k and seed. Questions? Answers! Lists: one, two, three.
Hello, world. The quick brown fox jumps over the lazy dog. Good morning and good night.
"""


# The tiny model's own chat template, so that ChatService works out of the box: a turn
# is `<|role|>` on a line, the text, and the EOS token; tools are listed in the system
# turn and calls are written in the hermes format (`<tool_call>` JSON `</tool_call>`).
# Reasoning of earlier turns is left out of the history.
TINY_CHAT_TEMPLATE = """\
{%- set has_system = messages and messages[0].role in ('system', 'developer') -%}
{{- bos_token -}}
{%- if has_system or tools -%}
<|system|>
{% if has_system %}{{ messages[0].content }}
{% endif %}
{%- if tools %}You can call these tools (JSON schemas):
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}
Call one as <tool_call>{"name": NAME, "arguments": {...}}</tool_call> on its own line.
{% endif %}
{{- eos_token }}
{% endif -%}
{%- for message in messages -%}
{%- if not (loop.first and has_system) -%}
<|{{ message.role }}|>
{% if message.content is string %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor -%}
{{ eos_token }}
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>
{% endif -%}
"""


def default_cache_dir() -> Path:
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "corestream"


def ensure_tiny_checkpoint(cache_dir: Path | None = None) -> Path:
    """The tiny checkpoint's folder, writing it first if it does not exist yet."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return ensure_folder(root / TINY_CHECKPOINT_NAME, write_tiny_checkpoint)


class CheckpointNotFound(FileNotFoundError, ValueError):
    """`--model` names no checkpoint on this machine: a startup error no restart cures
    (a ValueError, so the command prints its one line and exits 2)."""


def resolve_model(model: str | None) -> Path:
    """The checkpoint folder for a `--model` value; empty means the tiny checkpoint. A
    GGUF file (or a folder holding one and no config.json) resolves to its view in the
    cache (services/common/gguf_checkpoint.py). A Hugging Face hub id (`ORG/NAME`) that is
    no folder here is looked up in this machine's Hugging Face cache: corestream reads
    local checkpoints only and never downloads."""
    if not model:
        return ensure_tiny_checkpoint()
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if (gguf_file := gguf_file_of(path)) is not None:
        return ensure_gguf_view(gguf_file, default_cache_dir())
    if path.is_dir():
        raise CheckpointNotFound(
            f"model {model!r} is not a checkpoint folder (no config.json in {path}); "
            "pass a local Hugging Face checkpoint folder, or leave --model empty "
            "for the built-in tiny checkpoint")
    if looks_like_hub_id(model):
        cached = hub_cache_snapshot(model)
        if cached is not None:
            return cached
        raise CheckpointNotFound(
            f"model {model!r} is not a folder, and not in the Hugging Face cache "
            f"({hub_cache_dir()}): corestream reads local checkpoints only; fetch it with "
            f"`hf download {model}` (or `huggingface-cli download {model}`), then pass "
            "--model with its folder or the same id")
    raise CheckpointNotFound(
        f"model {model!r}: no such folder; pass a local Hugging Face checkpoint folder "
        "(with config.json) or GGUF file, or leave --model empty for the built-in tiny "
        "checkpoint")


def looks_like_hub_id(model: str) -> bool:
    """`ORG/NAME` as the hub spells repository ids (no path of more parts, no `~`, `.`)."""
    parts = model.split("/")
    return (len(parts) == 2 and all(parts) and not model.startswith((".", "~"))
            and all(c.isalnum() or c in "-_." for part in parts for c in part))


def hub_cache_dir() -> Path:
    """Where the `huggingface_hub` library keeps downloads on this machine (its own
    environment variables first)."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or Path(
        os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_cache_snapshot(model: str) -> Path | None:
    """The cached snapshot of hub id `model` that holds a config.json: the one its `main`
    ref names, else the newest; None when there is none."""
    repo = hub_cache_dir() / ("models--" + model.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        named = snapshots / ref.read_text().strip()
        if (named / "config.json").is_file():
            return named
    try:
        found = [s for s in snapshots.iterdir() if (s / "config.json").is_file()]
    except OSError:
        return None
    return max(found, key=lambda s: s.stat().st_mtime, default=None)


def write_tiny_checkpoint(folder: Path) -> None:
    """Write every file of the checkpoint into an existing, empty folder."""
    tokenizer = _train_tokenizer()
    vocab_size = tokenizer.get_vocab_size()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(TINY_CHAT_TEMPLATE, encoding="utf-8")
    _write_json(folder / "tokenizer_config.json", _tokenizer_config())
    _write_json(folder / "config.json", _model_config(vocab_size))
    _write_json(
        folder / "generation_config.json",
        {"bos_token_id": _BOS_ID, "eos_token_id": _EOS_ID, "do_sample": False},
    )
    save_file(_random_weights(vocab_size), str(folder / "model.safetensors"), {"format": "pt"})


def train_byte_level_bpe(
    lines: list[str], vocab_size: int, special_tokens: tuple[str, ...], min_frequency: int = 0
) -> Tokenizer:
    """A byte-level BPE trained on `lines` whose encodings start with `<s>`, Llama-style.

    Training is deterministic, so the same arguments give the same tokenizer.json.
    """
    tokenizer = Tokenizer(models.BPE())
    # Byte-level pieces make every UTF-8 string encodable and decodable exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer)
    bos_id = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return tokenizer


def _train_tokenizer() -> Tokenizer:
    tokenizer = train_byte_level_bpe(
        _CORPUS.splitlines(), _TARGET_VOCAB, _SPECIAL_TOKENS, min_frequency=2
    )
    for token_id, token in enumerate(_SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, token
    return tokenizer


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _ARCH["max_position_embeddings"],
    }


def _model_config(vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        **_ARCH,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": _BOS_ID,
        "eos_token_id": _EOS_ID,
        "initializer_range": 0.02,
        "rope_scaling": None,
        "torch_dtype": "float32",
    }


def _random_weights(vocab_size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(_SEED)
    hidden = _ARCH["hidden_size"]
    head_dim = hidden // _ARCH["num_attention_heads"]
    kv_dim = head_dim * _ARCH["num_key_value_heads"]
    inter = _ARCH["intermediate_size"]

    # Wider than the usual 0.02 so attention and the MLP visibly shape the output, which
    # makes this checkpoint a useful check of the engine rather than of the embeddings.
    def normal(*shape: int, std: float = 0.15) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    weights = {"model.embed_tokens.weight": normal(vocab_size, hidden, std=1.0)}
    for i in range(_ARCH["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "self_attn.q_proj.weight": normal(hidden, hidden),
            p + "self_attn.k_proj.weight": normal(kv_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, hidden),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
        }
    weights["model.norm.weight"] = np.ones(hidden, np.float32)
    # Peaked logits keep greedy choices away from near-ties between implementations.
    weights["lm_head.weight"] = normal(vocab_size, hidden, std=0.3)
    return weights


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
