from __future__ import annotations

import functools
import os
from typing import Any

import pytest

from tests.helm.chart import CASES, HELM, render


@pytest.fixture(scope="session")
def helm_binary() -> None:
    # `make test` installs helm first, so a missing binary means a bare `pytest` run;
    # in CI that must fail, not skip.
    if not HELM.is_file():
        message = f"{HELM} is missing: run `make helm` (make test does it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@functools.cache
def _rendered(case: str) -> tuple[dict[str, Any], ...]:
    return tuple(render(CASES[case]))


@pytest.fixture(scope="session")
def rendered(helm_binary: None) -> Any:
    """rendered(case) -> the objects of that golden case, rendered once per session."""
    return _rendered
