"""llama.cpp's own GEMV on our blocks, for benchmarks/quant_gemv.py: `ggml_mul_mat` through
libggml's C API (ctypes), from the build benchmarks/llama_cpp.py makes.

One graph holds a mul_mat per weight copy, enough copies to overflow the caches (as a
model's layers do), computed by ggml's own thread pool; the time per mul_mat is the
graph's over the copies. ggml quantizes the activations (Q8_0 / Q8_K) inside mul_mat, as
our op does.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from corestream_kernels.quant import QuantizedWeight

from benchmarks.workload import CACHE

_COPIES_BYTES = 256 << 20
_GGML_F32 = 0


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


@dataclass
class LlamaGemv:
    ggml: ctypes.CDLL
    cpu: ctypes.CDLL
    threads: int

    @classmethod
    def open(cls, threads: int, build: Path = CACHE / "llama.cpp-build-avx2") -> LlamaGemv:
        lib = build / "bin"
        if not (lib / "libggml-cpu.so").exists():
            raise SystemExit(f"no llama.cpp build in {lib}: run benchmarks/llama_cpp.py --build "
                             "under CORESTREAM_CPU_ISA=avx2")
        base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        pointer = ctypes.c_void_p
        base.ggml_init.restype = pointer
        base.ggml_init.argtypes = [_InitParams]
        base.ggml_new_tensor_2d.restype = pointer
        base.ggml_new_tensor_2d.argtypes = [pointer, ctypes.c_int, ctypes.c_int64,
                                            ctypes.c_int64]
        base.ggml_get_data.restype = pointer
        base.ggml_get_data.argtypes = [pointer]
        base.ggml_mul_mat.restype = pointer
        base.ggml_mul_mat.argtypes = [pointer, pointer, pointer]
        base.ggml_new_graph_custom.restype = pointer
        base.ggml_new_graph_custom.argtypes = [pointer, ctypes.c_size_t, ctypes.c_bool]
        base.ggml_build_forward_expand.argtypes = [pointer, pointer]
        base.ggml_free.argtypes = [pointer]
        cpu.ggml_graph_compute_with_ctx.argtypes = [pointer, pointer, ctypes.c_int]
        cpu.ggml_cpu_init()
        return cls(base, cpu, threads)

    def seconds(self, weight: QuantizedWeight, rows: int, rounds: int) -> float:
        """Median seconds of one `rows`-row mul_mat by `weight`'s blocks."""
        nbytes = weight.blocks.numel()
        copies = max(2, min(256, -(-_COPIES_BYTES // nbytes)))
        size = copies * (nbytes + 4 * rows * (weight.out_features + weight.in_features) + 4096)
        ctx = self.ggml.ggml_init(_InitParams(size + (64 << 20), None, False))
        try:
            x = self.ggml.ggml_new_tensor_2d(ctx, _GGML_F32, weight.in_features, rows)
            ctypes.memmove(self.ggml.ggml_get_data(x),
                           torch.randn(rows, weight.in_features).numpy().ctypes.data,
                           4 * rows * weight.in_features)
            graph = self.ggml.ggml_new_graph_custom(ctx, 2 * copies + 16, False)
            data = weight.blocks.numpy()
            for _ in range(copies):
                w = self.ggml.ggml_new_tensor_2d(ctx, int(weight.ggml_type),
                                                 weight.in_features, weight.out_features)
                ctypes.memmove(self.ggml.ggml_get_data(w), data.ctypes.data, nbytes)
                self.ggml.ggml_build_forward_expand(graph, self.ggml.ggml_mul_mat(ctx, w, x))
            times = []
            for _ in range(max(3, rounds // copies) + 1):
                start = time.perf_counter()
                self.cpu.ggml_graph_compute_with_ctx(ctx, graph, self.threads)
                times.append((time.perf_counter() - start) / copies)
            return statistics.median(times[1:])
        finally:
            self.ggml.ggml_free(ctx)
