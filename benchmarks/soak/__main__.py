"""`python -m benchmarks.soak`: see run.py."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from benchmarks.soak.run import CI_CONFIG, SoakConfig, run_soak  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ci", action="store_true",
                        help="the CI-sized run: every fault kind once in 100 s")
    parser.add_argument("--minutes", type=float, help="how long traffic runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, help="requests a second")
    parser.add_argument("--fault-gap", type=float,
                        help="mean seconds between faults (not with --ci)")
    parser.add_argument("--warm-minutes", type=float,
                        help="fault-free traffic before the processes' warm levels")
    args = parser.parse_args()
    config = CI_CONFIG if args.ci else SoakConfig(every_kind_once=False)
    changes: dict[str, object] = {"seed": args.seed}
    if args.minutes is not None:
        changes["duration_s"] = args.minutes * 60
    if args.rate is not None:
        changes["rate"] = args.rate
    if args.warm_minutes is not None:
        changes["warm_s"] = args.warm_minutes * 60
    if args.fault_gap is not None:
        changes["mean_fault_gap_s"] = args.fault_gap
    report = run_soak(dataclasses.replace(config, **changes))
    print(report.render())
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
