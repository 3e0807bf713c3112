"""A cluster for the RL tests (live weight updates, sleep): a random-weight checkpoint
served by `corestream serve`, perturbed by each test into new checkpoints, with the
greedy tokens (and the versions they carry) checked against transformers' on the
weights the engines should hold; and a trainer process for broadcasts over gloo.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import torch
from corestream.generate.v1 import admin_service_pb2 as admin_pb
from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from services.common.ports import free_port
from services.common.tiny_checkpoint import ensure_tiny_checkpoint
from services.engine.weights.trainer import update_info
from tests.integration.cluster import REPO, Cluster
from tests.unit.engine.hf_checkpoints import hf_greedy, make_checkpoint

PROMPTS = [[5, 17, 42, 9, 100], [7, 7, 31, 200, 3, 64, 12]]
NUM_TOKENS = 6


class Setup:
    def __init__(self, root: Path, *, engines: int = 2, tensor_parallel_size: int = 1,
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        self.root = root
        self.engines = tuple(range(engines))
        tiny = ensure_tiny_checkpoint()
        vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
        self.hf = make_checkpoint(root / "v0", "llama", vocab_size=vocab)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (tiny / name).exists():
                shutil.copy(tiny / name, root / "v0" / name)
        self.http_port = free_port()
        self.cluster = Cluster(["--model", str(root / "v0"), "--engines", str(engines),
                                "--tensor-parallel-size", str(tensor_parallel_size),
                                "--http-port", str(self.http_port), "--weight-version", "v0",
                                "--kv-cache-memory", "16MiB", *extra_args], env=env)
        self.channel = grpc.insecure_channel(self.cluster.address)
        self.generate = pb_grpc.GenerateServiceStub(self.channel)
        self.admin = admin_grpc.AdminServiceStub(self.channel)
        self.seed = 0

    def close(self) -> None:
        self.channel.close()
        self.cluster.stop()

    def perturb(self, folder: str, names: set[str] | None = None) -> tuple[Path, PreTrainedModel]:
        """A new checkpoint folder (all tensors, or `names`) and the model it makes."""
        self.seed += 1
        gen = torch.Generator().manual_seed(self.seed)
        state = self.hf.state_dict()
        new = {n: (t + 0.05 * torch.randn(t.shape, generator=gen)).contiguous()
               for n, t in state.items() if names is None or n in names}
        self.hf.load_state_dict(new, strict=False)
        (self.root / folder).mkdir()
        save_file(new, self.root / folder / "model.safetensors")
        return self.root / folder, self.hf

    def outputs(self, engine: int) -> list[tuple[list[int], set[str]]]:
        """Greedy tokens of every prompt on one engine, with the versions their chunks
        carried."""
        found = []
        for prompt in PROMPTS:
            tokens: list[int] = []
            versions: set[str] = set()
            for chunk in self.generate.GenerateStream(pb.GenerateStreamRequest(
                    token_ids=pb.TokenIds(ids=prompt), data_parallel_rank=engine,
                    sampling={"temperature": 0.0, "max_tokens": NUM_TOKENS, "ignore_eos": True}),
                    timeout=60):
                tokens += chunk.token_ids
                if chunk.token_ids:
                    versions.add(chunk.weight_version)
            found.append((tokens, versions))
        return found

    def expect(self, model: PreTrainedModel, version: str) -> None:
        want = [hf_greedy(model, p, NUM_TOKENS) for p in PROMPTS]
        for engine in self.engines:
            assert self.outputs(engine) == [(w, {version}) for w in want], engine
        info = self.generate.GetModelInfo(pb.GetModelInfoRequest())
        assert info.weight_version == version


# The trainer and two engine ranks: two DP engines, or one engine over two TP ranks.
WORLD_SIZE = 3


def start_trainer(port: int, folder: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.rl_trainer", str(port), str(WORLD_SIZE),
         str(folder), *extra], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)


def init_group(setup: Setup, port: int) -> None:
    reply = setup.admin.InitWeightTransfer(admin_pb.InitWeightTransferRequest(
        master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=WORLD_SIZE,
        timeout_s=30), timeout=120)
    assert reply.ok, reply


def announce(folder: Path) -> admin_pb.UpdateWeightsRequest:
    info = update_info(list(load_file(folder / "model.safetensors").items()))
    return admin_pb.UpdateWeightsRequest(
        names=info["names"], dtype_names=info["dtype_names"],
        shapes=[admin_pb.TensorShape(dims=s) for s in info["shapes"]])


