"""Hypothesis over every request message of every public gRPC service, against real
clusters: GenerateService (its constraints included), ChatService, PoolingService,
AdminService and vLLM's engine API (VllmEngine, served by the same frontend).

Each request comes from one of two strategies: a generic one that walks the message's
descriptor (every scalar with its edge values, enums with unknown numbers, repeated
and map fields, nested messages, oneofs, optional fields, google.protobuf.Struct), and
a targeted one for the fields that matter (chat roles and content parts, tools with
random JSON schemas, tool_choice, response_format, output constraints of each kind,
request-supplied chat templates, hostile ones included). A fraction goes out as wire
bytes with invalid UTF-8 in a string field.

Every answer must be OK or a documented client error with a message (never UNKNOWN,
INTERNAL or an unexpected code), no process may die, and ordinary requests must still
succeed afterwards. test_fuzz.py covers Generate and GenerateStream the same way with
its own hand-written strategy. FUZZ_EXAMPLES requests per surface run in the default
suite, SLOW_FUZZ_EXAMPLES under -m slow.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import admin_service_pb2 as admin_pb2
from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc
from corestream.generate.v1 import chat_service_pb2 as chat_pb2
from corestream.generate.v1 import chat_service_pb2_grpc as chat_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from corestream.generate.v1 import pooling_service_pb2 as pooling_pb2
from corestream.vendor.smg_grpc_proto import vllm_engine_pb2
from google.protobuf import descriptor as descriptor_mod
from google.protobuf import message_factory, struct_pb2
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.cluster import Cluster, alive
from tests.integration.protowire import length_delimited

FUZZ_EXAMPLES = int(os.environ.get("CORESTREAM_FUZZ_EXAMPLES", "15"))
SLOW_FUZZ_EXAMPLES = int(os.environ.get("CORESTREAM_SLOW_FUZZ_EXAMPLES", "10000"))
VOCAB = 394  # the built-in tiny checkpoint's
MAX_MESSAGE_BYTES = 1 << 20
CALL_TIMEOUT_S = 60
# A render limit short enough that hostile templates cost little, long enough for the
# tiny model's own template on a busy core.
RENDER_TIMEOUT_S = 1.0

# A client's mistake, each documented in the protos: a bad field (INVALID_ARGUMENT), a
# cap (RESOURCE_EXHAUSTED), a call the served model or server state does not take
# (FAILED_PRECONDITION), an unknown request id or engine (NOT_FOUND), a value past a
# range (OUT_OF_RANGE).
CLIENT_ERRORS = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
})
FUZZ_SETTINGS: dict[str, Any] = dict(deadline=None, database=None,
                                     suppress_health_check=list(HealthCheck))
DERANDOMIZED_UP_TO = 1000

pytestmark = pytest.mark.timeout(900)


# ---- generic strategies from descriptors ------------------------------------------

FD = descriptor_mod.FieldDescriptor
INT32_EDGES = [0, 1, -1, 2, 3, 4, 5, 394, (1 << 31) - 1, -(1 << 31)]
UINT32_EDGES = [0, 1, 2, 3, 4, 394, (1 << 32) - 1, 1 << 31]
INT64_EDGES = [0, 1, -1, (1 << 63) - 1, -(1 << 63), 1 << 32]
UINT64_EDGES = [0, 1, (1 << 64) - 1, 1 << 63, 1 << 32]
FLOAT_EDGES = [0.0, -0.0, 0.5, 1.0, -1.0, 1e-45, 3.4e38, -3.4e38, math.nan, math.inf,
               -math.inf]


def _int(low: int, high: int, edges: list[int]) -> st.SearchStrategy[int]:
    return st.sampled_from(edges) | st.integers(0, 8) | st.integers(low, high)


INT32 = _int(-(1 << 31), (1 << 31) - 1, INT32_EDGES)
UINT32 = _int(0, (1 << 32) - 1, UINT32_EDGES)
INT64 = _int(-(1 << 63), (1 << 63) - 1, INT64_EDGES)
UINT64 = _int(0, (1 << 64) - 1, UINT64_EDGES)
FLOAT32 = st.sampled_from(FLOAT_EDGES) | st.floats(width=32)
DOUBLE = st.sampled_from(FLOAT_EDGES) | st.floats()
# Lone surrogates cannot be serialized into a proto string; invalid UTF-8 is sent as
# wire bytes instead (see `wire_bytes`).
ODD_TEXT = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=30) \
    | st.sampled_from(["", "\x00", "\u200b", "\u202e", "e\u0301", "\U0001f600" * 20,
                       "\ufffd", "\n", "</s>", "<s>", "<|im_start|>", "<tool_call>",
                       "<think>", "a" * 300, "../../etc/passwd", "%s%n{0}", "{{ 7*7 }}"])

SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FD.TYPE_INT32: INT32, FD.TYPE_SINT32: INT32, FD.TYPE_SFIXED32: INT32,
    FD.TYPE_UINT32: UINT32, FD.TYPE_FIXED32: UINT32,
    FD.TYPE_INT64: INT64, FD.TYPE_SINT64: INT64, FD.TYPE_SFIXED64: INT64,
    FD.TYPE_UINT64: UINT64, FD.TYPE_FIXED64: UINT64,
    FD.TYPE_FLOAT: FLOAT32, FD.TYPE_DOUBLE: DOUBLE, FD.TYPE_BOOL: st.booleans(),
    FD.TYPE_STRING: ODD_TEXT, FD.TYPE_BYTES: st.binary(max_size=40),
}

JSON_SCALAR = st.none() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False) \
    | st.integers(-(1 << 53), 1 << 53) | ODD_TEXT
JSON = st.recursive(JSON_SCALAR, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(ODD_TEXT, inner, max_size=4), max_leaves=12)
JSON_OBJECT = st.dictionaries(ODD_TEXT, JSON, max_size=5)


def _struct(value: dict[str, Any]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(value)
    return struct


STRUCT = JSON_OBJECT.map(_struct)
MAX_DEPTH = 4


def message_class(descriptor: descriptor_mod.Descriptor) -> type[Message]:
    return message_factory.GetMessageClass(descriptor)  # type: ignore[no-any-return]


def _field_value(fd: descriptor_mod.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if fd.type == FD.TYPE_ENUM:
        numbers = [v.number for v in fd.enum_type.values]
        # Proto3 enums are open: unknown numbers arrive as they are.
        return st.sampled_from(numbers) | st.sampled_from([max(numbers) + 1, -1, 1 << 30])
    if fd.type == FD.TYPE_MESSAGE:
        return messages(fd.message_type, depth + 1)
    return SCALARS[fd.type]


def _is_map(fd: descriptor_mod.FieldDescriptor) -> bool:
    return (fd.type == FD.TYPE_MESSAGE and fd.message_type.GetOptions().map_entry)


def _set_field(message: Message, fd: descriptor_mod.FieldDescriptor, value: Any) -> None:
    target = getattr(message, fd.name)
    if _is_map(fd):
        value_fd = fd.message_type.fields_by_name["value"]
        for key, item in value.items():
            if value_fd.type == FD.TYPE_MESSAGE:
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif fd.is_repeated:
        if fd.type == FD.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif fd.type == FD.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(message, fd.name, value)


def messages(descriptor: descriptor_mod.Descriptor,
             depth: int = 0) -> st.SearchStrategy[Message]:
    """Any message of `descriptor`'s type: each field left unset half the time, at most
    one member of each oneof, repeated and map fields up to a few items, nested
    messages to MAX_DEPTH (deeper ones empty)."""
    if descriptor.full_name == "google.protobuf.Struct":
        return STRUCT
    if descriptor.full_name == "google.protobuf.Value":
        return JSON.map(lambda v: _struct({"v": v}).fields["v"])
    cls = message_class(descriptor)
    if depth >= MAX_DEPTH:
        return st.just(cls())

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        message = cls()
        chosen: dict[str, str | None] = {}
        for oneof in descriptor.oneofs:
            names = [f.name for f in oneof.fields]
            chosen[oneof.name] = draw(st.none() | st.sampled_from(names))
        for fd in descriptor.fields:
            oneof = fd.containing_oneof
            if oneof is not None and chosen[oneof.name] != fd.name:
                continue
            if oneof is None and not draw(st.booleans()):
                continue
            if _is_map(fd):
                key = _field_value(fd.message_type.fields_by_name["key"], depth)
                value = _field_value(fd.message_type.fields_by_name["value"], depth)
                _set_field(message, fd, draw(st.dictionaries(key, value, max_size=4)))
            elif fd.is_repeated:
                _set_field(message, fd, draw(st.lists(_field_value(fd, depth), max_size=4)))
            else:
                _set_field(message, fd, draw(_field_value(fd, depth)))
        return message

    return build()


# ---- targeted strategies ----------------------------------------------------------


def one_in(draw: st.DrawFn, n: int) -> bool:
    """True about once in n draws. (Hypothesis favours 0 and bounds in integers(0, n),
    so `integers(0, n) == 0` would be far likelier than 1 / (n + 1).)"""
    return draw(st.sampled_from([False] * (n - 1) + [True]))


NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,12}", fullmatch=True)
# Regexes: ordinary, catastrophic for a backtracking engine, huge, or invalid.
REGEXES = st.sampled_from([
    r"[a-z]+", r"\d{1,3}", r"(a+)+$", r"(a|a)*b", r"(a|aa)+$", r"(.*a){20}", r"([a-z]+)*\d",
    r"x{0,1000}", r"(?:a{1,100}){1,100}", r"[", r"(", r"\p{L}+", r"(?=a)a", r"\1",
    "a" * 5000, r"(a{1000}){1000}", "", r"yes|no", r"[^\x00]*",
]) | st.text(alphabet="ab()[]{}*+?|.^$\\d0-9,", max_size=20)
GRAMMARS = st.sampled_from([
    'start: "yes" | "no"\n', "start: x\nx: x", 'start: a\na: "(" a ")" | ""\n',
    "start: /[a-z]+/\n", 'root ::= "a" | "b"\n', "start:", "start: %json {\"type\": 1}\n",
    'start: ("a" | "b")*\n', "%import common.WORD\nstart: WORD\n", "start: start start\n",
]) | ODD_TEXT


@st.composite
def json_schemas(draw: st.DrawFn, depth: int = 0) -> Any:
    """A JSON Schema-ish value: mostly keywords with plausible values, sometimes
    nonsense (wrong types, unknown keywords, dangling or cyclic $refs)."""
    if depth > 3 or one_in(draw, 10):
        return draw(st.booleans() | st.just({}) | JSON)
    kind = draw(st.sampled_from(["object", "array", "string", "number", "integer",
                                 "boolean", "null", "combo", "ref", "enum", "odd"]))
    schema: dict[str, Any] = {}
    if kind == "object":
        schema["type"] = "object"
        props = draw(st.dictionaries(ODD_TEXT, json_schemas(depth + 1), max_size=3))
        schema["properties"] = props
        if props and draw(st.booleans()):
            schema["required"] = draw(st.lists(st.sampled_from(sorted(props)), max_size=3))
        if draw(st.booleans()):
            schema["additionalProperties"] = draw(st.booleans() | json_schemas(depth + 1))
        if draw(st.booleans()):
            schema[draw(st.sampled_from(["minProperties", "maxProperties"]))] = draw(INT32)
    elif kind == "array":
        schema["type"] = "array"
        schema["items"] = draw(json_schemas(depth + 1))
        if draw(st.booleans()):
            schema[draw(st.sampled_from(["minItems", "maxItems"]))] = draw(INT64)
        if draw(st.booleans()):
            schema["prefixItems"] = draw(st.lists(json_schemas(depth + 1), max_size=2))
    elif kind == "string":
        schema["type"] = "string"
        if draw(st.booleans()):
            schema["pattern"] = draw(REGEXES)
        if draw(st.booleans()):
            schema[draw(st.sampled_from(["minLength", "maxLength"]))] = draw(INT64)
        if draw(st.booleans()):
            schema["format"] = draw(st.sampled_from(["date-time", "email", "uuid", "ipv4",
                                                     "nonsense"]))
    elif kind in ("number", "integer"):
        schema["type"] = kind
        for key in draw(st.lists(st.sampled_from(["minimum", "maximum", "exclusiveMinimum",
                                                  "exclusiveMaximum", "multipleOf"]),
                                 max_size=3)):
            schema[key] = draw(st.integers(-(1 << 70), 1 << 70) | st.floats(
                allow_nan=False, allow_infinity=False))
    elif kind == "combo":
        key = draw(st.sampled_from(["anyOf", "oneOf", "allOf", "not", "if"]))
        branches = draw(st.lists(json_schemas(depth + 1), min_size=0, max_size=3))
        schema[key] = branches[0] if key in ("not", "if") and branches else branches
    elif kind == "ref":
        schema["$defs"] = {"a": draw(json_schemas(depth + 1)),
                           "b": {"$ref": "#/$defs/a"}, "c": {"$ref": "#/$defs/c"}}
        schema["$ref"] = draw(st.sampled_from(["#/$defs/a", "#/$defs/b", "#/$defs/c",
                                               "#/nowhere", "#", "http://example.com/s"]))
    elif kind == "enum":
        schema["enum"] = draw(st.lists(JSON, max_size=5))
        if draw(st.booleans()):
            schema["const"] = draw(JSON)
    else:
        schema = draw(JSON_OBJECT)
    return schema


SCHEMA_TEXT = json_schemas().map(json.dumps) | ODD_TEXT | st.sampled_from(
    ["", "{", "null", "[]", '{"type": "object"}', '{"$ref": "#"}'])


@st.composite
def sampling(draw: st.DrawFn, constraints: bool = True) -> common_pb2.SamplingParams:
    """Cheap sampling (max_tokens within the cluster's cap of 4), sometimes with one
    output constraint of any kind."""
    params = common_pb2.SamplingParams(
        max_tokens=draw(st.integers(1, 4)), temperature=draw(st.sampled_from([0.0, 1.0])),
        n=draw(st.sampled_from([1, 1, 2])), seed=draw(st.integers(0, 100)))
    if constraints:
        kind = draw(st.sampled_from(["none", "json_schema", "regex", "grammar", "choice"]))
        if kind == "json_schema":
            params.json_schema = draw(SCHEMA_TEXT)
        elif kind == "regex":
            params.regex = draw(REGEXES)
        elif kind == "grammar":
            params.grammar = draw(GRAMMARS)
        elif kind == "choice":
            params.choice.choices.extend(draw(st.lists(ODD_TEXT, max_size=5)))
    if one_in(draw, 8):
        # Everything else in SamplingParams, at any value.
        params.MergeFrom(draw(messages(common_pb2.SamplingParams.DESCRIPTOR)))
    return params


@st.composite
def generate_requests(draw: st.DrawFn, cls: type[Message]) -> Message:
    request = cls()
    if draw(st.booleans()):
        request.text = draw(ODD_TEXT)  # type: ignore[attr-defined]
    else:
        request.token_ids.ids.extend(  # type: ignore[attr-defined]
            draw(st.lists(st.integers(0, VOCAB - 1), max_size=20)))
    request.sampling.CopyFrom(draw(sampling()))  # type: ignore[attr-defined]
    return request


VALID_ROLES = st.sampled_from(["system", "user", "assistant", "tool", "developer"])
ODD_ROLES = st.sampled_from(["function", "ipython", ""]) | ODD_TEXT
ARGUMENTS = JSON_OBJECT.map(json.dumps) | ODD_TEXT | st.sampled_from(["", "{", "[]", "1"])
# Request templates: ordinary, hostile (each must be refused or bounded), or noise.
TEMPLATES = st.sampled_from([
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    "{{ messages|tojson }}{{ tools|tojson }}",
    "{{ raise_exception('no') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'a' * 10**9 }}",
    "{% macro r() %}{{ r() }}{% endmacro %}{{ r() }}",
    "{% for a in [1] %}" * 30 + "{% endfor %}" * 30,
    "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}",
    "{{ '%999999999d' % 1 }}",
    "{% if %}", "{{ messages[0].content[::-1] }}", "",
]) | ODD_TEXT




def usually(draw: st.DrawFn, common: st.SearchStrategy[Any], odd: st.SearchStrategy[Any],
            n: int = 10) -> Any:
    """Mostly what the server takes, so that many requests render and run; one in n
    draws anything."""
    return draw(odd if one_in(draw, n) else common)


@st.composite
def chat_messages(draw: st.DrawFn, role: str | None = None) -> chat_pb2.ChatMessage:
    message = chat_pb2.ChatMessage(role=role or usually(draw, VALID_ROLES, ODD_ROLES))
    if not one_in(draw, 4):
        message.content = draw(ODD_TEXT)
    else:
        for _ in range(draw(st.integers(0, 3))):
            message.content_parts.add(
                type=usually(draw, st.just("text"), st.sampled_from(["image_url", ""]) | ODD_TEXT),
                text=draw(ODD_TEXT))
    if one_in(draw, 4 if message.role == "assistant" else 20):
        for _ in range(draw(st.integers(1, 2))):
            message.tool_calls.add(id=draw(ODD_TEXT), name=usually(draw, NAMES, ODD_TEXT),
                                   arguments=usually(draw, JSON_OBJECT.map(json.dumps),
                                                     ARGUMENTS, 4))
    if one_in(draw, 2 if message.role == "tool" else 20):
        message.tool_call_id = draw(ODD_TEXT)
    if one_in(draw, 3 if message.role == "assistant" else 30):
        message.reasoning = draw(ODD_TEXT)
    if one_in(draw, 5):
        message.name = draw(ODD_TEXT)
    return message


@st.composite
def chat_requests(draw: st.DrawFn, cls: type[Message]) -> Message:
    request: Any = cls()
    request.messages.extend(draw(st.lists(chat_messages(), max_size=3)))
    if not one_in(draw, 10):
        request.messages.append(draw(chat_messages(role="user")))
    tools = [chat_pb2.Tool(name=usually(draw, NAMES, ODD_TEXT), description=draw(ODD_TEXT),
                           parameters=draw(SCHEMA_TEXT))
             for _ in range(draw(st.integers(0, 3)))]
    request.tools.extend(tools)
    # RenderChatRequest has the conversation only; the others also what to answer.
    answering = "sampling" in cls.DESCRIPTOR.fields_by_name
    choice = draw(st.sampled_from(["unset", "mode", "function"])) if answering else "unset"
    if choice == "mode":
        request.tool_choice.mode = draw(st.sampled_from([0, 1, 2, 3, 3, 9]))
    elif choice == "function":
        names = [t.name for t in tools] or ["missing"]
        request.tool_choice.function = usually(draw, st.sampled_from(names), ODD_TEXT)
    if answering and draw(st.booleans()):
        request.parallel_tool_calls = draw(st.booleans())
    if answering and draw(st.booleans()):
        request.response_format.type = draw(st.sampled_from([0, 1, 2, 3, 3, 7]))
        request.response_format.json_schema = draw(SCHEMA_TEXT)
    if one_in(draw, 4):
        request.chat_template_kwargs.CopyFrom(draw(STRUCT))
    if draw(st.booleans()):
        request.add_generation_prompt = draw(st.booleans())
    if request.messages and request.messages[-1].role == "assistant" or one_in(draw, 10):
        request.continue_final_message = draw(st.booleans())
    if one_in(draw, 4):
        request.chat_template = draw(TEMPLATES)
    if answering:
        # Chat takes its constraints from tool_choice and response_format; one in
        # fifteen carries a sampling constraint as well, which it must refuse.
        request.sampling.CopyFrom(draw(sampling(constraints=one_in(draw, 15))))
        if one_in(draw, 6):
            request.data_parallel_rank = draw(UINT32)
    return request  # type: ignore[no-any-return]


@st.composite
def vllm_generate_requests(draw: st.DrawFn, cls: type[Message]) -> Message:
    """vLLM's GenerateRequest: a prompt, cheap sampling, any constraint of its own set
    (structural_tag and json_object included)."""
    request: Any = cls(request_id=draw(st.sampled_from(["", "v-1"]) | NAMES),
                       stream=draw(st.booleans()))
    if draw(st.booleans()):
        request.text = draw(ODD_TEXT)
    else:
        request.tokenized.input_ids.extend(draw(st.lists(st.integers(0, VOCAB + 1),
                                                         min_size=1, max_size=20)))
        request.tokenized.original_text = draw(ODD_TEXT)
    params = request.sampling_params
    params.max_tokens = draw(st.integers(1, 4))
    params.n = draw(st.sampled_from([0, 1, 2]))
    kind = draw(st.sampled_from(["none", "json_schema", "regex", "grammar", "structural_tag",
                                 "json_object", "choice"]))
    if kind in ("json_schema", "structural_tag"):
        setattr(params, kind, draw(SCHEMA_TEXT))
    elif kind == "regex":
        params.regex = draw(REGEXES)
    elif kind == "grammar":
        params.grammar = draw(GRAMMARS)
    elif kind == "json_object":
        params.json_object = draw(st.booleans())
    elif kind == "choice":
        params.choice.choices.extend(draw(st.lists(ODD_TEXT, max_size=4)))
    if one_in(draw, 8):
        params.MergeFrom(draw(messages(params.DESCRIPTOR)))
    return request  # type: ignore[no-any-return]


def pooling_inputs() -> st.SearchStrategy[pooling_pb2.PoolingInput]:
    return (ODD_TEXT.map(lambda t: pooling_pb2.PoolingInput(text=t))
            | st.lists(st.integers(0, VOCAB + 2), max_size=20).map(
                lambda ids: pooling_pb2.PoolingInput(token_ids=pb.TokenIds(ids=ids))))


@st.composite
def pooling_requests(draw: st.DrawFn, cls: type[Message]) -> Message:
    request: Any = cls()
    if cls is pooling_pb2.ScoreRequest:
        request.query.CopyFrom(draw(pooling_inputs()))
        request.documents.extend(draw(st.lists(pooling_inputs(), min_size=1, max_size=4)))
    else:
        request.inputs.extend(draw(st.lists(pooling_inputs(), min_size=1, max_size=4)))
    if cls is pooling_pb2.EmbedRequest:
        if draw(st.booleans()):
            request.dimensions = draw(st.integers(0, 40))
        request.pooling_type = draw(st.sampled_from([0, 1, 2, 3, 4, 5]))
        if draw(st.booleans()):
            request.prompt_name = draw(st.sampled_from(["query", "document", "nope"]))
    request.truncate = draw(st.booleans())
    return request  # type: ignore[no-any-return]


# ---- surfaces ---------------------------------------------------------------------


@dataclass(frozen=True)
class Surface:
    """One RPC: its path, whether it streams, and how to make its requests."""

    service: descriptor_mod.ServiceDescriptor
    method: str
    targeted: Callable[[type[Message]], st.SearchStrategy[Message]] | None = None
    extra_codes: frozenset[grpc.StatusCode] = field(default_factory=frozenset)
    timeout_s: float = CALL_TIMEOUT_S

    @property
    def descriptor(self) -> descriptor_mod.MethodDescriptor:
        return self.service.methods_by_name[self.method]

    @property
    def path(self) -> str:
        return f"/{self.service.full_name}/{self.method}"

    @property
    def name(self) -> str:
        return f"{self.service.name}.{self.method}"

    def requests(self) -> st.SearchStrategy[Message]:
        cls = message_class(self.descriptor.input_type)
        generic = messages(self.descriptor.input_type)
        if self.targeted is None:
            return generic
        return st.one_of(generic, self.targeted(cls), self.targeted(cls))


GENERATE = pb.DESCRIPTOR.services_by_name["GenerateService"]
CHAT = chat_pb2.DESCRIPTOR.services_by_name["ChatService"]
POOLING = pooling_pb2.DESCRIPTOR.services_by_name["PoolingService"]
ADMIN = admin_pb2.DESCRIPTOR.services_by_name["AdminService"]
VLLM = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"]

GENERATE_SURFACES = [
    Surface(GENERATE, "Generate", generate_requests),
    Surface(GENERATE, "GenerateStream", generate_requests),
    Surface(GENERATE, "Tokenize"),
    Surface(GENERATE, "Detokenize"),
    Surface(GENERATE, "GetModelInfo"),
    Surface(GENERATE, "Abort"),
]
CHAT_SURFACES = [Surface(CHAT, name, chat_requests)
                 for name in ("Chat", "ChatStream", "RenderChat")]
POOLING_SURFACES = [Surface(POOLING, name, pooling_requests)
                    for name in ("Embed", "Classify", "Score")]
# SubscribeKvEvents streams until the client leaves: a short deadline ends it.
VLLM_SURFACES = [Surface(VLLM, m.name,
                         vllm_generate_requests if m.name == "Generate" else None,
                         timeout_s=0.1 if m.name == "SubscribeKvEvents" else CALL_TIMEOUT_S,
                         extra_codes=frozenset({grpc.StatusCode.DEADLINE_EXCEEDED})
                         if m.name == "SubscribeKvEvents" else frozenset())
                 for m in VLLM.methods]
# Admin calls that take arguments, each undone after every example (see restore_admin).
# PauseScheduling in wait mode with a short timeout_s documents DEADLINE_EXCEEDED;
# per-engine failures come back inside the results, not as the call's status.
ADMIN_SURFACES = [Surface(ADMIN, m.name, extra_codes=frozenset(
    {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE}))
                  for m in ADMIN.methods if m.input_type.fields]


def _string_fields(descriptor: descriptor_mod.Descriptor) -> list[int]:
    return [fd.number for fd in descriptor.fields if fd.type == FD.TYPE_STRING
            and not fd.is_repeated] or [
        fd.number for fd in descriptor.fields if fd.type == FD.TYPE_STRING]


@st.composite
def wire_bytes(draw: st.DrawFn, surface: Surface) -> bytes:
    """A request's bytes with invalid UTF-8 in one of its string fields, or garbage."""
    base = draw(surface.requests()).SerializeToString()
    numbers = _string_fields(surface.descriptor.input_type)
    bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"abc\x80",
                                b"\xf4\x90\x80\x80"]))
    if numbers and draw(st.booleans()):
        return base + length_delimited(draw(st.sampled_from(numbers)), bad)
    return draw(st.binary(min_size=1, max_size=48))


# ---- calling ----------------------------------------------------------------------


def call(channel: grpc.Channel, surface: Surface, data: bytes) -> tuple[grpc.StatusCode, str]:
    identity = (lambda b: b)  # noqa: E731 (the bytes as they are)
    try:
        if surface.descriptor.server_streaming:
            for _ in channel.unary_stream(surface.path, identity, identity)(
                    data, timeout=surface.timeout_s):
                pass
        else:
            channel.unary_unary(surface.path, identity, identity)(data, timeout=surface.timeout_s)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


@dataclass
class Tally:
    codes: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    findings: Counter[str] = field(default_factory=Counter)
    """Answers outside the contract, by code and first line, with one request each."""
    examples: dict[str, str] = field(default_factory=dict)

    def add(self, surface: Surface, request: Message | bytes, code: grpc.StatusCode,
            details: str) -> None:
        # Recorded rather than asserted at once, so that a long run reports every kind
        # of finding and how often it came, not just the first.
        allowed = {grpc.StatusCode.OK} | CLIENT_ERRORS | surface.extra_codes
        self.codes[code.name] += 1
        total = sum(self.codes.values())
        if total % 1000 == 0:  # progress of the long runs
            print(f"  {surface.name}: {total} requests: {dict(self.codes)}", flush=True)
        problem = None
        if code not in allowed:
            problem = f"{code.name}: {details.splitlines()[0][:160] if details else ''}"
        elif code is not grpc.StatusCode.OK and not details.strip():
            problem = f"{code.name} without a message"
        if problem is not None:
            self.findings[problem] += 1
            shown = request if isinstance(request, bytes) else str(request)[:1500]
            self.examples.setdefault(problem, str(shown))


def fuzz_surface(channel: grpc.Channel, surface: Surface, examples: int,
                 after_each: Callable[[], None] | None = None) -> Tally:
    """`examples` requests (and a tenth as many as wire bytes). The default suite's
    small runs are derandomized, so they send the same requests every time; the slow
    runs explore (pytest's --hypothesis-seed fixes theirs)."""
    tally = Tally()
    start = time.monotonic()
    chosen = dict(FUZZ_SETTINGS, derandomize=examples <= DERANDOMIZED_UP_TO)

    @settings(max_examples=examples, **chosen)
    @given(request=surface.requests())
    def structured(request: Message) -> None:
        code, details = call(channel, surface, request.SerializeToString())
        tally.add(surface, request, code, details)
        if after_each is not None:
            after_each()

    @settings(max_examples=max(5, examples // 10), **chosen)
    @given(data=wire_bytes(surface))
    def wire(data: bytes) -> None:
        code, details = call(channel, surface, data)
        tally.add(surface, data, code, details)
        if after_each is not None:
            after_each()

    structured()
    wire()
    tally.seconds = time.monotonic() - start
    print(f"{surface.name}: {sum(tally.codes.values())} requests in {tally.seconds:.1f} s: "
          f"{dict(tally.codes)}; findings: {dict(tally.findings)}")
    assert not tally.findings, "\n".join(
        f"{surface.name}: {n} x {problem}\n  e.g. {tally.examples[problem]}"
        for problem, n in tally.findings.items())
    return tally


def assert_still_serving(cluster: Cluster, channel: grpc.Channel, engines: int = 1) -> None:
    assert cluster.proc.poll() is None, cluster.output()
    for index in range(engines):
        assert alive(cluster.engine_pid(index)), cluster.output()
    stub = pb_grpc.GenerateServiceStub(channel)
    reply = stub.Generate(pb.GenerateRequest(text="hello", sampling=common_pb2.SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True)), timeout=CALL_TIMEOUT_S)
    assert len(reply.completions[0].token_ids) == 4
    chat = chat_grpc.ChatServiceStub(channel).Chat(chat_pb2.ChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content="hi")],
        sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)),
        timeout=CALL_TIMEOUT_S)
    assert chat.usage.completion_tokens == 3


# ---- clusters ---------------------------------------------------------------------


def _channel(cluster: Cluster) -> grpc.Channel:
    return grpc.insecure_channel(cluster.address, options=[
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.max_receive_message_length", 64 << 20)])


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # Small caps keep valid requests cheap; templates from requests are accepted so
    # that the sandbox is fuzzed too; one engine keeps the start quick.
    c = Cluster(["--engines", "1", "--max-tokens-limit", "4", "--max-n", "4",
                 "--max-message-bytes", str(MAX_MESSAGE_BYTES),
                 "--trust-request-chat-template",
                 "--chat-template-render-timeout-s", str(RENDER_TIMEOUT_S)])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def channel(cluster: Cluster) -> Iterator[grpc.Channel]:
    with _channel(cluster) as ch:
        yield ch


def _run(cluster: Cluster, channel: grpc.Channel, surfaces: list[Surface], examples: int,
         after_each: Callable[[], None] | None = None, engines: int = 1) -> None:
    for surface in surfaces:
        fuzz_surface(channel, surface, examples, after_each)
        assert_still_serving(cluster, channel, engines)


@pytest.mark.parametrize("surface", GENERATE_SURFACES + CHAT_SURFACES + VLLM_SURFACES,
                         ids=lambda s: s.name)
def test_fuzz(cluster: Cluster, channel: grpc.Channel, surface: Surface) -> None:
    _run(cluster, channel, [surface], FUZZ_EXAMPLES)


@pytest.mark.slow
@pytest.mark.timeout(6 * 3600)
@pytest.mark.parametrize("surface", GENERATE_SURFACES + CHAT_SURFACES + VLLM_SURFACES,
                         ids=lambda s: s.name)
def test_fuzz_thousands(cluster: Cluster, channel: grpc.Channel, surface: Surface) -> None:
    _run(cluster, channel, [surface], SLOW_FUZZ_EXAMPLES)


# ---- request chat templates (--trust-request-chat-template) ----------------------

# (template, what the refusal says)
HOSTILE_TEMPLATES = {
    "attribute walk": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    "cycler globals": ("{{ cycler.__init__.__globals__ }}", "unsafe"),
    "endless loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                      "{% endfor %}", "render limit"),
    "huge string": ("{{ 'a' * 10**9 }}", "repeated sequence"),
    "format width": ("{{ '%999999999d' % 1 }}", "formatted field"),
    "macro recursion": ("{% macro r() %}{{ r() }}{% endmacro %}{{ r() }}", "recursed"),
    # Regression: Python's compiler limits escaped as SyntaxError (UNKNOWN).
    "nested for": ("{% for a in [1] %}" * 30 + "{% endfor %}" * 30, "nest"),
    "nested parentheses": ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "nest"),
}


@pytest.mark.parametrize(("template", "words"), HOSTILE_TEMPLATES.values(),
                         ids=HOSTILE_TEMPLATES.keys())
def test_hostile_request_templates_are_refused_promptly(
        cluster: Cluster, channel: grpc.Channel, template: str, words: str) -> None:
    chat = chat_grpc.ChatServiceStub(channel)
    outcome: dict[str, Any] = {}

    def hostile() -> None:
        start = time.monotonic()
        try:
            chat.Chat(chat_pb2.ChatRequest(
                messages=[chat_pb2.ChatMessage(role="user", content="hi")],
                chat_template=template, sampling=common_pb2.SamplingParams(max_tokens=2)),
                timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            outcome["error"] = e
        outcome["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=hostile)
    thread.start()
    # Sent while the template renders (or right after a quick refusal): the frontend's
    # event loop is not held by it.
    start = time.monotonic()
    reply = pb_grpc.GenerateServiceStub(channel).Generate(pb.GenerateRequest(
        text="hello", sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)),
        timeout=CALL_TIMEOUT_S)
    assert len(reply.completions[0].token_ids) == 4
    assert time.monotonic() - start < RENDER_TIMEOUT_S + 5
    thread.join(CALL_TIMEOUT_S)
    error = outcome["error"]
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
    assert words in error.details() and "template" in error.details(), error.details()
    assert outcome["seconds"] < RENDER_TIMEOUT_S + 5
    assert cluster.proc.poll() is None


# ---- PoolingService, on an embedder -----------------------------------------------


@pytest.fixture(scope="module")
def pooling_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # Imported here: sentence-transformers and torch load only when this runs.
    from tests.unit.engine.pooling_checkpoints import make_embedder

    folder = tmp_path_factory.mktemp("fuzz-embedder") / "st"
    make_embedder(folder, "qwen3", "MEAN", normalize=True,
                  prompts={"query": "query: ", "document": ""})
    c = Cluster(["--model", str(folder), "--engines", "1", "--max-num-batched-tokens", "32"])
    yield c
    c.stop()


def _fuzz_pooling(cluster: Cluster, examples: int) -> None:
    with _channel(cluster) as channel:
        for surface in POOLING_SURFACES:
            fuzz_surface(channel, surface, examples)
            assert cluster.proc.poll() is None, cluster.output()
            assert alive(cluster.engine_pid(0)), cluster.output()
        # Still serving: an ordinary embedding.
        reply = channel.unary_unary(
            "/corestream.generate.v1.PoolingService/Embed",
            pooling_pb2.EmbedRequest.SerializeToString, pooling_pb2.EmbedResponse.FromString)(
            pooling_pb2.EmbedRequest(inputs=[pooling_pb2.PoolingInput(text="hello")]),
            timeout=CALL_TIMEOUT_S)
        assert len(reply.embeddings) == 1 and reply.embeddings[0].values


def test_fuzz_pooling(pooling_cluster: Cluster) -> None:
    _fuzz_pooling(pooling_cluster, FUZZ_EXAMPLES)


@pytest.mark.slow
@pytest.mark.timeout(6 * 3600)
def test_fuzz_pooling_thousands(pooling_cluster: Cluster) -> None:
    _fuzz_pooling(pooling_cluster, SLOW_FUZZ_EXAMPLES)


# ---- AdminService, on the same cluster, undone after every example ---------------


def restore_admin(admin: admin_grpc.AdminServiceStub) -> Callable[[], None]:
    """Undo what an admin call may have left: a pause, sleep, profile or open update;
    then check that nothing is left paused or asleep."""
    def restore() -> None:
        for undo in (lambda: admin.ResumeScheduling(admin_pb2.ResumeSchedulingRequest()),
                     lambda: admin.WakeUp(admin_pb2.WakeUpRequest()),
                     lambda: admin.StopProfile(admin_pb2.StopProfileRequest()),
                     lambda: admin.AbortWeightUpdate(admin_pb2.AbortWeightUpdateRequest())):
            try:
                undo()
            except grpc.RpcError as e:  # nothing to undo is a refusal, not a failure
                assert e.code() in CLIENT_ERRORS, e
        assert not admin.IsPaused(admin_pb2.IsPausedRequest(), timeout=30).is_paused
        sleeping = admin.IsSleeping(admin_pb2.IsSleepingRequest(), timeout=30)
        assert all(not json.loads(r.result_json or "{}").get("sleeping") for r in
                   sleeping.results if r.ok), sleeping
    return restore


def on_real_engines(cls: type[Message]) -> st.SearchStrategy[Message]:
    """Any request, but for the cluster's one engine (0), all engines (unset), or the
    next index, which is not there: the generic strategy's random indexes are nearly
    all refused before any engine is asked."""
    @st.composite
    def build(draw: st.DrawFn) -> Message:
        request: Any = draw(messages(cls.DESCRIPTOR))
        index = draw(st.sampled_from([None, 0, 0, 1]))
        if index is None:
            request.ClearField("engine_index")
        else:
            request.engine_index = index
        return request  # type: ignore[no-any-return]

    return build()


def _admin_surfaces(tmp: Path) -> list[Surface]:
    # InitWeightTransfer would wait timeout_s (default 300 s) for a trainer that never
    # comes: its targeted requests name a closed local port and a short timeout.
    def init_transfer(cls: type[Message]) -> st.SearchStrategy[Message]:
        return st.builds(admin_pb2.InitWeightTransferRequest,
                         master_address=st.just("127.0.0.1"), master_port=st.just(1),
                         rank_offset=st.integers(0, 3), world_size=st.integers(0, 4),
                         timeout_s=st.sampled_from([0.1, 0.5, -1.0, math.nan, math.inf]))

    def from_disk(cls: type[Message]) -> st.SearchStrategy[Message]:
        return st.builds(admin_pb2.UpdateWeightsFromDiskRequest,
                         path=st.sampled_from([str(tmp), "/nonexistent", "", "/proc/self",
                                               "relative/dir"]) | ODD_TEXT)

    surfaces = []
    for surface in ADMIN_SURFACES:
        targeted = {"InitWeightTransfer": init_transfer,
                    "UpdateWeightsFromDisk": from_disk}.get(surface.method)
        if targeted is None and "engine_index" in surface.descriptor.input_type.fields_by_name:
            targeted = on_real_engines
        if surface.method == "InitWeightTransfer":
            # Only the targeted strategy: a generic timeout_s may be hours.
            surfaces.append(_TargetedOnly(ADMIN, surface.method, init_transfer,
                                          surface.extra_codes))
        elif targeted is not None:
            surfaces.append(Surface(ADMIN, surface.method, targeted, surface.extra_codes))
        else:
            surfaces.append(surface)
    return surfaces


class _TargetedOnly(Surface):
    def requests(self) -> st.SearchStrategy[Message]:
        assert self.targeted is not None
        return self.targeted(message_class(self.descriptor.input_type))


def _fuzz_admin(cluster: Cluster, channel: grpc.Channel, tmp: Path, examples: int) -> None:
    admin = admin_grpc.AdminServiceStub(channel)
    _run(cluster, channel, _admin_surfaces(tmp), examples, restore_admin(admin))


def test_fuzz_admin(cluster: Cluster, channel: grpc.Channel, tmp_path: Path) -> None:
    _fuzz_admin(cluster, channel, tmp_path, max(5, FUZZ_EXAMPLES // 3))


@pytest.mark.slow
@pytest.mark.timeout(6 * 3600)
def test_fuzz_admin_thousands(cluster: Cluster, channel: grpc.Channel,
                              tmp_path: Path) -> None:
    _fuzz_admin(cluster, channel, tmp_path, SLOW_FUZZ_EXAMPLES)
