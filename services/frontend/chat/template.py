"""Chat messages -> prompt text with the checkpoint's own Jinja chat template.

`render_chat` gives exactly what transformers' `apply_chat_template(..., tokenize=False)`
gives for the same inputs: the same sandbox options, globals and `tojson` filter, the same
clean-up of the messages (None-valued keys dropped, reasoning copied under its aliases)
and the same `continue_final_message` cut. It does so without transformers, because the
frontend never imports torch. Templates come from model repositories and are untrusted
code: they run in jinja's immutable sandbox, whose `dict` and `namespace` are narrowed
further so that a template cannot reach Python internals through them. The sandbox
guards what a template may touch, not how much it may do, so rendering is also held to
`RenderLimits`: a deadline checked on every loop pass, macro call, call and operator,
and a cap on the size of every string, list and number a template builds (checked
before the operations that could make a huge one in a single step).

`load_chat_templates` finds the template(s) where transformers looks for them and the
special tokens (`bos_token`, ...) that templates read as variables.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sized
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
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


# Defaults of RenderLimits. A real chat template renders a long conversation in
# milliseconds into little more than the messages' own text.
DEFAULT_RENDER_SECONDS = 2.0
DEFAULT_MAX_RENDERED_CHARS = 8 << 20
# Numbers a template computes stay within Python's own limit for printing an int:
# arithmetic on far bigger ones (squaring in a loop) takes seconds per step.
_MAX_INT_DIGITS = 4300
# lipsum(n, min, max) writes up to n * max words in pure Python: about a second per
# million. Real templates never call it; it stays (transformers' templates may) but small.
_MAX_LIPSUM_WORDS = 100_000
# Digits of a number (width, precision) inside a format string that a template may
# format with; a wider one could ask for a string past any cap in one step.
_FORMAT_NUMBER = re.compile(r"\d+")


class TemplateError(ValueError):
    """The template refused the conversation (`raise_exception`) or failed to render."""


@dataclass(frozen=True)
class RenderLimits:
    """How much work one render may do: wall-clock seconds, and the size (characters of
    a string, items of a list, digits of a number) of any value the template builds,
    its output included."""

    seconds: float = DEFAULT_RENDER_SECONDS
    max_chars: int = DEFAULT_MAX_RENDERED_CHARS


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
    limits: RenderLimits = RenderLimits(),
) -> str:
    """The prompt text for `messages`; TemplateError when it cannot be rendered.

    Messages are dicts (role, content, tool_calls with dict arguments, tool_call_id,
    reasoning_content); tools are {"type": "function", "function": {...}} schemas.
    `continue_final_message` leaves the last message open so the model extends it.
    A render past `limits` is a TemplateError that names the limit.
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
        with _budget(limits):
            rendered = _render_bounded(compiled, variables, limits)
    except _TemplateRaised as exc:
        raise TemplateError(str(exc.args[0])) from None
    except _OverBudget as exc:
        raise TemplateError(str(exc)) from None
    except RecursionError:
        raise TemplateError("chat template failed: it recursed too deeply (a macro that "
                            "calls itself without end?)") from None
    except MemoryError:
        raise TemplateError("chat template failed: it ran out of memory") from None
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
    except (RecursionError, MemoryError):
        # jinja's parser and Python's compiler recurse on nesting: (((...))), [[[...]]].
        raise TemplateError("chat template failed to compile: it nests too deeply") from None
    except SyntaxError as exc:
        # Python's own limits on the code jinja generates ("too many statically nested
        # blocks": about 20 nested {% for %} or {% if %}; 100 levels of indentation).
        raise TemplateError(f"chat template failed to compile: {exc.msg} (the template "
                            "nests its blocks too deeply)") from None


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


class _OverBudget(Exception):
    """A render ran past its RenderLimits. Not a TemplateError of jinja's, so that a
    template's own error handling (there is none in jinja, but filters catch some
    exceptions) cannot swallow it."""


class _Budget:
    __slots__ = ("deadline", "limits")

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds


# Renders run on worker threads; each thread renders one template at a time.
_active = threading.local()


class _budget:  # noqa: N801 (a context manager, used like a function)
    def __init__(self, limits: RenderLimits) -> None:
        self._budget = _Budget(limits)

    def __enter__(self) -> None:
        self._outer = getattr(_active, "budget", None)
        _active.budget = self._budget

    def __exit__(self, *exc: object) -> None:
        _active.budget = self._outer


def _current() -> _Budget | None:
    return getattr(_active, "budget", None)


def _checkpoint() -> None:
    """Called on every loop pass, block and call: ends a render past its deadline."""
    budget = _current()
    if budget is not None and time.monotonic() > budget.deadline:
        raise _OverBudget(f"chat template took longer than its {budget.limits.seconds:g} s "
                          "render limit (a huge or endless loop?)")


def _size(value: Any) -> int:
    """What a value costs against max_chars: a string's or list's length."""
    if isinstance(value, (str, bytes, list, tuple, dict, set)):
        return len(value)
    return 0


def _digits(value: int) -> int:
    return value.bit_length() * 3 // 10


def _check_size(value: Any, what: str) -> Any:
    budget = _current()
    if budget is None:
        return value
    if _size(value) > budget.limits.max_chars:
        raise _OverBudget(f"chat template made {what} of size {_size(value)}, past the "
                          f"limit of {budget.limits.max_chars} characters")
    if isinstance(value, int) and _digits(value) > _MAX_INT_DIGITS:
        raise _OverBudget(f"chat template made a number of {_digits(value)} digits, past "
                          f"the limit of {_MAX_INT_DIGITS}")
    return value


def _check_digits(digits: int, what: str) -> None:
    if _current() is not None and digits > _MAX_INT_DIGITS:
        raise _OverBudget(f"chat template asked for {what} of {digits} digits, past the "
                          f"limit of {_MAX_INT_DIGITS}")


def _check_planned(size: int, what: str) -> None:
    """Refuse an operation whose result would pass the cap, before it runs."""
    budget = _current()
    if budget is not None and size > budget.limits.max_chars:
        raise _OverBudget(f"chat template asked for {what} of size {size}, past the limit "
                          f"of {budget.limits.max_chars} characters")


def _length(value: Any) -> int:
    return len(value) if isinstance(value, Sized) else 1


def _check_format_string(text: Any) -> None:
    """A width or precision inside a format string ("%999999999d", "{:>999999999}")
    makes a string of that size in one step."""
    if isinstance(text, str):
        for number in _FORMAT_NUMBER.findall(text):
            _check_planned(int(number) if len(number) < 20 else 1 << 64,
                           "a formatted field")


def _check_arguments(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                     bound_to: Any = None) -> None:
    """Arguments that could make a result past the cap in one call: a number past it
    (a width, a count), and the products that join, replace, format and indent make
    of their inputs. `bound_to`: a method's own object (the separator of str.join,
    the format of str.format)."""
    values = (*args, *kwargs.values(), *(() if bound_to is None else (bound_to,)))
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool):
            _check_planned(abs(value), f"a number ({name})")
    strings = [v for v in values if isinstance(v, str)]
    longest = max((len(v) for v in strings), default=0)
    if name in ("join", "replace", "indent", "format", "center", "ljust", "rjust", "zfill",
                "wordwrap", "expandtabs"):
        # Every one of these makes at most (input length) x (its other input) characters.
        items = max((_length(v) for v in values if not isinstance(v, (int, float))),
                    default=1)
        counts = [abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]
        _check_planned(items * max(longest, *counts, 1), f"the result of {name}")
    if name in ("format", "format_map"):
        for value in strings:
            _check_format_string(value)
    if name == "generate_lorem_ipsum":
        n, low, high = (list(args) + [5, 20, 100])[:3]
        words = kwargs.get("n", n) * kwargs.get("max", high)
        if words > _MAX_LIPSUM_WORDS:
            raise _OverBudget(f"chat template asked lipsum for {words} words, past the limit "
                              f"of {_MAX_LIPSUM_WORDS}")


def _materialized(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """Iterators (what map, select and friends give) as lists, so their sizes count."""
    return tuple(list(v) if isinstance(v, Iterator) else v for v in values)


def _bound_object(function: Any) -> Any:
    """The object a method is bound to, through the sandbox's str.format wrapper."""
    bound = getattr(function, "__self__", None)
    if bound is None and hasattr(function, "__wrapped__"):
        bound = getattr(function.__wrapped__, "__self__", None)
    return bound if isinstance(bound, (str, list, tuple, dict)) else None


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for sequence, count in ((left, right), (right, left)):
            if isinstance(count, int) and isinstance(sequence, (str, list, tuple)):
                _check_planned(len(sequence) * abs(count), "a repeated sequence")
        if isinstance(left, int) and isinstance(right, int):
            _check_digits(_digits(left) + _digits(right), "a product")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int):
        if abs(left) > 1 and right > 0:
            _check_digits(_digits(left) * right, "a power")
    elif operator == "%" and isinstance(left, str):
        _check_format_string(left)
        args = right if isinstance(right, tuple) else (right,)
        _check_arguments("format", args, {})
    elif operator == "+" and isinstance(left, (str, list, tuple)):
        _check_planned(_length(left) + _length(right), "a concatenation")


class _BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
    """jinja's code generator with a budget checkpoint at the start of every block
    (a loop's body on each pass, a macro's body on each call) and around `~`."""

    def blockvisit(self, nodes: Any, frame: jinja2.compiler.Frame) -> None:
        self.writeline("environment.checkpoint()")
        super().blockvisit(nodes, frame)

    def _output_child_to_const(self, node: jinja2.nodes.Expr, frame: jinja2.compiler.Frame,
                               finalize: Any) -> str:
        # jinja evaluates a constant `{{ ... }}` while compiling, optimizer or not:
        # `{{ '%999999999s'|format('a') }}` would run outside any render's limits.
        if isinstance(node, (jinja2.nodes.TemplateData, jinja2.nodes.Const)):
            return super()._output_child_to_const(node, frame, finalize)  # type: ignore[no-any-return]
        raise jinja2.nodes.Impossible()

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: jinja2.compiler.Frame) -> None:
        self.write("environment.checked_concat(")
        super().visit_Concat(node, frame)
        self.write(")")


def _render_bounded(compiled: jinja2.Template, variables: dict[str, Any],
                    limits: RenderLimits) -> str:
    """`compiled.render`, with the output's size counted as it is made."""
    pieces: list[str] = []
    total = 0
    for piece in compiled.generate(variables):
        total += len(piece)
        if total > limits.max_chars:
            raise _OverBudget(f"chat template output passed the limit of {limits.max_chars} "
                              "characters")
        pieces.append(piece)
    return "".join(pieces)


def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """A filter that checks the budget before it runs and its result's size after."""
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _checkpoint()
        args = _materialized(args)
        _check_arguments(name, args, kwargs)
        return _check_size(function(*args, **kwargs), f"the result of filter {name!r}")

    # jinja reads pass_context and the like from the function's attributes.
    bounded.__dict__.update(getattr(function, "__dict__", {}))
    bounded.__name__ = name
    return bounded


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


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with every call, operator and `~` checked against the
    render's budget (see RenderLimits). Operators are intercepted, which also keeps
    jinja from folding `10 ** 10 ** 9` into a constant while it compiles."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset(("*", "**", "%", "+", "//", "/", "-"))

    def checkpoint(self) -> None:
        _checkpoint()

    def checked_concat(self, value: str) -> str:
        return _check_size(value, "a string")  # type: ignore[no-any-return]

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any,
                   right: Any) -> Any:
        _checkpoint()
        _check_binop(operator, left, right)
        return _check_size(super().call_binop(context, operator, left, right),
                           f"the result of {operator!r}")

    def call(__self, __context: jinja2.runtime.Context, __obj: Any,  # noqa: N805
             *args: Any, **kwargs: Any) -> Any:
        _checkpoint()
        args = _materialized(args)
        _check_arguments(getattr(__obj, "__name__", ""), args, kwargs, _bound_object(__obj))
        result = super().call(__context, __obj, *args, **kwargs)
        return _check_size(result, "the result of a call")

    def format_string(self, s: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                      format_func: Callable[..., Any] | None = None) -> str:
        _check_format_string(s)
        _check_arguments("format", args, kwargs)
        return _check_size(super().format_string(s, args, kwargs, format_func),
                           "a formatted string")


def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(
        # No constant folding: jinja would call filters and operators on constants
        # while compiling, outside any render's limits ('%999999999s'|format('a')).
        optimized=False,
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, function)
                   for name, function in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictBuilder()
    env.globals["namespace"] = _GuardedNamespace
    return env
