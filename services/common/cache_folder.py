"""Folders that several processes may write into the cache at once (the tiny checkpoint,
a GGUF file's view): each writes into a temporary folder of its own beside the target and
renames it into place, and the first rename wins."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def ensure_folder(target: Path, write: Callable[[Path], None],
                  marker: str = "config.json") -> Path:
    """`target`, after `write` filled it (into an empty staging folder) unless it holds
    `marker` already. Every writer writes the same bytes, so a lost race is no error."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
