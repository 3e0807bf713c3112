"""Frozen config dataclasses <-> command-line flags.

Every component has one frozen dataclass whose fields carry their help text in
`metadata["help"]`; this module turns such a class into argparse flags
(`field_name` -> `--field-name`), builds the dataclass back from parsed args, and
turns an instance into argv, which `corestream serve` uses to pass each child
process exactly its own flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")

CONFIG_ERROR_EXIT = 2
"""The exit code of a process that refused its configuration (a flag's value, the
checkpoint, a busy port): `corestream` exits so after printing why, as argparse does
for a bad flag. Never restarted."""
LEFT_OUT_EXIT = 3
"""The exit code of an expert-parallel rank whose group went on without it (it came back
after the others' engine_recovery_timeout_s): restarting it alone cannot help, so serve
leaves it out; restarting the whole group brings it back."""


def doc(help: str, **kwargs: Any) -> Any:
    """A dataclass field with help text (shown by --help)."""
    return dataclasses.field(metadata={"help": help}, **kwargs)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_type(tp: Any) -> tuple[Any, bool, bool]:
    """(element type, optional, sequence) of an annotation."""
    optional = False
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        tp = args[0]
        origin = typing.get_origin(tp)
    if origin in (tuple, list):
        return typing.get_args(tp)[0], optional, True
    return tp, optional, False


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
    exclude: Iterable[str] = (),
) -> None:
    """Add one flag per field of `cls`, skipping flags the parser already has (a group
    shares its parser's flags)."""
    hints = typing.get_type_hints(cls)
    existing = {a for action in parser._actions for a in action.option_strings}
    skip = set(exclude)
    for f in dataclasses.fields(cls):
        if f.name in skip or _flag(f.name) in existing:
            continue
        tp, optional, sequence = _scalar_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_text = f.metadata.get("help", "")
        if tp is bool:
            parser.add_argument(
                _flag(f.name), action=argparse.BooleanOptionalAction, default=default,
                help=help_text,
            )
            continue
        kwargs: dict[str, Any] = {"type": tp, "default": default, "help": help_text}
        if sequence:
            kwargs["nargs"] = "*"
        if optional or sequence:
            kwargs["help"] = f"{help_text} (default: {default!r})"
        else:
            kwargs["help"] = f"{help_text} (default: %(default)s)"
        parser.add_argument(_flag(f.name), **kwargs)


def from_args(cls: type[T], args: argparse.Namespace, exclude: Iterable[str] = ()) -> T:
    """Build `cls` from parsed args (excluded fields keep their defaults).

    Validation runs in the dataclass's __post_init__.
    """
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    skip = set(exclude)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in skip or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if _scalar_type(hints[f.name])[2] and value is not None:
            value = tuple(value)
        values[f.name] = value
    return cls(**values)


def to_argv(config: Any) -> list[str]:
    """The flags that rebuild `config` in another process (defaults omitted)."""
    argv: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if value == default:
            continue
        if isinstance(value, bool):
            argv.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, tuple | list):
            argv += [_flag(f.name), *map(str, value)]
        elif value is None:
            raise ValueError(f"cannot pass {f.name}=None when its default is {default!r}")
        else:
            argv += [_flag(f.name), str(value)]
    return argv
