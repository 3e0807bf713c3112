"""Decode GEMVs on GGUF blocks (kernels/corestream_kernels/quant.py's `quant_linear`)
against the machine's read bandwidth and our float linear layers.

    .venv/bin/python benchmarks/quant_gemv.py [--rows 1,4,16] [--types Q4_0,Q4_K] [--llama]

For each type and shape (SmolLM2-135M's projections and head, and a 4096 x 4096 matrix):
the median time per call on the layout the loader serves (rows grouped by 16 for all but
Q5_K: kernels/corestream_kernels/quant.py's `group_rows`), the weight's bytes read per second (GB/s)
and that as a share of the read bandwidth measured here (a torch sum over a buffer eight
times the last-level cache), the speed-up over the file's own layout (`x file`, grouped
types only) and over our float32 and bfloat16 `linear`
(kernels/corestream_kernels/cpu_linear.py, packed as the engine loads them) on the same
shape. Each call reads a different copy of the weight, enough copies to overflow the
caches, as a model's layers do in a decode step.
The K-quants take rows of multiples of 256 values: SmolLM2's 576-wide inputs are n/a
(llama.cpp's Q4_K_M files store those tensors in other types).

`--prefill 64,512` adds many-row calls (csrc/quant_cpu.cpp) against dequantizing the
weight per call in Python (the C++ dequantization, then F.linear) and against float32
`linear`.

`--llama` adds llama.cpp's own GEMV (ggml_mul_mat through libggml, the AVX2 build in
benchmarks/.cache/llama.cpp-build-avx2 if present) on the same blocks.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

import torch  # noqa: E402
from corestream_kernels import backend  # noqa: E402
from corestream_kernels.cpu_extension import load  # noqa: E402
from corestream_kernels.cpu_isa import target  # noqa: E402
from corestream_kernels.cpu_linear import cpu_layout, linear  # noqa: E402
from corestream_kernels.quant import (  # noqa: E402
    BLOCK_FORMATS,
    GGMLType,
    QuantizedWeight,
    group_rows,
    quant_linear,
    quantize_q4_0,
    quantize_q4_1,
    quantize_q8_0,
    ungroup_rows,
)

from benchmarks.vllm_reference import cpu_line  # noqa: E402

# (name, out_features, in_features)
SHAPES = [("576x576 (q, o)", 576, 576), ("576->1536 (gate, up)", 1536, 576),
          ("1536->576 (down)", 576, 1536), ("576->192 (k, v)", 192, 576),
          ("head 49152x576", 49152, 576), ("4096x4096", 4096, 4096)]
TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
TOUCHED_BYTES = 256 << 20  # weight copies per shape: at least this much, past any cache


def median_seconds(fn: Callable[[], object], calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth() -> float:
    """GB/s of a multi-threaded sum over 256 MiB (eight times a 32 MiB L3)."""
    buffer = torch.ones(TOUCHED_BYTES // 4)
    seconds = median_seconds(lambda: buffer.sum(), 15)
    return buffer.numel() * 4 / seconds / 1e9


def random_weight(kind: GGMLType, out_features: int, in_features: int) -> QuantizedWeight:
    """Blocks of `kind`: quantized from Gaussian values, or random K-quant bytes with f16
    scales of a real model's size (the speed does not depend on the values)."""
    if kind in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0):
        quantize = {GGMLType.Q4_0: quantize_q4_0, GGMLType.Q4_1: quantize_q4_1,
                    GGMLType.Q8_0: quantize_q8_0}[kind]
        return quantize(torch.randn(out_features, in_features) * 0.05)
    values, size = BLOCK_FORMATS[kind]
    raw = torch.randint(0, 256, (out_features, in_features // values, size),
                        dtype=torch.uint8)
    d = (torch.rand(raw.shape[:2]) * 2e-3).half().view(torch.uint8).reshape(*raw.shape[:2], 2)
    raw[..., 208:210] = d if kind == GGMLType.Q6_K else raw[..., 208:210]
    if kind != GGMLType.Q6_K:
        raw[..., 0:2], raw[..., 2:4] = d, d
    return QuantizedWeight(raw.reshape(out_features, -1).contiguous(), kind, in_features,
                           out_features)


def copies_for(nbytes: int) -> int:
    return max(2, min(256, -(-TOUCHED_BYTES // nbytes)))


def time_rotating(calls: list[Callable[[], object]], rounds: int) -> float:
    """Median seconds per call, each call on the next weight copy."""
    index = [0]

    def one() -> object:
        index[0] = (index[0] + 1) % len(calls)
        return calls[index[0]]()

    return median_seconds(one, max(rounds, 2 * len(calls)))


def float_linear_seconds(dtype: torch.dtype, out_features: int, in_features: int,
                         rows: int, rounds: int) -> float:
    weight = torch.randn(out_features, in_features).to(dtype)
    copies = copies_for(weight.numel() * weight.element_size())
    layouts = [cpu_layout(weight.clone()) for _ in range(copies)]
    x = torch.randn(rows, in_features).to(dtype)
    calls = [lambda s=stored, p=panels: linear(x, s, None, p) for stored, panels in layouts]
    seconds = time_rotating(calls, rounds)
    del layouts
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--rounds", type=int, default=50, help="calls timed per case")
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--no-float", action="store_true", help="skip float32/bf16 linear")
    parser.add_argument("--prefill", default="", help="row counts of many-row calls")
    parser.add_argument("--llama", action="store_true", help="add llama.cpp's GEMV")
    parser.add_argument("--llama-build", type=Path, default=None,
                        help="llama.cpp's build folder (default: benchmarks/.cache/"
                             "llama.cpp-build-avx2)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    backend.set_backend("cpp")
    ops = load()
    rows_list = [int(r) for r in args.rows.split(",")]
    llama = None
    if args.llama:
        from benchmarks.quant_gemv_llama import LlamaGemv

        threads = torch.get_num_threads()
        llama = (LlamaGemv.open(threads, args.llama_build) if args.llama_build
                 else LlamaGemv.open(threads))
    bandwidth = read_bandwidth()
    print(f"{cpu_line()}\nkernels built for {target().name}; {torch.get_num_threads()} "
          f"threads; GEMV up to {ops.quant_gemv_max_rows()} rows; read bandwidth "
          f"{bandwidth:.1f} GB/s (torch sum over 256 MiB)\n", flush=True)
    float_seconds: dict[tuple[str, int, int, int], float] = {}
    header = (f"{'type':5} {'shape':22} {'rows':>4} {'ms':>8} {'GB/s':>6} {'%bw':>5} "
              f"{'x file':>6} {'x f32':>6} {'x bf16':>6}"
              + (f" {'llama ms':>9} {'x llama':>7}" if llama else ""))
    print(header)
    for type_name in args.types.split(","):
        kind = GGMLType[type_name]
        block = BLOCK_FORMATS[kind][0]
        for shape_name, out_features, in_features in SHAPES:
            if in_features % block:
                print(f"{type_name:5} {shape_name:22}  n/a (rows of {block} values)")
                continue
            first = random_weight(kind, out_features, in_features)
            nbytes = first.blocks.numel()
            # As the loader serves it (rows grouped where they can be), and the file's
            # layout beside it where that differs.
            served = group_rows(first)
            weights = [served] + [dataclasses.replace(served, blocks=served.blocks.clone())
                                  for _ in range(copies_for(nbytes) - 1)]
            for rows in rows_list:
                x = torch.randn(rows, in_features)
                calls = [lambda w=w, x=x: quant_linear(x, w) for w in weights]
                seconds = time_rotating(calls, args.rounds)
                speed = nbytes / seconds / 1e9
                line = (f"{type_name:5} {shape_name:22} {rows:4} {seconds * 1e3:8.3f} "
                        f"{speed:6.1f} {100 * speed / bandwidth:4.0f}%")
                if served.grouped:
                    file_weights = [ungroup_rows(w) for w in weights]
                    file_seconds = time_rotating(
                        [lambda w=w, x=x: quant_linear(x, w) for w in file_weights],
                        args.rounds)
                    del file_weights
                    line += f" {file_seconds / seconds:6.2f}"
                else:
                    line += f" {'-':>6}"
                for dtype in (torch.float32, torch.bfloat16):
                    key = (str(dtype), out_features, in_features, rows)
                    if not args.no_float and key not in float_seconds:
                        float_seconds[key] = float_linear_seconds(
                            dtype, out_features, in_features, rows, args.rounds)
                    line += (f" {float_seconds[key] / seconds:6.2f}" if key in float_seconds
                             else f" {'-':>6}")
                if llama is not None:
                    theirs = llama.seconds(first, rows, args.rounds)
                    line += f" {theirs * 1e3:9.3f} {theirs / seconds:7.2f}"
                print(line, flush=True)
            del weights
    if args.prefill:
        prefill([int(r) for r in args.prefill.split(",")], args.types.split(","), ops)


def prefill(rows_list: list[int], types: list[str], ops: Any) -> None:
    """Many rows: the op against the weight dequantized per call in Python, and float32."""
    print(f"\n{'type':5} {'shape':22} {'rows':>4} {'op ms':>9} {'deq+mm ms':>9} "
          f"{'f32 ms':>8} {'x deq+mm':>8} {'x f32':>6}")
    for type_name in types:
        kind = GGMLType[type_name]
        for shape_name, out_features, in_features in SHAPES:
            if in_features % BLOCK_FORMATS[kind][0] or out_features > 8192:
                continue
            weight = random_weight(kind, out_features, in_features)
            for rows in rows_list:
                x = torch.randn(rows, in_features)
                tiles = median_seconds(lambda w=weight, x=x: quant_linear(x, w), 5)
                whole = median_seconds(lambda w=weight, x=x: torch.nn.functional.linear(
                    x, ops.quant_dequantize(w.blocks, int(w.ggml_type), *w.shape)), 5)
                f32 = float_linear_seconds(torch.float32, out_features, in_features, rows, 5)
                print(f"{type_name:5} {shape_name:22} {rows:4} {tiles * 1e3:9.2f} "
                      f"{whole * 1e3:9.2f} {f32 * 1e3:8.2f} {whole / tiles:8.2f} "
                      f"{f32 / tiles:6.2f}", flush=True)


if __name__ == "__main__":
    main()
