from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from services.common.config import add_arguments, doc, from_args, to_argv


@dataclass(frozen=True)
class Example:
    name: str = doc("A name.", default="x")
    count: int = doc("A count.", default=3)
    ratio: float = doc("A ratio.", default=0.5)
    verbose: bool = doc("Talk more.", default=False)
    hosts: tuple[str, ...] = doc("Hosts.", default=())

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")


def parse(argv: list[str]) -> Example:
    parser = argparse.ArgumentParser()
    add_arguments(parser, Example)
    return from_args(Example, parser.parse_args(argv))


def test_defaults_and_flags() -> None:
    assert parse([]) == Example()
    got = parse(["--name", "y", "--count", "7", "--ratio", "2", "--verbose", "--hosts", "a", "b"])
    assert got == Example("y", 7, 2.0, True, ("a", "b"))


def test_to_argv_round_trips() -> None:
    config = Example("z", 9, 0.25, True, ("h1:1", "h2:2"))
    assert parse(to_argv(config)) == config
    assert to_argv(Example()) == []


def test_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="count must be >= 0"):
        parse(["--count", "-1"])


def test_existing_flags_are_shared_not_duplicated() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, Example)
    add_arguments(parser, Example)  # a second config with the same field names
    assert parser.parse_args(["--count", "4"]).count == 4
