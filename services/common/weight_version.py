"""Weight versions: the string every output carries to name the weights that made it."""

from __future__ import annotations

MAX_WEIGHT_VERSION_CHARS = 128


def check_weight_version(version: str, field: str) -> None:
    """A weight version is 1-128 printable characters (it goes on every output)."""
    if not version or len(version) > MAX_WEIGHT_VERSION_CHARS or not version.isprintable():
        raise ValueError(f"{field} must be 1-{MAX_WEIGHT_VERSION_CHARS} printable characters, "
                         f"got {version!r}")


def next_version(version: str) -> str:
    """The version an update gets when it names none: a number counts up, anything else
    gets "+1" appended."""
    return str(int(version) + 1) if version.isdigit() else f"{version}+1"
