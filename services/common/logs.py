"""One log format for every process, so interleaved `serve` output stays readable."""

from __future__ import annotations

import logging
import sys


def setup_logging(service: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {service}[%(process)d] %(name)s: %(message)s",
        force=True,
    )
