"""render_chat against transformers' apply_chat_template on real published templates.

Each template renders a corpus of conversations (system prompts, multi-turn, tools,
tool calls and results, reasoning, continue_final_message, enable_thinking, generation
prompt on and off) through both, and the text and the token ids must agree; where
transformers refuses a conversation, render_chat must refuse it too. The tokenizers are
a tiny offline byte-level BPE plus each checkpoint's control tokens, written to a folder
that transformers and our loader both read.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import pytest

from services.common.tiny_checkpoint import train_byte_level_bpe
from services.frontend.chat import template as chat_template_module
from services.frontend.chat.template import (
    ChatTemplates,
    TemplateError,
    compile_template,
    load_chat_templates,
    render_chat,
)
from services.frontend.tokenizer import TextTokenizer

# CI checks shared/ out beside the repository clone.
TEMPLATES_DIR = Path(__file__).resolve().parents[3].parent / "shared" / "chat_templates"

_BPE_CORPUS = [
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


# ---- fixtures -----------------------------------------------------------------------


class _FixedClock(datetime):
    @classmethod
    def now(cls, tz: Any = None) -> _FixedClock:
        return cls(2025, 3, 14, 9, 26, tzinfo=tz)


@pytest.fixture(scope="module")
def transformers_module() -> Any:
    return pytest.importorskip("transformers")


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch, transformers_module: Any) -> None:
    """Both renderers see the same `strftime_now` date (Llama prints it)."""
    from transformers.utils import chat_template_utils

    monkeypatch.setattr(chat_template_utils, "datetime", _FixedClock)
    monkeypatch.setattr(chat_template_module, "datetime", _FixedClock)


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


def _write_checkpoint(folder: Path, checkpoint: Checkpoint, template: str) -> None:
    tokenizer = train_byte_level_bpe(_BPE_CORPUS * 4, 400, ("<unk>", "<s>", "</s>"))
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


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory, transformers_module: Any) -> dict[str, Pair]:
    if not TEMPLATES_DIR.is_dir():
        pytest.skip(f"shared chat templates not found at {TEMPLATES_DIR}")
    result = {}
    for name, checkpoint in CHECKPOINTS.items():
        folder = tmp_path_factory.mktemp(name)
        template = (TEMPLATES_DIR / checkpoint.file).read_text(encoding="utf-8")
        _write_checkpoint(folder, checkpoint, template)
        hf = transformers_module.PreTrainedTokenizerFast.from_pretrained(str(folder))
        result[name] = Pair(hf, TextTokenizer.from_dir(folder), load_chat_templates(folder))
    return result


# ---- comparison ---------------------------------------------------------------------


def _render_both(
    pair: Pair,
    case: Case,
    add_generation_prompt: bool,
    continue_final_message: bool,
    kwargs: dict[str, Any],
) -> tuple[Any, Any, Any]:
    """(transformers text or exception, transformers ids, our text or exception)."""
    hf_args = dict(
        tools=copy.deepcopy(case.tools),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **kwargs,
    )
    try:
        hf_text = pair.hf.apply_chat_template(
            copy.deepcopy(case.messages), tokenize=False, **hf_args
        )
        hf_ids = pair.hf.apply_chat_template(
            copy.deepcopy(case.messages), tokenize=True, return_dict=False, **hf_args
        )
    except Exception as exc:  # compared with our refusal below
        hf_text, hf_ids = exc, None
    template = pair.templates.select(has_tools=case.tools is not None)
    assert template is not None
    try:
        ours = render_chat(
            template,
            copy.deepcopy(case.messages),
            tools=copy.deepcopy(case.tools),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=dict(kwargs),
            special_tokens=pair.templates.special_tokens,
        )
    except TemplateError as exc:
        ours = exc
    return hf_text, hf_ids, ours


def _variants(name: str, pair: Pair, case: Case) -> Iterator[tuple[bool, bool, dict[str, Any]]]:
    template = pair.templates.default or ""
    for add_generation_prompt, continue_final_message in _flag_variants(case):
        for kwargs in _kwargs_variants(name, template):
            yield add_generation_prompt, continue_final_message, kwargs


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_render_matches_transformers(
    pairs: dict[str, Pair], fixed_clock: None, name: str, case_name: str
) -> None:
    pair, case = pairs[name], CASES[case_name]
    rendered = 0
    for add_generation_prompt, continue_final_message, kwargs in _variants(name, pair, case):
        where = f"{name}/{case_name} agp={add_generation_prompt} "
        where += f"continue={continue_final_message} kwargs={kwargs}"
        hf_text, hf_ids, ours = _render_both(
            pair, case, add_generation_prompt, continue_final_message, kwargs
        )
        if isinstance(hf_text, Exception):
            assert isinstance(ours, TemplateError), f"{where}: transformers raised {hf_text!r}"
            if type(hf_text) is jinja2.TemplateError:  # the template's raise_exception
                assert str(ours) == str(hf_text), where
            elif isinstance(hf_text, jinja2.TemplateError):
                assert str(ours) == f"chat template failed: {hf_text}", where
            continue
        assert not isinstance(ours, Exception), f"{where}: we raised {ours!r}"
        assert ours == hf_text, where
        assert pair.ours.encode(ours, add_special_tokens=False) == hf_ids, where
        rendered += 1
    if (name, case_name) in EXPECTED_REFUSALS:
        assert rendered == 0
    else:
        assert rendered > 0, "every variant was refused"


def test_special_tokens_match_transformers(pairs: dict[str, Pair]) -> None:
    for name, pair in pairs.items():
        assert pair.templates.special_tokens == pair.hf.special_tokens_map, name
        assert pair.templates.special_tokens == CHECKPOINTS[name].special_tokens, name


def test_llama_date_on_the_real_clock(pairs: dict[str, Pair]) -> None:
    pair = pairs["llama3.2"]
    before = pair.hf.apply_chat_template([USER], tokenize=False)
    ours = render_chat(
        pair.templates.default or "",
        [USER],
        tools=None,
        add_generation_prompt=False,
        continue_final_message=False,
        template_kwargs={},
        special_tokens=pair.templates.special_tokens,
    )
    after = pair.hf.apply_chat_template([USER], tokenize=False)
    assert ours in (before, after)  # equal unless the test straddles midnight
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}" in ours + after


def test_mistral_alternation_raises_the_templates_message(pairs: dict[str, Pair]) -> None:
    pair = pairs["mistral-nemo"]
    with pytest.raises(TemplateError) as raised:
        render_chat(
            pair.templates.default or "",
            [USER, USER],
            tools=None,
            add_generation_prompt=True,
            continue_final_message=False,
            template_kwargs={},
            special_tokens=pair.templates.special_tokens,
        )
    assert str(raised.value) == (
        "After the optional system message, conversation roles must alternate "
        "user/assistant/user/assistant/..."
    )


# ---- small templates: errors, sandbox, filters ----------------------------------------


def _render(template: str, messages: list[dict[str, Any]] | None = None, **options: Any) -> str:
    arguments: dict[str, Any] = dict(
        tools=None,
        add_generation_prompt=False,
        continue_final_message=False,
        template_kwargs={},
        special_tokens={},
    )
    arguments.update(options)
    return render_chat(template, messages or [USER], **arguments)


def test_render_errors_become_template_errors() -> None:
    with pytest.raises(TemplateError, match="^chat template failed: "):
        _render("{% for m in messages %}")  # syntax error
    with pytest.raises(TemplateError, match="^chat template failed: "):
        _render("{{ messages[0].content + 1 }}")
    with pytest.raises(TemplateError, match="^chat template failed: "):
        _render("{% set ns = namespace(_hidden=1) %}")
    with pytest.raises(TemplateError, match="^no way$"):
        _render("{{ raise_exception('no way') }}")
    with pytest.raises(TemplateError, match="empty conversation"):
        render_chat(
            "x",
            [],
            tools=None,
            add_generation_prompt=False,
            continue_final_message=False,
            template_kwargs={},
            special_tokens={},
        )
    with pytest.raises(TemplateError, match="may not set messages"):
        _render("x", template_kwargs={"messages": []})


PARTIAL = [USER, {"role": "assistant", "content": "It is"}]


def test_continue_final_message_excludes_the_generation_prompt() -> None:
    with pytest.raises(TemplateError, match="cannot both be set"):
        _render("{{ messages }}", PARTIAL, add_generation_prompt=True, continue_final_message=True)


@pytest.mark.parametrize(
    ("template", "messages", "message"),
    [
        ("{% for m in messages %}{{ m.role }}{% endfor %}", PARTIAL, "never reads message content"),
        ("{{ messages[0].content }}", [USER, {"role": "assistant"}], 'no "content"'),
        # The template cuts the final message, so there is nothing to continue after.
        ("{% for m in messages %}{{ m.content[:3] }}{% endfor %}", PARTIAL, "does not appear"),
    ],
)
def test_continue_final_message_refusals(
    transformers_module: Any, template: str, messages: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises(TemplateError, match=message):
        _render(template, copy.deepcopy(messages), continue_final_message=True)
    with pytest.raises(ValueError):
        _hf_render(transformers_module, template, messages, continue_final_message=True)


def test_content_parts_continue_the_last_text_part(transformers_module: Any) -> None:
    template = (
        "{% for m in messages %}<{{ m.role }}>{% for p in m.content %}"
        "{% if p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endfor %}"
    )
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Describe"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A red"}, {"type": "image"}]},
    ]
    ours = _render(template, copy.deepcopy(messages), continue_final_message=True)
    assert ours == "<user>Describe<assistant>A red"
    assert ours == _hf_render(transformers_module, template, messages, continue_final_message=True)


def _hf_render(transformers_module: Any, template: str, messages: list[Any], **kwargs: Any) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[copy.deepcopy(messages)], chat_template=template, **kwargs
    )
    return rendered[0]


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages | tojson }}",
        "{{ tools | tojson(indent=2, sort_keys=True) }}",
        "{{ messages[0] | tojson(separators=(',', ':'), ensure_ascii=True) }}",
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m }}{% endfor %}",
        "{% set d = dict(a=1, b=[2]) %}{{ d | tojson }}|{{ dict.fromkeys(['x'], 0) }}",
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% endfor %}{{ ns.n }}",
        "{% for k, v in messages[1].items() %}{{ k }}={{ v }};{% endfor %}",
        "  {% if true %}\n    kept\n  {% endif %}\n{{ bos_token }}{{ foo }}",
    ],
)
def test_environment_matches_transformers(transformers_module: Any, template: str) -> None:
    messages = [
        {"role": "user", "content": "Grüße <b> & 'x' 東京", "name": None},
        {"role": "assistant", "content": "ok", "reasoning": "why"},
    ]
    tools = [WEATHER_TOOL]
    kwargs = {"bos_token": "<s>", "foo": "bar"}
    ours = _render(
        template,
        copy.deepcopy(messages),
        tools=tools,
        template_kwargs={"foo": "bar"},
        special_tokens={"bos_token": "<s>"},
    )
    hf_messages = transformers_module.utils.chat_template_utils._normalize_chat_messages(messages)
    assert ours == _hf_render(transformers_module, template, hf_messages, tools=tools, **kwargs)


def test_templates_compile_once() -> None:
    assert compile_template("{{ 1 }}") is compile_template("{{ 1 }}")


# ---- loading ------------------------------------------------------------------------


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _config(folder: Path, **fields: Any) -> None:
    _write(folder, "tokenizer_config.json", json.dumps(fields))


def test_loads_a_string_template_and_special_tokens(tmp_path: Path) -> None:
    _config(
        tmp_path,
        chat_template="T",
        bos_token="<s>",
        eos_token={"content": "</s>", "lstrip": False, "special": True},
        pad_token=None,
        extra_special_tokens={"image_token": "<image>"},
    )
    _write(
        tmp_path, "special_tokens_map.json", json.dumps({"unk_token": "<unk>", "bos_token": "x"})
    )
    templates = load_chat_templates(tmp_path)
    assert templates == ChatTemplates(
        default="T",
        named={},
        special_tokens={
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "image_token": "<image>",
        },
    )
    assert templates.select(has_tools=True) == "T"


def test_loads_named_templates_from_the_config(tmp_path: Path) -> None:
    _config(
        tmp_path,
        chat_template=[
            {"name": "default", "template": "D"},
            {"name": "tool_use", "template": "U"},
            {"name": "rag", "template": "R"},
        ],
    )
    templates = load_chat_templates(tmp_path)
    assert templates.default == "D"
    assert templates.named == {"tool_use": "U", "rag": "R"}
    assert templates.select(has_tools=True) == "U"
    assert templates.select(has_tools=False) == "D"


def test_named_templates_without_default() -> None:
    assert ChatTemplates(default=None, named={"chatml": "C"}).select(has_tools=False) == "C"
    two = ChatTemplates(default=None, named={"tool_use": "U", "rag": "R"})
    assert two.select(has_tools=True) == "U"
    assert two.select(has_tools=False) is None


def test_jinja_files_win_over_the_config(tmp_path: Path) -> None:
    _config(tmp_path, chat_template="from config")
    _write(tmp_path, "chat_template.json", json.dumps({"chat_template": "from json"}))
    _write(tmp_path, "chat_template.jinja", "from jinja")
    _write(tmp_path, "additional_chat_templates/tool_use.jinja", "tools")
    templates = load_chat_templates(tmp_path)
    assert templates.default == "from jinja"
    assert templates.named == {"tool_use": "tools"}


def test_legacy_json_wins_over_the_config(tmp_path: Path) -> None:
    _config(tmp_path, chat_template="from config")
    _write(tmp_path, "chat_template.json", json.dumps({"chat_template": "from json"}))
    assert load_chat_templates(tmp_path).default == "from json"


def test_override_file_wins(tmp_path: Path) -> None:
    _config(tmp_path, chat_template=[{"name": "tool_use", "template": "U"}], eos_token="</s>")
    _write(tmp_path, "chat_template.jinja", "from jinja")
    override = _write(tmp_path / "elsewhere", "mine.jinja", "mine")
    templates = load_chat_templates(tmp_path, override_file=override)
    assert templates == ChatTemplates("mine", {}, {"eos_token": "</s>"})
    assert templates.select(has_tools=True) == "mine"


def test_no_template(tmp_path: Path) -> None:
    templates = load_chat_templates(tmp_path)
    assert templates.default is None and templates.select(has_tools=False) is None
    _config(tmp_path, bos_token="<s>")
    assert load_chat_templates(tmp_path).default is None


def test_loading_agrees_with_transformers(tmp_path: Path, transformers_module: Any) -> None:
    tokenizer = train_byte_level_bpe(_BPE_CORPUS, 300, ("<unk>", "<s>", "</s>"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    _config(tmp_path, tokenizer_class="PreTrainedTokenizerFast", chat_template="from config")
    _write(tmp_path, "chat_template.jinja", "from jinja")
    _write(tmp_path, "additional_chat_templates/tool_use.jinja", "tools")
    hf = transformers_module.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    ours = load_chat_templates(tmp_path)
    assert hf.chat_template == {"default": ours.default, **ours.named}
    assert hf.get_chat_template(tools=[WEATHER_TOOL]) == ours.select(has_tools=True)
    assert hf.get_chat_template() == ours.select(has_tools=False)
