"""The chat-template corpus that render_chat and the RenderChat RPC are compared on
against transformers' apply_chat_template: published templates (CHECKPOINTS), the
conversations (CASES), the refusals expected, and how a checkpoint folder is written
for both tokenizers to read. The fixtures over it are in conftest.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from services.common.tiny_checkpoint import train_byte_level_bpe
from services.frontend.chat.template import ChatTemplates
from services.frontend.tokenizer import TextTokenizer

# CI checks shared/ out beside the repository clone.
TEMPLATES_DIR = Path(__file__).resolve().parents[4].parent / "shared" / "chat_templates"

BPE_CORPUS = [
    "The weather in Paris is sunny today, and the temperature is 21 degrees.",
    'Tools: {"name": "get_weather", "arguments": {"city": "Paris"}} returns JSON.',
    "You are a helpful assistant. Think step by step before you answer the user.",
]


@dataclass(frozen=True)
class Checkpoint:
    """A published template and the tokens its checkpoint defines."""

    file: str
    special_tokens: dict[str, str]
    control_tokens: tuple[str, ...]
    """Other added tokens the template writes (special or not in the real checkpoint)."""


_CHATML = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
_HERMES_TOOLS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_THINK = ("<think>", "</think>")
CHECKPOINTS = {
    "qwen2.5": Checkpoint(
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        _CHATML + _HERMES_TOOLS,
    ),
    "qwen3": Checkpoint(
        "Qwen-Qwen3-0.6B.jinja",
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        _CHATML + _HERMES_TOOLS + _THINK,
    ),
    "llama3.2": Checkpoint(
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        ("<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"),
    ),
    "mistral-nemo": Checkpoint(
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]")
        + ("[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
    ),
    "smollm3": Checkpoint(
        "HuggingFaceTB-SmolLM3-3B.jinja",
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"},
        _CHATML + _THINK,
    ),
    "deepseek-r1-distill": Checkpoint(
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        {
            "bos_token": "<｜begin▁of▁sentence｜>",
            "eos_token": "<｜end▁of▁sentence｜>",
            "pad_token": "<｜end▁of▁sentence｜>",
        },
        ("<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
        + ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
        + ("<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>")
        + ("<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
        + _THINK,
    ),
}

# ---- the corpus ---------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
        },
        "return": {"type": "string"},
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
USER = {"role": "user", "content": "What is the weather in Paris?"}


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


WEATHER_CALL = _call("a1b2c3d4e", "get_weather", {"city": "Paris", "unit": "celsius"})
TIME_CALL = _call("f5g6h7i8j", "get_time", {"timezone": "Europe/Paris"})
WEATHER_RESULT = {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": '{"temp": 21}'}
TIME_RESULT = {"role": "tool", "tool_call_id": "f5g6h7i8j", "content": "09:26"}


@dataclass(frozen=True)
class Case:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


CASES: dict[str, Case] = {
    "user_only": Case([{"role": "user", "content": "Hello!"}]),
    "system_user": Case([SYSTEM, USER]),
    "multi_turn": Case(
        [
            SYSTEM,
            USER,
            {"role": "assistant", "content": "Sunny, 21 degrees."},
            {"role": "user", "content": "And tomorrow?"},
        ]
    ),
    "tools_offered": Case([SYSTEM, USER], TOOLS),
    "tool_round_trip": Case(
        [
            USER,
            {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
            WEATHER_RESULT,
            {"role": "assistant", "content": "It is 21 degrees in Paris."},
            {"role": "user", "content": "Thanks!"},
        ],
        TOOLS,
    ),
    # The same with "" for the call's content: the form Qwen3 and DeepSeek can render.
    "tool_round_trip_empty_content": Case(
        [
            USER,
            {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
            WEATHER_RESULT,
            {"role": "assistant", "content": "It is 21 degrees in Paris."},
            {"role": "user", "content": "Thanks!"},
        ],
        TOOLS,
    ),
    "tool_result_last": Case(
        [
            SYSTEM,
            USER,
            {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
            WEATHER_RESULT,
        ],
        TOOLS,
    ),
    "parallel_tool_calls": Case(
        [
            {"role": "user", "content": "Weather and time in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL, TIME_CALL]},
            WEATHER_RESULT,
            TIME_RESULT,
        ],
        TOOLS,
    ),
    "reasoning_history": Case(
        [
            USER,
            {
                "role": "assistant",
                "reasoning_content": "The user wants Paris weather.\nI recall it is sunny.",
                "content": "Sunny.",
            },
            {"role": "user", "content": "Are you sure?"},
        ]
    ),
    "reasoning_final": Case(
        [
            USER,
            {
                "role": "assistant",
                "reasoning_content": "Check the forecast first.",
                "content": "The forecast says",
            },
        ]
    ),
    "reasoning_after_tools": Case(
        [
            USER,
            {
                "role": "assistant",
                "reasoning_content": "I need the weather tool.",
                "content": "",
                "tool_calls": [WEATHER_CALL],
            },
            WEATHER_RESULT,
            {"role": "assistant", "reasoning_content": "21 is mild.", "content": "Mild."},
        ],
        TOOLS,
    ),
    "inline_think": Case(
        [
            USER,
            {"role": "assistant", "content": "<think>\nLook outside.\n</think>\n\nSunny."},
            {"role": "user", "content": "Thanks"},
        ]
    ),
    "continue_partial": Case(
        [{"role": "user", "content": "Tell a story."}, {"role": "assistant", "content": "Once"}]
    ),
    "continue_trailing_space": Case(
        [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, "}]
    ),
    "unicode_and_markup": Case(
        [
            {"role": "system", "content": "Antworte auf Deutsch. /no_think"},
            {"role": "user", "content": "Grüße aus 東京 <b>&amp;</b> \"quotes\" 'single' 🚀"},
        ],
        [
            {
                "type": "function",
                "function": {
                    "name": "übersetze",
                    "description": "Übersetzt <Text> & mehr",
                    "parameters": {"type": "object", "properties": {}},
                },
            }
        ],
    ),
    "alternation_broken": Case([USER, {"role": "user", "content": "Hello?"}]),
}

# Conversations a template refuses by design (transformers raises for them too).
EXPECTED_REFUSALS = {
    ("llama3.2", "parallel_tool_calls"),  # "This model only supports single tool-calls"
    ("mistral-nemo", "alternation_broken"),
    # A tool-call turn without content (OpenAI's `content: null`, dropped as None):
    # these templates read message.content unguarded.
    ("qwen3", "tool_round_trip"),
    ("deepseek-r1-distill", "tool_round_trip"),
}


def _kwargs_variants(name: str, template: str) -> list[dict[str, Any]]:
    variants: list[dict[str, Any]] = [{}]
    if "enable_thinking" in template:
        variants += [{"enable_thinking": True}, {"enable_thinking": False}]
    if name == "llama3.2":
        variants += [{"date_string": "26 Jul 2024"}, {"tools_in_user_message": False}]
    return variants


def _flag_variants(case: Case) -> list[tuple[bool, bool]]:
    """(add_generation_prompt, continue_final_message) pairs worth rendering."""
    flags = [(False, False), (True, False)]
    if case.messages[-1]["role"] == "assistant":
        flags.append((False, True))
    return flags


class FixedClock(datetime):
    @classmethod
    def now(cls, tz: Any = None) -> FixedClock:
        return cls(2025, 3, 14, 9, 26, tzinfo=tz)


@dataclass
class Pair:
    """Transformers' tokenizer and ours for one checkpoint folder."""

    hf: Any
    ours: TextTokenizer
    templates: ChatTemplates


def _added_token(content: str) -> dict[str, Any]:
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def write_checkpoint(folder: Path, checkpoint: Checkpoint, template: str) -> None:
    tokenizer = train_byte_level_bpe(BPE_CORPUS * 4, 400, ("<unk>", "<s>", "</s>"))
    named = set(checkpoint.special_tokens.values())
    tokenizer.add_special_tokens(sorted(named - {"<unk>", "<s>", "</s>"}))
    tokenizer.add_tokens([t for t in checkpoint.control_tokens if t not in named])
    tokenizer.save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, token in checkpoint.special_tokens.items():
        # Real configs write tokens either way; eos as a serialized AddedToken.
        config[key] = _added_token(token) if key == "eos_token" else token
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def variants(name: str, pair: Pair, case: Case) -> Iterator[tuple[bool, bool, dict[str, Any]]]:
    template = pair.templates.default or ""
    for add_generation_prompt, continue_final_message in _flag_variants(case):
        for kwargs in _kwargs_variants(name, template):
            yield add_generation_prompt, continue_final_message, kwargs
