"""`corestream <command> --help` renders for every command.

argparse formats every help text with %-interpolation when it renders, so one stray "%"
in a config field's documentation breaks that command's --help (and only its --help)."""

from __future__ import annotations

import argparse

from services.cli.main import build_parser


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_command_renders_its_help() -> None:
    parsers = commands()
    assert {"coordinator", "engine", "frontend", "serve"} <= set(parsers)
    for name, parser in parsers.items():
        text = parser.format_help()
        assert f"usage: corestream {name}" in text, name
        # Every flag is listed, with its help rendered.
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in text, (name, flag)


def test_the_engine_flags_reach_serve() -> None:
    parsers = commands()
    for name in ("engine", "serve"):
        assert "--no-huge-pages" in parsers[name].format_help(), name
