"""Hostile chat templates (what a client may send under --trust-request-chat-template):
each one is refused with a TemplateError that names the problem, within the render's
time limit and without building anything past its size limit; a normal template
renders as before under the same limits."""

from __future__ import annotations

import threading
import time
import tracemalloc

import pytest

from services.frontend.chat.template import RenderLimits, TemplateError, render_chat

USER = {"role": "user", "content": "hi"}
# Short enough to keep the endless templates quick, long enough for a slow CI core to
# render the normal ones many times over.
LIMITS = RenderLimits(seconds=0.5, max_chars=1 << 20)
# Refused templates end by the time limit at the latest; the slack covers one
# operation that started just before it (each is bounded by the size limit).
MAX_SECONDS = LIMITS.seconds + 1.5
# Peak Python allocation during one hostile render: a few strings of max_chars.
MAX_PEAK_BYTES = 64 << 20


def render(template: str, limits: RenderLimits = LIMITS) -> str:
    return render_chat(template, [USER], tools=None, add_generation_prompt=True,
                       continue_final_message=False, template_kwargs={}, special_tokens={},
                       limits=limits)


def refused(template: str) -> str:
    """The TemplateError's message; asserts the render was bounded in time and memory."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(TemplateError) as caught:
            render(template)
        seconds = time.monotonic() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seconds < MAX_SECONDS, f"took {seconds:.1f} s"
    assert peak < MAX_PEAK_BYTES, f"peak {peak >> 20} MiB"
    return str(caught.value)


# Attribute walks toward Python internals: the sandbox refuses each attribute.
ESCAPES = {
    "str class mro": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "cycler globals": "{{ cycler.__init__.__globals__ }}",
    "joiner globals": "{{ joiner.__init__.__globals__['os'] }}",
    "namespace globals": "{{ namespace.__init__.__globals__ }}",
    "dict builder globals": "{{ dict.__call__.__globals__ }}",
    "raise_exception globals": "{{ raise_exception.__globals__ }}",
    "tojson globals": "{{ (messages|tojson).__class__.__base__.__subclasses__() }}",
    "loop internals": "{% for m in messages %}{{ loop.__class__.__init__.__globals__ }}"
                      "{% endfor %}",
    "macro internals": "{% macro m() %}{% endmacro %}{{ m.__call__.__func__.__globals__ }}",
    "getattr filter": "{{ messages|attr('__class__') }}",
    "subscript walk": "{{ messages['__class__']['__mro__'] }}",
    "format attribute": "{{ '{0.__class__.__init__.__globals__}'.format(messages) }}",
    "format_map attribute": "{{ '{m.__class__}'.format_map({'m': messages}) }}",
    "namespace underscore": "{% set ns = namespace(__class__=1) %}{{ ns }}",
    "namespace set underscore": "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns }}",
    "list mutation": "{% set l = [] %}{{ l.append(1) }}",
    "dict mutation": "{{ messages[0].update({'role': 'system'}) }}",
}


@pytest.mark.parametrize("template", ESCAPES.values(), ids=ESCAPES.keys())
def test_attribute_walks_are_refused_or_empty(template: str) -> None:
    # jinja's sandbox either raises SecurityError (a TemplateError here) or yields
    # Undefined (empty text) for an unsafe attribute: neither leaks anything.
    try:
        rendered = render(template)
    except TemplateError as exc:
        assert "unsafe" in str(exc) or "underscore" in str(exc) or "not safely" in str(exc), exc
        return
    for leak in ("<class", "<module", "<function", "builtins", "__", "object at 0x"):
        assert leak not in rendered, rendered


# (template, words the refusal must contain)
BOUNDED = {
    "range past the sandbox's": ("{% for i in range(10**9) %}{% endfor %}", "number"),
    "nested empty loops": ("{% for i in range(100000) %}{% for j in range(100000) %}"
                           "{% endfor %}{% endfor %}", "render limit"),
    "loops in a macro": ("{% macro m() %}{% for i in range(100000) %}{{ i }}{% endfor %}"
                         "{% endmacro %}{% for j in range(100000) %}{% set x = m() %}"
                         "{% endfor %}", "render limit"),
    "exponential macro": ("{% macro d(n) %}{% if n %}{{ d(n - 1) }}{{ d(n - 1) }}{% endif %}"
                          "{% endmacro %}{{ d(60) }}", "render limit"),
    "endless recursion": ("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}",
                          "recursed too deeply"),
    "string multiplication": ("{{ 'a' * 10**9 }}", "repeated sequence"),
    "list multiplication": ("{{ ([1] * 10**8)|length }}", "repeated sequence"),
    "doubling with ~": ("{% set ns = namespace(s='a') %}{% for i in range(64) %}"
                        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}", "limit of"),
    "doubling with +": ("{% set ns = namespace(s='a') %}{% for i in range(64) %}"
                        "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}", "concatenation"),
    "doubling a list": ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}"
                        "{% set ns.l = ns.l + ns.l %}{% endfor %}", "concatenation"),
    "output past the cap": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
                            "output"),
    "huge power": ("{{ 10 ** 100000000 }}", "power"),
    "squaring in a loop": ("{% set ns = namespace(x=3) %}{% for i in range(64) %}"
                           "{% set ns.x = ns.x * ns.x %}{% endfor %}", "digits"),
    "center": ("{{ 'a'|center(10**9) }}", "center"),
    "str method width": ("{{ 'a'.ljust(10**9) }}", "ljust"),
    "zfill": ("{{ '1'.zfill(10**9) }}", "zfill"),
    "indent": ("{{ ('a\n' * 100000)|indent(1000) }}", "indent"),
    "replace empty": ("{{ ('a' * 100000)|replace('', 'b' * 100000) }}", "replace"),
    "str replace": ("{{ ('a' * 100000).replace('', 'b' * 100000) }}", "replace"),
    "join with a huge separator": ("{{ ('b' * 1000000).join(range(1000)|map('string')) }}",
                                   "join"),
    "join filter": ("{{ range(100000)|join('c' * 100000) }}", "join"),
    "percent width": ("{{ '%999999999d' % 1 }}", "formatted field"),
    "percent star width": ("{{ '%*d' % (999999999, 1) }}", "number"),
    "format width": ("{{ '{:>999999999}'.format(1) }}", "formatted field"),
    "nested format width": ("{{ '{0:{1}}'.format('a', 999999999) }}", "number"),
    "format filter": ("{{ '%999999999s'|format('a') }}", "formatted field"),
    "lipsum": ("{{ lipsum(n=10**6) }}", "lipsum"),
    "lipsum words": ("{{ lipsum(1, false, 10**6, 10**6 + 1) }}", "lipsum"),
    "tojson indent": ("{{ messages|tojson(indent=10**9) }}", "number"),
    "wordwrap": ("{{ ('a ' * 100000)|wordwrap(1, wrapstring='x' * 100000) }}", "wordwrap"),
}


@pytest.mark.parametrize(("template", "words"), BOUNDED.values(), ids=BOUNDED.keys())
def test_runaway_templates_are_stopped_by_a_named_limit(template: str, words: str) -> None:
    message = refused(template)
    assert words in message, message


DEEP = {
    "nested for": "{% for a in [1] %}" * 30 + "x" + "{% endfor %}" * 30,
    "nested if": "{% if 1 %}" * 200 + "x" + "{% endif %}" * 200,
    "nested parentheses": "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
    "nested lists": "{{ " + "[" * 5000 + "]" * 5000 + " }}",
    "nested filters": "{{ 1" + "|string" * 20000 + " }}",
    "nested macros": "".join(f"{{% macro m{i}() %}}" for i in range(40))
                     + "{% endmacro %}" * 40,
}


@pytest.mark.parametrize("template", DEEP.values(), ids=DEEP.keys())
def test_deep_nesting_is_a_template_error(template: str) -> None:
    # Python's compiler limits (statically nested blocks, indentation, recursion)
    # surface as SyntaxError, IndentationError or RecursionError: each is the
    # template's fault, not the server's.
    try:
        render(template)
    except TemplateError as exc:
        assert "nest" in str(exc) or "recursed" in str(exc) or "failed" in str(exc), exc


def test_a_real_template_renders_under_the_limits() -> None:
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content|trim }}\n{% endfor %}"
                "{% if tools %}{{ tools|tojson(indent=2) }}{% endif %}"
                "{{ '%s-%03d' % ('a', 7) }}{{ '{:>4}'.format(1) }}{{ 'x'|center(9) }}"
                "{{ range(3)|join(', ') }}{{ ('ab' * 3)|replace('a', 'c') }}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    assert render(template) == ("<|user|>hi\na-007   1    x    0, 1, 2cbcbcb<|assistant|>")


def test_output_exactly_at_the_cap_renders() -> None:
    limits = RenderLimits(seconds=5, max_chars=1000)
    assert render("{{ 'x' * 1000 }}", limits) == "x" * 1000
    with pytest.raises(TemplateError, match="1000 characters"):
        render("{{ 'x' * 1000 }}y", limits)


def test_a_slow_render_does_not_hold_back_one_on_another_thread() -> None:
    # The budget is per render (thread-local): a fast render beside an endless one
    # finishes normally, and the endless one still ends at its own deadline.
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    errors: list[str] = []

    def run_endless() -> None:
        try:
            render(endless)
        except TemplateError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=run_endless)
    thread.start()
    try:
        for _ in range(20):
            assert render("{{ messages[0].content }}") == "hi"
    finally:
        thread.join(MAX_SECONDS + 5)
    assert not thread.is_alive()
    assert errors and "render limit" in errors[0]
