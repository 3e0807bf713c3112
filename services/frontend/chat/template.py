"""Chat messages -> prompt text with the checkpoint's own Jinja chat template.

`render_chat` gives exactly what transformers' `apply_chat_template(..., tokenize=False)`
gives for the same inputs: the same sandbox options, globals and `tojson` filter, the same
clean-up of the messages (None-valued keys dropped, reasoning copied under its aliases)
and the same `continue_final_message` cut. It does so without transformers, because the
frontend never imports torch. Templates come from model repositories and are untrusted
code: they run in jinja's immutable sandbox, whose `dict` and `namespace` are narrowed
further so that a template cannot reach Python internals through them.

`load_chat_templates` finds the template(s) where transformers looks for them and the
special tokens (`bos_token`, ...) that templates read as variables.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
NAMED_TEMPLATE_DIR = "additional_chat_templates"
# Written by processors (multimodal checkpoints) before chat_template.jinja existed.
LEGACY_TEMPLATE_JSON = "chat_template.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
TOOL_USE_TEMPLATE = "tool_use"
DEFAULT_TEMPLATE = "default"

# The named special tokens transformers hands every template (`special_tokens_map`).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Names a message's reasoning arrives under; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to the final message for continue_final_message, then searched for in the
# output. It is transformers' tag: a template that transforms content (strip, split)
# must see the same string for the cut to land in the same place.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Variables render_chat sets itself; template_kwargs may not replace them.
_RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class TemplateError(ValueError):
    """The template refused the conversation (`raise_exception`) or failed to render."""


@dataclass(frozen=True)
class ChatTemplates:
    """A checkpoint's chat templates and the special tokens they read as variables."""

    default: str | None
    named: dict[str, str] = field(default_factory=dict)
    """Templates other than the default, by name (e.g. "tool_use")."""
    special_tokens: dict[str, str] = field(default_factory=dict)
    """bos_token, eos_token, ... as strings; only the ones the checkpoint defines."""

    def select(self, has_tools: bool) -> str | None:
        """The template for a request, picked as transformers' `get_chat_template` does.

        None when the checkpoint has none, or several named ones and no default.
        """
        if has_tools and TOOL_USE_TEMPLATE in self.named:
            return self.named[TOOL_USE_TEMPLATE]
        if self.default is not None:
            return self.default
        # transformers refuses a lone named template; using it is the only sensible pick.
        if len(self.named) == 1:
            return next(iter(self.named.values()))
        return None


def load_chat_templates(model_dir: Path, override_file: Path | None = None) -> ChatTemplates:
    """The checkpoint's templates, looked up in the order transformers uses.

    1. `override_file` (the `--chat-template` flag) replaces every template of the folder;
    2. `chat_template.jinja` (the default) and `additional_chat_templates/<name>.jinja`;
    3. `chat_template.json` ({"chat_template": ...}), as processors save it;
    4. `chat_template` in tokenizer_config.json: a string, or a list of
       {"name", "template"} where the one named "default" is the default.
    """
    model_dir = Path(model_dir)
    config = _read_json_object(model_dir / TOKENIZER_CONFIG) or {}
    special_tokens = _special_tokens(model_dir, config)
    if override_file is not None:
        template = Path(override_file).read_text(encoding="utf-8")
        return ChatTemplates(default=template, named={}, special_tokens=special_tokens)
    templates = (
        _templates_from_jinja_files(model_dir)
        or _template_from_legacy_json(model_dir)
        or _templates_from_config(config, model_dir / TOKENIZER_CONFIG)
    )
    default = templates.pop(DEFAULT_TEMPLATE, None)
    return ChatTemplates(default=default, named=templates, special_tokens=special_tokens)


def _templates_from_jinja_files(model_dir: Path) -> dict[str, str]:
    templates: dict[str, str] = {}
    named_dir = model_dir / NAMED_TEMPLATE_DIR
    if named_dir.is_dir():
        for path in sorted(named_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    default_file = model_dir / TEMPLATE_FILE
    if default_file.is_file():
        templates[DEFAULT_TEMPLATE] = default_file.read_text(encoding="utf-8")
    return templates


def _template_from_legacy_json(model_dir: Path) -> dict[str, str]:
    path = model_dir / LEGACY_TEMPLATE_JSON
    data = _read_json_object(path)
    if data is None:
        return {}
    template = data.get("chat_template")
    if not isinstance(template, str):
        raise ValueError(f"{path} has no string 'chat_template'")
    return {DEFAULT_TEMPLATE: template}


def _templates_from_config(config: dict[str, Any], path: Path) -> dict[str, str]:
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {DEFAULT_TEMPLATE: value}
    if isinstance(value, list) and all(_is_named_template(entry) for entry in value):
        return {entry["name"]: entry["template"] for entry in value}
    raise ValueError(
        f"{path}: chat_template must be a string or a list of {{'name', 'template'}} strings"
    )


def _is_named_template(entry: object) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("name"), str)
        and isinstance(entry.get("template"), str)
    )


def _special_tokens(model_dir: Path, config: dict[str, Any]) -> dict[str, str]:
    # Model-specific named tokens (e.g. "image_token") reach the template like bos_token.
    extra = config.get("extra_special_tokens")
    names = list(SPECIAL_TOKEN_NAMES)
    if isinstance(extra, dict):
        names += [name for name in extra if name not in names]
    # Old checkpoints keep some tokens only in special_tokens_map.json; the config wins.
    legacy = _read_json_object(model_dir / SPECIAL_TOKENS_MAP) or {}
    tokens: dict[str, str] = {}
    for name in names:
        value = config.get(name)
        if value is None and isinstance(extra, dict):
            value = extra.get(name)
        if value is None:
            value = legacy.get(name)
        token = _token_text(value)
        if token is not None:
            tokens[name] = token
    return tokens


def _token_text(value: object) -> str | None:
    """A token written as a string or as a serialized AddedToken ({"content": ...})."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json_object(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


# ---- rendering ----------------------------------------------------------------------


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: dict[str, Any],
    special_tokens: dict[str, str],
) -> str:
    """The prompt text for `messages`; TemplateError when it cannot be rendered.

    Messages are dicts (role, content, tool_calls with dict arguments, tool_call_id,
    reasoning_content); tools are {"type": "function", "function": {...}} schemas.
    `continue_final_message` leaves the last message open so the model extends it.
    """
    if not messages:
        raise TemplateError("cannot apply the chat template to an empty conversation")
    if continue_final_message and add_generation_prompt:
        raise TemplateError(
            "continue_final_message and add_generation_prompt cannot both be set: one "
            "continues the final message, the other opens a new assistant message"
        )
    reserved = sorted(_RESERVED_VARIABLES & template_kwargs.keys())
    if reserved:
        raise TemplateError(f"template kwargs may not set {', '.join(reserved)}")
    compiled = compile_template(template)
    chat = _prepare_messages(messages)
    final_text = _tag_final_message(chat, template) if continue_final_message else None
    # Special tokens first: a template kwarg of the same name replaces the token.
    variables: dict[str, Any] = {**special_tokens, **_plain_data(template_kwargs)}
    variables.update(
        messages=chat,
        tools=_plain_data(tools),
        documents=None,
        add_generation_prompt=add_generation_prompt,
    )
    try:
        rendered = compiled.render(variables)
    except _TemplateRaised as exc:
        raise TemplateError(str(exc.args[0])) from None
    except Exception as exc:  # the template is foreign code; any failure is its own
        raise TemplateError(f"chat template failed: {exc}") from exc
    if final_text is None:
        return rendered
    return _cut_after_final_message(rendered, final_text)


def compile_template(template: str) -> jinja2.Template:
    """The compiled template, cached by its source; TemplateError on a syntax error.

    Call it at startup to reject a broken template before the first request.
    """
    try:
        return _compile_cached(template)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template failed: {exc}") from exc


@lru_cache(maxsize=16)
def _compile_cached(template: str) -> jinja2.Template:
    return _environment().from_string(template)


def _prepare_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fresh plain copies as transformers hands them to the template.

    Keys whose value is None are dropped: templates test `is defined` and would print
    "None". Reasoning given under any alias appears under all of them, with "thinking"
    first in key order (a template iterating a message sees that order).
    """
    chat = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError(f"chat messages must be dicts, got {type(message).__name__}")
        plain = _plain_data({key: value for key, value in message.items() if value is not None})
        reasoning = next(
            (plain[key] for key in _REASONING_FIELDS if plain.get(key) is not None), None
        )
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        chat.append(plain)
    return chat


def _plain_data(value: Any) -> Any:
    """A deep copy made only of JSON types, so no foreign object's methods reach the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_data(key): _plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain_data(item) for item in value)
    return f"<{type(value).__name__}>"


def _tag_final_message(chat: list[dict[str, Any]], template: str) -> str:
    """Append the tag to the final message's text; returns that text, untagged."""
    final = chat[-1]
    content = final.get("content")
    if content is None:
        raise TemplateError(
            'continue_final_message is set but the final message has no "content" to continue'
        )
    if "content" not in template:
        raise TemplateError(
            "continue_final_message is set but the chat template never reads message content"
        )
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
        return content
    if isinstance(content, (list, tuple)):
        # Content parts: continue the last one that carries text.
        for part in reversed(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                text = part["text"]
                part["text"] = text + _CONTINUE_TAG
                return text
    raise TemplateError(
        "continue_final_message is set but the final message has no text to continue"
    )


def _cut_after_final_message(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise TemplateError(
            "continue_final_message is set but the final message does not appear in the "
            "rendered chat: the chat template drops or rewrites part of it"
        )
    tag_at = rendered.rindex(tag)
    if rendered.startswith(_CONTINUE_TAG, tag_at):
        return rendered[:tag_at]
    # The template trimmed the message's trailing whitespace (and with it the tag's
    # space), so the text before the tag may end in whitespace the model never saw.
    return rendered[:tag_at].rstrip()


# ---- the sandbox --------------------------------------------------------------------


class _TemplateRaised(jinja2.TemplateError):
    """What `raise_exception` throws, so its message reaches the client unchanged."""


def _raise_exception(message: object) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(format: str) -> str:
    # Local time, like transformers: Llama templates print "Today Date" from it.
    return datetime.now().strftime(format)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja's own tojson this keeps non-ASCII text and does not HTML-escape
    # "<", ">", "&" and "'": the model was trained on the plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _DictBuilder:
    """The template's `dict`: builds dicts, but is not the `dict` type itself.

    Handing templates the real type would expose its class attributes to them.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _GuardedNamespace(jinja2.utils.Namespace):
    """jinja's `namespace` without underscore names, which could shadow internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # Taking self positionally keeps `namespace(self=...)` usable in templates.
        self, rest = args[0], args[1:]
        attributes = dict(*rest, **kwargs)
        for name in attributes:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        super().__setitem__(name, value)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})"
        )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged.

    transformers uses the tag to find assistant tokens for training masks; serving only
    needs templates that carry it to compile and render the same text.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        # A call block, as transformers builds it, so the body gets the same scoping.
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictBuilder()
    env.globals["namespace"] = _GuardedNamespace
    return env
