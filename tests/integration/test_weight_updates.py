"""Live weight updates through a real cluster (`corestream serve`, two DP engines): from
disk, from a trainer process over gloo, from shared memory; through AdminService and
vLLM's HTTP routes. Afterwards greedy outputs equal transformers' on the new weights,
and every output carries the version of the weights that made it.

The tests share one cluster and run in file order; each update perturbs the weights
again, so each test checks against its own reference model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from corestream.generate.v1 import admin_service_pb2 as admin_pb
from corestream.generate.v1 import generate_service_pb2 as pb
from safetensors.torch import load_file, save_file

from services.common.ports import free_port
from services.engine.weights.trainer import write_shared_tensors
from tests.integration.rl_cluster import PROMPTS, Setup, announce, init_group, start_trainer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    s = Setup(tmp_path_factory.mktemp("weights"))
    try:
        yield s
    finally:
        s.close()


def test_serves_the_start_version(setup: Setup) -> None:
    setup.expect(setup.hf, "v0")
    unary = setup.generate.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPTS[0]), sampling={"temperature": 0.0, "max_tokens": 3}))
    assert unary.completions[0].weight_version == "v0"
    assert unary.completions[0].first_weight_version == "v0"


def test_update_from_disk_switches_every_engine(setup: Setup) -> None:
    folder, model = setup.perturb("v1")
    reply = setup.admin.UpdateWeightsFromDisk(admin_pb.UpdateWeightsFromDiskRequest(
        path=str(folder), weight_version="v1"), timeout=120)
    assert reply.ok, reply
    assert reply.weight_version == "v1"
    assert [json.loads(r.result_json)["weight_version"] for r in reply.results] == ["v1", "v1"]
    setup.expect(model, "v1")


def test_partial_update_from_disk_over_http(setup: Setup) -> None:
    folder, model = setup.perturb("v2", {"model.layers.0.self_attn.v_proj.weight",
                                         "model.layers.1.mlp.down_proj.weight"})
    response = httpx.post(f"http://127.0.0.1:{setup.http_port}/update_weights_from_disk",
                          json={"model_path": str(folder)}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["weight_version"] == "v1+1"
    setup.expect(model, "v1+1")


def test_a_bad_update_changes_nothing(setup: Setup) -> None:
    folder = setup.root / "bad"
    folder.mkdir()
    good = setup.hf.state_dict()["model.norm.weight"] * 2
    save_file({"model.norm.weight": good.contiguous(),
               "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)},
              folder / "model.safetensors")
    reply = setup.admin.UpdateWeightsFromDisk(admin_pb.UpdateWeightsFromDiskRequest(
        path=str(folder)), timeout=120)
    assert not reply.ok
    assert all("tensor 'model.layers.0.mlp.up_proj.weight': shape [3, 3] differs from the "
               "checkpoint's [172, 64]" in r.message for r in reply.results), reply
    setup.expect(setup.hf, "v1+1")
    response = httpx.post(f"http://127.0.0.1:{setup.http_port}/update_weights_from_disk",
                          json={"model_path": str(setup.root / "nowhere")}, timeout=60)
    assert response.status_code == 400
    assert "is not a folder" in response.json()["error"]["message"]


def test_a_trainer_dying_mid_broadcast_leaves_the_old_weights(setup: Setup) -> None:
    before = {n: t.clone() for n, t in setup.hf.state_dict().items()}
    folder, _ = setup.perturb("dies")
    setup.hf.load_state_dict(before)  # the engines must keep these
    port = free_port()
    trainer = start_trainer(port, folder, "--die-after", "3")
    init_group(setup, port)
    assert setup.admin.StartWeightUpdate(admin_pb.StartWeightUpdateRequest()).ok
    reply = setup.admin.UpdateWeights(announce(folder), timeout=120)
    assert trainer.wait(60) == 3
    assert not reply.ok
    info = setup.admin.GetWeightInfo(admin_pb.GetWeightInfoRequest())
    assert [json.loads(r.result_json)["update"] for r in info.results] == ["none", "none"]
    setup.expect(setup.hf, "v1+1")


def test_update_from_a_trainer_over_gloo(setup: Setup) -> None:
    folder, model = setup.perturb("v3")
    port = free_port()
    trainer = start_trainer(port, folder)
    init_group(setup, port)
    assert setup.admin.StartWeightUpdate(admin_pb.StartWeightUpdateRequest()).ok
    reply = setup.admin.UpdateWeights(announce(folder), timeout=120)
    assert reply.ok, reply
    assert trainer.wait(60) == 0, trainer.stdout.read() if trainer.stdout else ""
    finish = setup.admin.FinishWeightUpdate(admin_pb.FinishWeightUpdateRequest(
        weight_version="v3"))
    assert finish.ok and finish.weight_version == "v3", finish
    setup.expect(model, "v3")


def test_update_from_shared_memory_over_http(setup: Setup) -> None:
    folder, model = setup.perturb("v4")
    body = write_shared_tensors(list(load_file(folder / "model.safetensors").items()))
    base = f"http://127.0.0.1:{setup.http_port}"
    try:
        for path, payload in (
                ("/start_weight_update", {"is_checkpoint_format": True}),
                ("/update_weights", {"update_info": {
                    "names": body["names"], "dtype_names": body["dtype_names"],
                    "shapes": body["shapes"], "shared_memory_path": body["path"],
                    "offsets": body["offsets"]}}),
                ("/finish_weight_update", {"weight_version": "v4"})):
            response = httpx.post(base + path, json=payload, timeout=120)
            assert response.status_code == 200, (path, response.text)
    finally:
        Path(body["path"]).unlink()
    setup.expect(model, "v4")
    info = httpx.get(base + "/weight_info", timeout=30).json()
    assert info["weight_version"] == "v4"
    completion = httpx.post(base + "/v1/completions", json={
        "model": str(setup.root / "v0"), "prompt": [5, 6, 7], "max_tokens": 2,
        "temperature": 0}, timeout=60).json()
    assert completion["metadata"] == {"weight_version": "v4"}, completion



def test_tensor_parallel_ranks_each_take_their_shard(tmp_path: Path) -> None:
    """One engine over two TP ranks: from disk, then from a trainer (whose group holds both
    ranks); each rank stages its own slices, both switch together, and the tokens are a
    single device's on the new weights. Sleep and wake reach both ranks too."""
    tp = Setup(tmp_path, engines=1, tensor_parallel_size=2)
    original = {n: t.clone() for n, t in tp.hf.state_dict().items()}
    try:
        tp.expect(tp.hf, "v0")
        folder, model = tp.perturb("v1")
        reply = tp.admin.UpdateWeightsFromDisk(admin_pb.UpdateWeightsFromDiskRequest(
            path=str(folder), weight_version="v1"), timeout=120)
        assert reply.ok, reply
        tp.expect(model, "v1")

        folder, model = tp.perturb("v2")
        port = free_port()
        trainer = start_trainer(port, folder)
        init_group(tp, port)
        assert tp.admin.StartWeightUpdate(admin_pb.StartWeightUpdateRequest()).ok
        reply = tp.admin.UpdateWeights(announce(folder), timeout=120)
        assert reply.ok, reply
        assert trainer.wait(60) == 0, trainer.stdout.read() if trainer.stdout else ""
        assert tp.admin.FinishWeightUpdate(admin_pb.FinishWeightUpdateRequest(
            weight_version="v2")).ok
        tp.expect(model, "v2")

        # A tensor that fits no rank fails the whole update on every rank.
        bad = tmp_path / "bad"
        bad.mkdir()
        save_file({"model.norm.weight": torch.ones(7)}, bad / "model.safetensors")
        reply = tp.admin.UpdateWeightsFromDisk(admin_pb.UpdateWeightsFromDiskRequest(
            path=str(bad)), timeout=120)
        assert not reply.ok and "model.norm.weight" in reply.results[0].message, reply
        tp.expect(model, "v2")

        # Sleep and wake reach every rank: level 2 drops both ranks' shards, and the
        # wake reloads the served checkpoint into each.
        asleep = tp.admin.Sleep(admin_pb.SleepRequest(level=2), timeout=60)
        assert asleep.ok, asleep
        assert json.loads(asleep.results[0].result_json)["weights_bytes"] > 0
        assert tp.admin.WakeUp(admin_pb.WakeUpRequest(), timeout=120).ok
        tp.hf.load_state_dict(original)
        tp.expect(tp.hf, "v0")
    finally:
        tp.close()
