"""`corestream serve --dtype bfloat16`, and `--dtype auto` on a bfloat16 checkpoint, serve
on every CPU: `make test` runs this module again with CORESTREAM_CPU_ISA=avx2, where oneDNN
takes no bfloat16 (as on a Zen 3) and the engine must lay its weights out as panels alone
rather than crash at load."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
import torch
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from corestream_kernels import cpu_isa
from safetensors.torch import load_file, save_file

from services.common.tiny_checkpoint import resolve_model
from tests.integration.cluster import Cluster

pytestmark = pytest.mark.timeout(300)


def bfloat16_checkpoint(folder: Path) -> Path:
    """The built-in tiny checkpoint stored in bfloat16, as most published ones are."""
    shutil.copytree(resolve_model(None), folder)
    weights = load_file(folder / "model.safetensors")
    save_file({name: w.to(torch.bfloat16) for name, w in weights.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("how", ["--dtype bfloat16", "--dtype auto, bf16 checkpoint"])
def test_bfloat16_serves_and_says_which_linear_path_it_took(how: str, tmp_path: Path) -> None:
    args: Sequence[str] = ["--dtype", "bfloat16"]
    if how.endswith("checkpoint"):
        args = ["--dtype", "auto", "--model", str(bfloat16_checkpoint(tmp_path / "bf16"))]
    cluster = Cluster(args)
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
