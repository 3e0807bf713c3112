"""`corestream serve --dtype bfloat16` serves on every CPU: `make test` runs this module
again with CORESTREAM_CPU_ISA=avx2, where oneDNN takes no bfloat16 (as on a Zen 3) and the
engine must lay its weights out as panels alone rather than crash at load."""

from __future__ import annotations

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

from kernels import cpu_isa
from tests.integration.cluster import Cluster

pytestmark = pytest.mark.timeout(300)


def test_bfloat16_serves_and_says_which_linear_path_it_took() -> None:
    cluster = Cluster(["--dtype", "bfloat16"])
    try:
        with grpc.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=12,
                                                 ignore_eos=True)
            first = stub.Generate(pb.GenerateRequest(text="hello", sampling=sampling),
                                  timeout=60)
            again = stub.Generate(pb.GenerateRequest(text="hello", sampling=sampling),
                                  timeout=60)
    finally:
        cluster.stop()
    (completion,) = first.completions
    assert completion.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(completion.token_ids) == 12
    assert list(again.completions[0].token_ids) == list(completion.token_ids)
    layout = [line for line in cluster.lines if "linear layers on this CPU" in line]
    assert layout, cluster.output()
    target = cpu_isa.target()
    assert f"({target.name}, bfloat16)" in layout[0]
    if target.level == "avx2":
        assert "C++ panels for every call" in layout[0]
        assert "oneDNN bf16 unavailable on this CPU" in layout[0]
        assert "oneDNN packed" not in layout[0]
