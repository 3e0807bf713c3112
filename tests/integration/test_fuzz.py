"""Random and adversarial GenerateRequests against a real frontend and engine.

Every answer must be OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED (with a message),
no process may die, and ordinary requests must still succeed afterwards. The
frontend runs with small caps (max_tokens 4, n 4) so that the requests that are
valid stay cheap. FUZZ_EXAMPLES requests per property run in the default suite,
SLOW_FUZZ_EXAMPLES under -m slow.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.cluster import Cluster, alive
from tests.integration.protowire import length_delimited

FUZZ_EXAMPLES = 1000
SLOW_FUZZ_EXAMPLES = 5000
VOCAB = 394  # the built-in tiny checkpoint's
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
GENERATE = "/corestream.generate.v1.GenerateService/Generate"
GENERATE_STREAM = "/corestream.generate.v1.GenerateService/GenerateStream"
MAX_MESSAGE_BYTES = 1 << 20

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(["--max-tokens-limit", "4", "--max-n", "4",
                 "--max-message-bytes", str(MAX_MESSAGE_BYTES)])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def channel(cluster: Cluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(cluster.address, options=[
            ("grpc.max_send_message_length", 64 << 20)]) as ch:
        yield ch


# ---- strategies -----------------------------------------------------------------

INT32 = st.integers(-(1 << 31), (1 << 31) - 1)
UINT32 = st.one_of(st.integers(0, VOCAB + 5), st.integers(0, (1 << 32) - 1))
FLOAT32 = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, 1e-45, 3.4e38, -3.4e38, math.nan, math.inf, -math.inf]),
)
# Odd text: every plane, combining marks, RTL, zero-width, NUL, lone surrogates are
# not representable in proto strings (they fail to serialize), so they are left out.
ODD_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"]), max_size=40,
) | st.sampled_from(["", "\x00", "\u200b", "\u202e", "e\u0301", "\U0001f600" * 30,
                     "\ufffd", "\n", "</s>", "<s>", "a" * 300])
BIG_TEXT = st.builds(lambda c, n: c * n, st.sampled_from(["a", "\u00e9", "\U0001f600", " "]),
                     st.sampled_from([5_000, 60_000]))


def _optional(strategy: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.none() | strategy


def _field(draw: st.DrawFn, sensible: st.SearchStrategy[object],
           adversarial: st.SearchStrategy[object]) -> object:
    """Mostly unset or sensible, so that many requests reach the engine; sometimes
    anything at all."""
    roll = draw(st.integers(0, 9))
    if roll < 5:
        return None
    return draw(sensible if roll < 9 else adversarial)


_FLOAT_FIELDS = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
}
_INT_FIELDS = {
    "top_k": st.integers(-1, 50), "max_tokens": st.integers(1, 4), "min_tokens": st.integers(0, 2),
    "n": st.integers(1, 4), "logprobs": st.integers(0, 5), "prompt_logprobs": st.integers(0, 5),
}


@st.composite
def sampling_params(draw: st.DrawFn) -> common_pb2.SamplingParams:
    fields: dict[str, object] = {}
    for name, sensible in _FLOAT_FIELDS.items():
        fields[name] = _field(draw, sensible, FLOAT32)
    for name, sensible in _INT_FIELDS.items():
        fields[name] = _field(draw, sensible, INT32)
    fields["seed"] = _field(draw, st.integers(0, 100), st.integers(-(1 << 63), (1 << 63) - 1))
    fields["stop"] = draw(st.lists(ODD_TEXT, max_size=3) | st.lists(ODD_TEXT, max_size=20))
    fields["stop_token_ids"] = draw(st.lists(st.integers(0, VOCAB - 1), max_size=3)
                                    | st.lists(UINT32, max_size=70))
    fields["logit_bias"] = draw(st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-5, 5),
                                                max_size=3)
                                | st.dictionaries(UINT32, FLOAT32, max_size=8))
    fields["ignore_eos"] = draw(st.booleans())
    fields["include_stop_str_in_output"] = draw(st.booleans())
    return common_pb2.SamplingParams(
        **{k: v for k, v in fields.items() if v is not None})  # type: ignore[arg-type]


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=draw(st.sampled_from(["", "", "", "r-1"]) | ODD_TEXT),
        priority=draw(st.just(0) | INT32),
        cache_salt=draw(st.just("") | ODD_TEXT),
    )
    prompt = draw(st.sampled_from(["text", "text", "token_ids", "token_ids", "big_text",
                                   "none"]))
    if prompt == "text":
        request.text = draw(ODD_TEXT)
    elif prompt == "big_text":
        request.text = draw(BIG_TEXT)
    elif prompt == "token_ids":
        request.token_ids.ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), max_size=40)
                                          | st.lists(UINT32, max_size=40)))
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(sampling_params()))
    skip = draw(_optional(st.booleans()))
    if skip is not None:
        request.skip_special_tokens = skip
    return request


INVALID_UTF8 = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"abc\x80",
                                b"\xf4\x90\x80\x80", b"\xc0\xaf"])


@st.composite
def raw_requests(draw: st.DrawFn) -> bytes:
    """Wire bytes: a valid request plus a string with invalid UTF-8 (as the prompt
    text, a stop string, the request id), or plain garbage."""
    base = draw(generate_requests()).SerializeToString()
    bad = draw(INVALID_UTF8)
    kind = draw(st.sampled_from(["text", "stop", "request_id", "garbage"]))
    if kind == "text":
        return base + length_delimited(2, bad)
    if kind == "stop":  # sampling (4) is merged: its stop (6) gains the bad string
        return base + length_delimited(4, length_delimited(6, bad))
    if kind == "request_id":
        return base + length_delimited(1, bad)
    return draw(st.binary(min_size=1, max_size=64))


# ---- calling ----------------------------------------------------------------------


def call(channel: grpc.Channel, request: pb.GenerateRequest | bytes, stream: bool
         ) -> tuple[grpc.StatusCode, str]:
    data = request if isinstance(request, bytes) else request.SerializeToString()
    identity = (lambda b: b)  # noqa: E731 (send the bytes as they are)
    try:
        if stream:
            for _ in channel.unary_stream(GENERATE_STREAM, identity, identity)(data, timeout=60):
                pass
        else:
            channel.unary_unary(GENERATE, identity, identity)(data, timeout=60)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def check(channel: grpc.Channel, request: pb.GenerateRequest | bytes, stream: bool
          ) -> grpc.StatusCode:
    code, details = call(channel, request, stream)
    assert code in ALLOWED, f"{code}: {details}"
    if code is not grpc.StatusCode.OK:
        assert details.strip(), f"{code} without a message"
    return code


def assert_still_serving(cluster: Cluster, channel: grpc.Channel) -> None:
    assert cluster.proc.poll() is None, cluster.output()
    assert alive(cluster.engine_pid(0))
    stub = pb_grpc.GenerateServiceStub(channel)
    reply = stub.Generate(pb.GenerateRequest(text="hello", sampling=common_pb2.SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True)), timeout=60)
    assert len(reply.completions[0].token_ids) == 4
    chunks = list(stub.GenerateStream(pb.GenerateStreamRequest(
        token_ids=pb.TokenIds(ids=[1, 2, 3]),
        sampling=common_pb2.SamplingParams(n=2, max_tokens=3, ignore_eos=True)), timeout=60))
    assert sum(len(c.token_ids) for c in chunks) == 6


FUZZ_SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _fuzz(cluster: Cluster, channel: grpc.Channel, examples: int) -> None:
    codes: Counter[str] = Counter()

    @settings(max_examples=examples, **FUZZ_SETTINGS)  # type: ignore[arg-type]
    @given(request=generate_requests(), stream=st.booleans())
    def structured(request: pb.GenerateRequest, stream: bool) -> None:
        codes[check(channel, request, stream).name] += 1

    @settings(max_examples=max(50, examples // 4), **FUZZ_SETTINGS)  # type: ignore[arg-type]
    @given(data=raw_requests(), stream=st.booleans())
    def wire(data: bytes, stream: bool) -> None:
        # Bytes that happen to parse are judged like any request.
        codes["wire " + check(channel, data, stream).name] += 1

    structured()
    wire()
    print(f"fuzz: {sum(codes.values())} requests: {dict(codes)}")
    # Both paths were exercised: requests that ran on the engine and rejected ones.
    assert codes["OK"] > examples // 20 and codes["INVALID_ARGUMENT"] > examples // 4, codes
    assert_still_serving(cluster, channel)


def test_fuzz_generate(cluster: Cluster, channel: grpc.Channel) -> None:
    _fuzz(cluster, channel, FUZZ_EXAMPLES)


@pytest.mark.slow
def test_fuzz_generate_thousands(cluster: Cluster, channel: grpc.Channel) -> None:
    _fuzz(cluster, channel, SLOW_FUZZ_EXAMPLES)


@pytest.mark.parametrize(("name", "request_", "code"), [
    ("message over --max-message-bytes", pb.GenerateRequest(text="a" * (MAX_MESSAGE_BYTES + 1)),
     grpc.StatusCode.RESOURCE_EXHAUSTED),
    ("prompt past the context", pb.GenerateRequest(text="hello " * 100_000),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("token ids past the context", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 50_000)),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("token id out of the vocabulary", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[VOCAB])),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("largest uint32 token id", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[(1 << 32) - 1])),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("NaN temperature", pb.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(
        temperature=math.nan)), grpc.StatusCode.INVALID_ARGUMENT),
    ("infinite logit bias", pb.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(
        logit_bias={1: math.inf})), grpc.StatusCode.INVALID_ARGUMENT),
    ("max_tokens past the cap", pb.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(
        max_tokens=(1 << 31) - 1)), grpc.StatusCode.INVALID_ARGUMENT),
    ("n past the cap", pb.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(n=5)),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("too many stop strings", pb.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(
        stop=["\u202e"] * 17)), grpc.StatusCode.INVALID_ARGUMENT),
    ("giant stop string", pb.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(
        stop=["\U0001f600" * 257])), grpc.StatusCode.INVALID_ARGUMENT),
    ("invalid UTF-8 text", pb.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=1))
     .SerializeToString() + length_delimited(2, b"\xff\xfe"), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_adversarial_requests(cluster: Cluster, channel: grpc.Channel, name: str,
                              request_: pb.GenerateRequest | bytes, code: grpc.StatusCode) -> None:
    for stream in (False, True):
        got, details = call(channel, request_, stream)
        assert got is code, f"{name}: {got}: {details}"
        assert details.strip()
    assert_still_serving(cluster, channel)


def test_fuzz_tokenize_and_detokenize(cluster: Cluster, channel: grpc.Channel) -> None:
    stub = pb_grpc.GenerateServiceStub(channel)

    @settings(max_examples=150, **FUZZ_SETTINGS)  # type: ignore[arg-type]
    @given(text=ODD_TEXT | BIG_TEXT, add_special=_optional(st.booleans()),
           ids=st.lists(UINT32, max_size=50), skip=_optional(st.booleans()))
    def property_(text: str, add_special: bool | None, ids: list[int],
                  skip: bool | None) -> None:
        tokenize = pb.TokenizeRequest(text=text)
        if add_special is not None:
            tokenize.add_special_tokens = add_special
        reply = stub.Tokenize(tokenize, timeout=60)
        # What Tokenize gives, Detokenize takes.
        stub.Detokenize(pb.DetokenizeRequest(token_ids=reply.token_ids), timeout=60)
        detokenize = pb.DetokenizeRequest(token_ids=ids)
        if skip is not None:
            detokenize.skip_special_tokens = skip
        try:
            stub.Detokenize(detokenize, timeout=60)
        except grpc.RpcError as e:
            assert e.code() is grpc.StatusCode.INVALID_ARGUMENT and e.details(), e
            assert max(ids) >= VOCAB

    property_()
    assert_still_serving(cluster, channel)
