"""Weights collapsed onto transparent huge pages in place (services/engine/worker/huge_pages.py).

The planning (which 2 MiB stretches) is checked on made-up mappings; the collapse itself on
this process's memory, read back from /proc/self/smaps, where the kernel can do it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from services.engine.worker.huge_pages import (
    HugePageReport,
    _Mapping,
    _merged,
    _overlap,
    _regions,
    back_with_huge_pages,
    huge_page_size,
)
from services.engine.worker.model_runner import ModelRunner
from tests.unit.engine.hf_checkpoints import VOCAB, make_checkpoint
from tests.unit.engine.runner_driver import generate, make_runner, random_prompts

MIB = 1 << 20
SIZE = 2 * MIB


def test_stretches_lie_wholly_inside_one_anonymous_mapping() -> None:
    maps = [
        _Mapping(0, 3 * MIB, anonymous=True),  # ends mid-stretch: [2, 4) MiB is not its own
        _Mapping(3 * MIB, 12 * MIB, anonymous=True),  # starts mid-stretch
        _Mapping(12 * MIB, 20 * MIB, anonymous=False),  # a file: never
        _Mapping(20 * MIB, 30 * MIB, anonymous=True),
    ]
    # One range over the first three mappings and into the fourth.
    assert _regions([(1 * MIB, 21 * MIB)], maps, SIZE) == [
        0, 4 * MIB, 6 * MIB, 8 * MIB, 10 * MIB, 20 * MIB]
    # A stretch at least half of which the ranges hold is taken whole, neighbours' bytes
    # and all; one they hold less of is not worth its copy.
    assert _regions([(4 * MIB + MIB // 2, 5 * MIB + MIB // 2)], maps, SIZE) == [4 * MIB]
    assert _regions([(4 * MIB + MIB // 2, 5 * MIB + MIB // 3)], maps, SIZE) == []
    # Two ranges in one stretch count together, and it comes once.
    tenth = MIB // 10
    assert _regions([(4 * MIB, 4 * MIB + 6 * tenth), (5 * MIB, 5 * MIB + 6 * tenth)], maps,
                    SIZE) == [4 * MIB]
    assert _regions([(13 * MIB, 19 * MIB)], maps, SIZE) == []
    assert _regions([(40 * MIB, 50 * MIB)], maps, SIZE) == []


def test_ranges_are_merged_and_overlaps_counted_once() -> None:
    assert _merged([(10, 20), (0, 5), (5, 8), (15, 30), (40, 40)]) == [(0, 8), (10, 30)]
    assert _overlap([(0, 8), (10, 30)], [(4, 12), (25, 100)]) == 4 + 2 + 5


def smaps_huge_kib(start: int, end: int) -> int:
    """AnonHugePages of the mappings that overlap [start, end), in KiB (marking stretches
    splits a mapping into several)."""
    total = 0
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low < end and start < high
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def skip_where_nothing_can_collapse(report: HugePageReport) -> None:
    if not huge_page_size():
        pytest.skip("transparent huge pages are off on this machine")
    if "EINVAL" in report.why_not:
        pytest.skip(f"this kernel cannot collapse in place: {report.why_not}")


def collapse_or_skip(tensors: list[torch.Tensor]) -> HugePageReport:
    report = back_with_huge_pages(tensors)
    skip_where_nothing_can_collapse(report)
    return report


def test_a_tensor_is_collapsed_in_place_with_its_values() -> None:
    tensor = torch.randn(16 * MIB // 4)
    want = tensor.clone()
    address = tensor.data_ptr()
    report = collapse_or_skip([tensor, tensor[100:200]])  # a view: its bytes once
    assert report.total_bytes == tensor.nbytes
    # All of it but the stretches at its two ends, which its mapping may not hold whole.
    assert report.huge_bytes >= tensor.nbytes - 2 * SIZE, report
    huge_kib = smaps_huge_kib(address, address + tensor.nbytes)
    assert huge_kib * 1024 >= tensor.nbytes - 2 * SIZE
    assert tensor.data_ptr() == address
    assert torch.equal(tensor, want)
    assert report.describe().endswith(" of 16 MiB on huge pages"), report.describe()


def test_nothing_to_collapse() -> None:
    report = back_with_huge_pages([torch.empty(0), torch.zeros(3, device="meta")])
    assert report.total_bytes == report.huge_bytes == 0


def test_the_runner_streams_its_weights_from_huge_pages(tmp_path: Path) -> None:
    # Wide enough that its packed weights span whole 2 MiB stretches.
    make_checkpoint(tmp_path, "llama", hidden_size=512, intermediate_size=1408,
                    num_attention_heads=8, num_key_value_heads=4)
    prompts = random_prompts({"a": 7, "b": 12}, VOCAB)
    runner = make_runner(tmp_path)
    assert runner.huge_pages is not None
    # The collapse runs on its own thread: steps meanwhile read the same bytes.
    during = generate(runner, prompts, 6)
    report = runner.huge_pages.result(timeout=300)
    after = generate(runner, prompts, 6)
    off = ModelRunner(dataclasses.replace(runner.config, huge_pages=False))
    assert off.huge_pages is None
    assert during == after == generate(off, prompts, 6)
    skip_where_nothing_can_collapse(report)
    assert report.huge_bytes > report.total_bytes // 2, report.describe()
