"""llama.cpp as a side-by-side reference for the benchmark checkpoint.

    .venv/bin/python benchmarks/llama_cpp.py --build   # fetch, build, convert, verify
    .venv/bin/python benchmarks/llama_cpp.py           # time single-stream decode

`--build` does everything on a fresh machine, into benchmarks/.cache/: downloads the
llama-cpp-python sdist (pinned version and hash; it vendors llama.cpp's sources),
builds only the `llama` shared library with cmake (CPU, Release, GGML_NATIVE; AVX2 only
under CORESTREAM_CPU_ISA=avx2, in a build of its own), compiles
a small greedy-decode driver against it, writes the benchmark checkpoint as an f32 GGUF,
and checks that llama.cpp's greedy tokens equal transformers' on the same checkpoint.
benchmarks/llama_cpp_reference.py builds its tools (llama-quantize, llama-server) in the
same folder, with the same flags.

The driver takes prompt token ids on stdin, so no tokenizer stands in the way: it decodes
the prompt in one batch, then one token at a time, argmax over the logits each step, and
prints each generated id with the milliseconds the step took (decode plus argmax).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from corestream_kernels.cpu_isa import requested_level  # noqa: E402

from benchmarks.workload import CACHE, VOCAB, bench_checkpoint  # noqa: E402

VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SOURCE = CACHE / f"llama_cpp_python-{VERSION}"
LLAMA_CPP = SOURCE / "vendor" / "llama.cpp"
# Built for what our kernels are built for: the CPU's own instruction sets, or, under
# CORESTREAM_CPU_ISA=avx2, AVX2 only (as on a Zen 3), so that ratios compare like with like.
_AVX2 = requested_level() == "avx2"
BUILD = CACHE / ("llama.cpp-build-avx2" if _AVX2 else "llama.cpp-build")
DRIVER = CACHE / ("llama-cpp-greedy-avx2" if _AVX2 else "llama-cpp-greedy")
ISA_FLAGS = (["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
              "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF"] if _AVX2
             else ["-DGGML_NATIVE=ON"])
GGUF = CACHE / "bench-llama-512x8-f32.gguf"
VERIFY_TOKENS = 32
NICE = ["nice", "-n", "10"]

DRIVER_SOURCE = r"""
#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

static void quiet(enum ggml_log_level, const char *, void *) {}

static double since_ms(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
        .count();
}

int main(int argc, char ** argv) {
    if (argc != 4) {
        std::fprintf(stderr, "usage: %s MODEL.gguf THREADS NEW_TOKENS < prompt ids\n", argv[0]);
        return 2;
    }
    const int threads = std::atoi(argv[2]);
    const int new_tokens = std::atoi(argv[3]);
    std::vector<llama_token> prompt;
    for (int id; std::scanf("%d", &id) == 1;) prompt.push_back(id);
    if (prompt.empty() || new_tokens < 1) {
        std::fprintf(stderr, "need at least one prompt id on stdin and NEW_TOKENS >= 1\n");
        return 2;
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (model == nullptr) {
        std::fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    llama_context_params params = llama_context_default_params();
    params.n_ctx = prompt.size() + new_tokens;
    params.n_batch = params.n_ubatch = prompt.size();
    params.n_threads = params.n_threads_batch = threads;
    llama_context * ctx = llama_init_from_model(model, params);
    const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    llama_batch batch = llama_batch_get_one(prompt.data(), prompt.size());
    llama_token token = 0;
    for (int i = 0; i < new_tokens; ++i) {
        const auto start = std::chrono::steady_clock::now();
        if (llama_decode(ctx, batch) != 0) {
            std::fprintf(stderr, "llama_decode failed at step %d\n", i);
            return 1;
        }
        const float * logits = llama_get_logits_ith(ctx, -1);
        token = std::max_element(logits, logits + vocab) - logits;
        std::printf("%d %.4f\n", token, since_ms(start));
        batch = llama_batch_get_one(&token, 1);
    }
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
"""


@dataclass(frozen=True)
class Decode:
    tokens: list[int]
    prefill_ms: float
    step_ms: list[float]  # one per generated token after the first


def is_built() -> bool:
    return DRIVER.exists() and GGUF.exists()


def library_env() -> dict[str, str]:
    """The environment for a program linked against the build's libraries: they are found
    where the build is now, whatever path it was built under (a moved or linked cache)."""
    found = os.environ.get("LD_LIBRARY_PATH", "")
    return {**os.environ,
            "LD_LIBRARY_PATH": f"{BUILD / 'bin'}{os.pathsep + found if found else ''}"}


def decode(prompt: list[int], new_tokens: int, threads: int = 2, model: Path = GGUF) -> Decode:
    """One greedy stream through llama.cpp, in a fresh process."""
    run = subprocess.run(
        [str(DRIVER), str(model), str(threads), str(new_tokens)],
        input=" ".join(map(str, prompt)), capture_output=True, text=True, timeout=600,
        env=library_env(),
    )
    if run.returncode != 0:
        raise RuntimeError(f"{DRIVER.name} exited {run.returncode}: {run.stderr.strip()}")
    out = run.stdout.split()
    tokens, times = [int(t) for t in out[::2]], [float(t) for t in out[1::2]]
    return Decode(tokens, times[0], times[1:])


def fetch_source() -> None:
    if LLAMA_CPP.exists():
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    sdist = CACHE / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", "--dest", str(CACHE),
                        f"llama-cpp-python=={VERSION}"], check=True)
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        sdist.unlink()
        raise SystemExit(f"{sdist.name}: sha256 {digest}, expected {SDIST_SHA256}")
    with tarfile.open(sdist) as archive:
        archive.extractall(CACHE, filter="data")


def configure() -> None:
    """cmake's configure step (a second run on a configured folder takes seconds). The
    tools are configured too but built only as named targets of `build_targets`."""
    flags = ["-DCMAKE_BUILD_TYPE=Release", *ISA_FLAGS, "-DBUILD_SHARED_LIBS=ON",
             "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
             # The server's web UI would be fetched from Hugging Face at build time.
             "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
    subprocess.run([*NICE, "cmake", "-S", str(LLAMA_CPP), "-B", str(BUILD), *flags],
                   check=True)


def build_targets(*targets: str) -> None:
    """cmake targets (`llama`, `llama-quantize`, ...), two jobs (the machine has two
    cores). Configured first: a folder configured before the tools were would not know
    their targets."""
    configure()
    subprocess.run([*NICE, "cmake", "--build", str(BUILD), "-j2", "--target", *targets],
                   check=True)


def compile_driver(source: str, out: Path) -> None:
    """A C++ program against the built libllama; `source` is its text."""
    path = CACHE / f"{out.name}.cpp"
    path.write_text(source)
    lib = (BUILD / "bin").resolve()  # the real path: the cache may be reached by a link
    subprocess.run(
        ["g++", "-O2", "-std=c++17", str(path), "-o", str(out),
         f"-I{LLAMA_CPP / 'include'}", f"-I{LLAMA_CPP / 'ggml' / 'include'}",
         f"-L{lib}", "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}"],
        check=True,
    )


def build_library() -> None:
    # The benchmark needs only the shared library; the tools (llama_cpp_reference.py
    # --build) add the common, HTTP and multimodal libraries: tens of minutes more.
    build_targets("llama")
    compile_driver(DRIVER_SOURCE, DRIVER)


def permute_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate_half pairs dims (i, i + d/2) of each head; llama.cpp pairs (2i, 2i + 1)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(rows, -1)


def convert(checkpoint: Path, out: Path = GGUF, dtype: str = "float32") -> None:
    """The checkpoint as an f32 GGUF, written tensor by tensor (the vendored converter
    does not know a word-level tokenizer); with `dtype` bfloat16 its matrices in BF16
    (rounded to nearest even, as torch rounds them), the norms in f32 as llama.cpp's own
    converter writes them."""
    sys.path.insert(0, str(LLAMA_CPP / "gguf-py"))
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    weights = load_file(str(checkpoint / "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    rope = config.get("rope_parameters") or {}
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(f"corestream {checkpoint.name}")
    bf16 = {"float32": False, "bfloat16": True}[dtype]
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"w{i}" for i in range(config["vocab_size"])])
    writer.add_token_scores([0.0] * config["vocab_size"])
    writer.add_token_types([gguf.TokenType.NORMAL] * config["vocab_size"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    tensors = {"token_embd.weight": weights["model.embed_tokens.weight"],
               "output_norm.weight": weights["model.norm.weight"]}
    if "lm_head.weight" in weights:  # tied otherwise: llama.cpp reads token_embd for both
        tensors["output.weight"] = weights["lm_head.weight"]
    for layer in range(config["num_hidden_layers"]):
        for hf, ours in names.items():
            tensor = weights[f"model.layers.{layer}.{hf}.weight"]
            if ours == "attn_q":
                tensor = permute_rope(tensor, heads)
            elif ours == "attn_k":
                tensor = permute_rope(tensor, kv_heads)
            tensors[f"blk.{layer}.{ours}.weight"] = tensor
    for name, tensor in tensors.items():
        tensor = np.ascontiguousarray(tensor, dtype=np.float32)
        if bf16 and tensor.ndim == 2:
            qtype = gguf.GGMLQuantizationType.BF16
            writer.add_tensor(name, gguf.quants.quantize(tensor, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)


def hf_greedy(checkpoint: Path, prompt: list[int], new_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                             do_sample=False, min_new_tokens=new_tokens)
    return out[0, len(prompt):].tolist()


def sharp_attention(checkpoint: Path, out: Path, scale: float = 5.0) -> Path:
    """The checkpoint with q and k scaled up. The random weights leave attention almost
    uniform, so a conversion that scrambled the rotary pairs would still agree on greedy
    tokens; with peaked attention it does not (4 of 32 tokens agreed without the permute)."""
    from safetensors.numpy import load_file, save_file

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(checkpoint, out)
    weights = load_file(str(checkpoint / "model.safetensors"))
    for name in weights:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            weights[name] = weights[name] * scale
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def verify(checkpoint: Path, prompt_tokens: int = 128) -> None:
    """llama.cpp's greedy tokens must equal transformers' for the first VERIFY_TOKENS, on the
    benchmark checkpoint and on its sharp-attention variant."""
    prompt = [random.Random(1).randrange(3, VOCAB) for _ in range(prompt_tokens)]
    sharp = sharp_attention(checkpoint, CACHE / "bench-llama-sharp")
    sharp_gguf = sharp / "model-f32.gguf"
    convert(sharp, sharp_gguf)
    for label, hf, model in (("checkpoint", checkpoint, GGUF),
                             ("sharp-attention copy", sharp, sharp_gguf)):
        ours = decode(prompt, VERIFY_TOKENS, model=model).tokens
        theirs = hf_greedy(hf, prompt, VERIFY_TOKENS)
        if ours != theirs:
            raise SystemExit(f"{label}: llama.cpp's greedy tokens differ from "
                             f"transformers'\n  llama.cpp    {ours}\n  transformers {theirs}")
        print(f"{label}: llama.cpp's {VERIFY_TOKENS} greedy tokens equal transformers'")
    shutil.rmtree(sharp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="store_true",
                        help="fetch, build, convert and verify (once; later runs reuse it)")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    checkpoint = bench_checkpoint()
    if args.build:
        fetch_source()
        if not DRIVER.exists():
            build_library()
        if not GGUF.exists():
            convert(checkpoint)
        verify(checkpoint)
    if not is_built():
        raise SystemExit("llama.cpp is not built: run benchmarks/llama_cpp.py --build")
    rng = random.Random(0)
    steps: list[float] = []
    for _ in range(args.requests):
        prompt = [rng.randrange(3, VOCAB) for _ in range(args.prompt_tokens)]
        steps += decode(prompt, args.output_tokens, args.threads).step_ms
    print(f"llama.cpp {VERSION}, f32, {args.threads} threads: {args.requests} streams, prompt "
          f"{args.prompt_tokens}, output {args.output_tokens}: decode median "
          f"{statistics.median(steps):.2f} ms/token")


if __name__ == "__main__":
    main()
