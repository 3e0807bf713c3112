"""The CI-sized soak (#43): a two-engine, two-rank cluster under mixed traffic through
every door while each fault kind strikes once (seeded), then every invariant of
benchmarks/soak must hold. The hour-long run is `python -m benchmarks.soak --minutes 60`.
"""

from __future__ import annotations

import pytest

from benchmarks.soak.run import CI_CONFIG, run_soak

pytestmark = pytest.mark.timeout(900)


def test_every_fault_kind_once_under_traffic_loses_and_leaks_nothing() -> None:
    report = run_soak(CI_CONFIG)
    print(report.render())
    assert not report.violations, report.render()
