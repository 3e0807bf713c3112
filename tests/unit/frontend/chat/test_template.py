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
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import pytest

from services.common.tiny_checkpoint import train_byte_level_bpe
from services.frontend.chat.template import (
    ChatTemplates,
    TemplateError,
    compile_template,
    load_chat_templates,
    render_chat,
)
from tests.unit.frontend.chat.template_corpus import (
    BPE_CORPUS,
    CASES,
    CHECKPOINTS,
    EXPECTED_REFUSALS,
    USER,
    WEATHER_TOOL,
    Case,
    Pair,
    variants,
)

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


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_render_matches_transformers(
    pairs: dict[str, Pair], fixed_clock: None, name: str, case_name: str
) -> None:
    pair, case = pairs[name], CASES[case_name]
    rendered = 0
    for add_generation_prompt, continue_final_message, kwargs in variants(name, pair, case):
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
    tokenizer = train_byte_level_bpe(BPE_CORPUS, 300, ("<unk>", "<s>", "</s>"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    _config(tmp_path, tokenizer_class="PreTrainedTokenizerFast", chat_template="from config")
    _write(tmp_path, "chat_template.jinja", "from jinja")
    _write(tmp_path, "additional_chat_templates/tool_use.jinja", "tools")
    hf = transformers_module.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    ours = load_chat_templates(tmp_path)
    assert hf.chat_template == {"default": ours.default, **ours.named}
    assert hf.get_chat_template(tools=[WEATHER_TOOL]) == ours.select(has_tools=True)
    assert hf.get_chat_template() == ours.select(has_tools=False)
