"""KV-cache events in vLLM's wire format from a real cluster (`corestream serve
--engines 2 --kv-events-endpoint ...`), read as llm-d's indexer reads them: its
subscriber binds, each engine dials it (engine N on port + N), and a replay socket
per engine hands back what the subscriber missed before it was connected.

Checked against the documented layout with plain msgpack: every block a request
stored is announced with its own token ids (each hash recomputed from the parent and
the tokens), removals name only blocks stored before and follow the evictions of a
cache too small for the workload, sequence numbers have no gaps, replay returns what
was missed, and the mirror rebuilt from the events holds exactly as many blocks as
the engine says it caches. When the vLLM CPU venv of the benchmarks is installed
(`benchmarks/vllm_reference.py --install`), vLLM's own decoder reads the payloads too.
"""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import msgpack
import pytest
import zmq
from corestream.generate.v1 import admin_service_pb2 as admin_pb
from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

from services.common.block_hash import hash_block
from services.common.ports import free_port
from services.engine.kv_publisher.wire import END_SEQ
from tests.integration.cluster import REPO, Cluster

pytestmark = pytest.mark.timeout(300)

ENGINES = 2
BLOCK_SIZE = 16
PROMPT_BLOCKS = 4
TOPIC = b"kv@127.0.0.1@tiny"
VLLM_PYTHON = REPO / "benchmarks" / ".cache" / "vllm-venv" / "bin" / "python"


class Subscriber:
    """A SUB socket that binds (engines dial it) and is read all the time by a thread
    of its own, as an indexer's is: a SUB only tells a newly connected PUB its
    subscription when its owner next calls into it, so one left alone gets nothing."""

    def __init__(self, port: int) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.bind(f"tcp://127.0.0.1:{port}")
        self.socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.got: list[tuple[int, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.socket.poll(50):
                topic, seq, payload = self.socket.recv_multipart()
                assert topic == TOPIC
                self.got.append((int.from_bytes(seq, "big"), payload))
        self.socket.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Setup:
    def __init__(self) -> None:
        context = zmq.Context.instance()
        # Engine N binds or dials port + N. Below the kernel's ephemeral range, and
        # promised: a port probed free there was once taken before an engine bound it.
        port = free_port(count=ENGINES)
        self.subs = [Subscriber(port + rank) for rank in range(ENGINES)]
        replay_port = free_port(count=ENGINES)
        self.cluster = Cluster([
            "--engines", str(ENGINES), "--kv-cache-memory", "1MiB",
            "--block-size", str(BLOCK_SIZE),
            "--kv-events-endpoint", f"tcp://127.0.0.1:{port}",
            "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
            "--kv-events-topic", TOPIC.decode()])
        self.replays = []
        for rank in range(ENGINES):
            replay = context.socket(zmq.DEALER)
            replay.setsockopt(zmq.RCVTIMEO, 10_000)
            replay.connect(f"tcp://127.0.0.1:{replay_port + rank}")
            self.replays.append(replay)
        self.channel = grpc.insecure_channel(self.cluster.address)
        self.generate = pb_grpc.GenerateServiceStub(self.channel)
        self.admin = admin_grpc.AdminServiceStub(self.channel)

    def stats(self) -> dict[int, dict]:
        reply = self.admin.GetEngineStats(admin_pb.GetEngineStatsRequest(), timeout=30)
        return {r.engine_index: json.loads(r.result_json) for r in reply.results}

    def live(self, rank: int, last_seq: int) -> list[tuple[int, bytes]]:
        """What the subscriber got while it was connected, up to `last_seq`."""
        deadline = time.monotonic() + 30
        while not (self.subs[rank].got and self.subs[rank].got[-1][0] >= last_seq):
            assert time.monotonic() < deadline, self.subs[rank].got[-3:]
            time.sleep(0.05)
        return list(self.subs[rank].got)

    def replay(self, rank: int, start: int) -> list[tuple[int, bytes]]:
        self.replays[rank].send_multipart((b"", start.to_bytes(8, "big")))
        got = []
        while True:
            _, seq, payload = self.replays[rank].recv_multipart()
            if seq == END_SEQ:
                return got
            got.append((int.from_bytes(seq, "big"), payload))

    def close(self) -> None:
        self.channel.close()
        self.cluster.stop()
        for sub in self.subs:
            sub.close()
        for replay in self.replays:
            replay.close(0)


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    s = Setup()
    try:
        yield s
    finally:
        s.close()


def _prompts(rank: int, count: int) -> list[list[int]]:
    rng = random.Random(rank)
    shared = [rng.randrange(3, 390) for _ in range(2 * BLOCK_SIZE)]
    prompts = []
    for i in range(count):
        # Half the prompts share their first two blocks: stores of a run that starts
        # from a cached parent.
        head = shared if i % 2 else [rng.randrange(3, 390) for _ in range(2 * BLOCK_SIZE)]
        prompts.append(head + [rng.randrange(3, 390) for _ in range(2 * BLOCK_SIZE + 3)])
    return prompts


def _chain(prompt: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    for b in range(len(prompt) // BLOCK_SIZE):
        hashes.append(hash_block(hashes[-1] if hashes else None,
                                 prompt[b * BLOCK_SIZE:(b + 1) * BLOCK_SIZE]))
    return hashes


def test_engines_publish_every_stored_block_with_its_tokens_and_every_eviction(
        setup: Setup) -> None:
    num_blocks = setup.stats()[0]["num_blocks"]
    # More distinct blocks than the cache holds: the oldest are evicted.
    count = num_blocks // PROMPT_BLOCKS + 12
    sent: dict[int, list[list[int]]] = {r: _prompts(r, count) for r in range(ENGINES)}
    for i in range(count):
        for rank in range(ENGINES):
            reply = setup.generate.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=sent[rank][i]), data_parallel_rank=rank,
                sampling={"temperature": 0.0, "max_tokens": 1}), timeout=60)
            assert reply.completions[0].token_ids
    stats = setup.stats()
    for rank in range(ENGINES):
        replayed = setup.replay(rank, 0)
        assert [s for s, _ in replayed] == list(range(len(replayed)))
        live = setup.live(rank, replayed[-1][0])
        seqs = [s for s, _ in live]
        # Once connected, nothing is lost: the live seqs run to the end without a gap
        # (what went out before the connection is what replay is for).
        assert seqs == list(range(seqs[0], replayed[-1][0] + 1)), seqs
        assert dict(replayed)[seqs[0]] == live[0][1]  # the same bytes either way

        mirror: set[bytes] = set()
        removed = 0
        for _, payload in replayed:
            ts, events, dp_rank = msgpack.unpackb(payload)
            assert dp_rank == rank and ts > 0
            for e in events:
                if e["type"] == "BlockStored":
                    assert e["block_size"] == BLOCK_SIZE and e["medium"] == "GPU"
                    tokens, parent = e["token_ids"], e["parent_block_hash"]
                    assert len(tokens) == BLOCK_SIZE * len(e["block_hashes"])
                    for b, block_hash in enumerate(e["block_hashes"]):
                        own = tokens[b * BLOCK_SIZE:(b + 1) * BLOCK_SIZE]
                        assert block_hash == hash_block(parent, own)
                        assert block_hash not in mirror
                        mirror.add(block_hash)
                        parent = block_hash
                elif e["type"] == "BlockRemoved":
                    for block_hash in e["block_hashes"]:
                        mirror.remove(block_hash)  # only what was stored and still is
                        removed += 1
                else:
                    mirror.clear()
        assert removed > 0, "the workload should have evicted blocks"
        assert len(mirror) == stats[rank]["num_cached_blocks"]
        # Every prompt block was announced: the last prompts' are still cached.
        assert set(_chain(sent[rank][-1])) <= mirror


@pytest.mark.skipif(not VLLM_PYTHON.exists(),
                    reason="vLLM's CPU venv is not installed (benchmarks/vllm_reference.py "
                           "--install); the msgpack layout is checked above")
def test_vllms_own_decoder_reads_the_payloads(setup: Setup, tmp_path: Path) -> None:
    setup.generate.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=list(range(3, 3 + 3 * BLOCK_SIZE))), data_parallel_rank=0,
        sampling={"temperature": 0.0, "max_tokens": 1}), timeout=60)
    payloads = [p for _, p in setup.replay(0, 0)]
    (tmp_path / "payloads.msgpack").write_bytes(msgpack.packb(payloads))
    script = (
        "import json, sys, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch\n"
        "decode = msgspec.msgpack.Decoder(KVEventBatch).decode\n"
        "raw = msgspec.msgpack.decode(open(sys.argv[1], 'rb').read())\n"
        "print(json.dumps([[b.data_parallel_rank, [[type(e).__name__,\n"
        "    len(getattr(e, 'block_hashes', ())), getattr(e, 'token_ids', None)]\n"
        "    for e in b.events]] for b in map(decode, raw)]))\n")
    out = subprocess.run([str(VLLM_PYTHON), "-c", script, str(tmp_path / "payloads.msgpack")],
                         capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    ours = [[rank, [[e["type"], len(e.get("block_hashes", ())), e.get("token_ids")]
                    for e in events]]
            for _, events, rank in map(msgpack.unpackb, payloads)]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ours
    assert any(e[0] == "BlockStored" for _, events in ours for e in events)
