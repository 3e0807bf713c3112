"""Weights on transparent huge pages: `back_with_huge_pages`.

A decode step on CPU streams every weight from memory once per token, and the step's time
is the weights' bytes over the read bandwidth. On 4 KiB pages that stream crosses a page,
and a TLB miss, every 4 KiB (27,000 of them a step for a 110 MB model); on 2 MiB pages
every 2 MiB. Measured on 2 cores of an AMD EPYC (Zen 4), the benchmark checkpoint's
decode op in process, alternating per round: 0.86x the time in float32 and 0.93x in
bfloat16 with its weights on huge pages (tokens identical); `torch.sum` over 111 MB
0.90-0.95x.

The weights are not allocated by us: oneDNN packs each linear's weight into memory of its
own choosing (the glibc heap, or a mapping of its own above malloc's mmap threshold), so
they cannot be placed on huge pages as they are allocated. Instead, once loaded, the 2
MiB-aligned stretches of anonymous memory that they fill at least half of are marked
MADV_HUGEPAGE and collapsed in place with MADV_COLLAPSE (Linux 6.1+), which copies each
stretch's pages into one huge page at the same addresses. Nothing moves, nothing is copied
twice, the bytes are the same; a stretch may also hold a neighbour's bytes, which is
harmless. Where the kernel cannot collapse (older kernels, THP off, no free huge page) the
weights stay where they are, as fast as before; with THP in "madvise" mode khugepaged may
still collapse the marked stretches later.

Collapsing copies: ~0.5 ms per 2 MiB, and 16-17 ms on a VM whose host backs guest memory
lazily, the first time that memory is used (minutes for a model of many GB). So the
engine collapses on a thread of its own (`collapse_in_background`) and serves meanwhile:
a stretch being collapsed is briefly unmapped, and a thread that reads it then waits in
the page fault for the huge page, whose bytes are the same.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import logging
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

THP = Path("/sys/kernel/mm/transparent_hugepage")
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


@dataclass(frozen=True)
class HugePageReport:
    """What `back_with_huge_pages` did."""

    total_bytes: int
    """Bytes of the tensors it was given (overlaps counted once)."""
    huge_bytes: int
    """Of those, bytes now on huge pages that it collapsed."""
    why_not: str = ""
    """Why none could be, where none were: THP off, a kernel without MADV_COLLAPSE."""

    def describe(self) -> str:
        mib = 1 << 20
        text = f"{self.huge_bytes / mib:.0f} of {self.total_bytes / mib:.0f} MiB on huge pages"
        return f"{text} ({self.why_not})" if self.why_not else text


@dataclass(frozen=True)
class _Mapping:
    start: int
    end: int
    anonymous: bool
    """Private, writable, and backed by no file: what MADV_COLLAPSE takes."""


def huge_page_size() -> int:
    """The PMD huge page size (2 MiB on x86-64); 0 where THP is off or absent."""
    try:
        if "[never]" in (THP / "enabled").read_text():
            return 0
        return int((THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 0


def _mappings() -> list[_Mapping]:
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        path = fields[5] if len(fields) > 5 else ""
        perms = fields[1]
        found.append(_Mapping(start, end, perms.startswith("rw") and perms[3] == "p"
                              and path in ("", "[heap]")))
    return found


def _merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Half-open byte ranges, sorted, overlapping and touching ones merged."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _regions(ranges: list[tuple[int, int]], maps: list[_Mapping], size: int) -> list[int]:
    """The huge-page-aligned stretches that lie wholly inside one anonymous mapping and
    of whose bytes `ranges` (disjoint) hold at least half, by start address. A stretch is
    copied whole: one that mostly holds other bytes (a small model's weights, scattered
    over the heap) is not worth it."""
    starts = [m.start for m in maps]
    covered: dict[int, int] = {}
    for start, end in ranges:
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        for m in maps[i:]:
            if m.start >= end:
                break
            if not m.anonymous or m.end <= start:
                continue
            first = max(start - start % size, -(-m.start // size) * size)
            last = min(-(-end // size) * size, m.end - m.end % size)
            for region in range(first, last, size):
                overlap = min(end, region + size) - max(start, region)
                covered[region] = covered.get(region, 0) + overlap
    return sorted(region for region, n in covered.items() if 2 * n >= size)


def back_with_huge_pages(tensors: Iterable[torch.Tensor]) -> HugePageReport:
    """Collapse the memory holding `tensors` (CPU, strided) onto huge pages, in place."""
    ranges = _merged(_extent(t) for t in tensors if t.device.type == "cpu" and t.numel())
    total = sum(end - start for start, end in ranges)
    if sys.platform != "linux":
        return HugePageReport(total, 0, "not Linux")
    size = huge_page_size()
    if not size:
        return HugePageReport(total, 0, "transparent huge pages are off")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    collapsed: list[tuple[int, int]] = []
    failure = 0
    regions = _regions(ranges, _mappings(), size)
    for region in regions:
        # Marked first: where the collapse fails, khugepaged may still do it later.
        libc.madvise(region, size, MADV_HUGEPAGE)
        if libc.madvise(region, size, MADV_COLLAPSE) == 0:
            collapsed.append((region, region + size))
        else:
            failure = failure or ctypes.get_errno()
            if failure == errno.EINVAL and not collapsed:
                break  # a kernel without MADV_COLLAPSE: every call would fail alike
    huge = _overlap(ranges, _merged(collapsed))
    why_not = ""
    if not huge and failure:
        why_not = f"madvise(MADV_COLLAPSE): {errno.errorcode.get(failure, failure)}"
    elif not huge and total and not regions:
        # Small weights scattered over the heap: no stretch is worth a copy of its own.
        why_not = f"the weights fill no aligned {size >> 20} MiB stretch to half"
    elif not huge and total:
        why_not = "madvise(MADV_COLLAPSE) succeeded, yet no stretch is on a huge page"
    return HugePageReport(total, huge, why_not)


def collapse_in_background(tensors: Iterable[torch.Tensor]) -> Future[HugePageReport]:
    """`back_with_huge_pages` on a daemon thread; the report is logged when done."""
    tensors = list(tensors)  # kept alive until the thread is done with them
    done: Future[HugePageReport] = Future()

    def run() -> None:
        start = time.monotonic()
        try:
            report = back_with_huge_pages(tensors)
        except Exception as exc:  # an optimisation: the weights stay usable either way
            logger.warning("weights not moved onto huge pages: %s", exc)
            done.set_exception(exc)
            return
        logger.info("weights: %s, in %.1f s", report.describe(), time.monotonic() - start)
        done.set_result(report)

    threading.Thread(target=run, name="huge-pages", daemon=True).start()
    return done


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a strided tensor's elements span, first to last."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Bytes in both of two sorted lists of disjoint ranges."""
    total = i = j = 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
