"""A rank of an expert-parallel group killed: how long until the group serves again (#40).

    .venv/bin/python benchmarks/group_fault.py [--runs 3] [--root TREE]

`corestream serve --engines 2` on a random 4-layer Mixtral (experts split over the two
ranks). Rank 0 streams a 200-token answer; rank 1 is SIGKILLed. Prints, per run, how long
until both ranks answer a request again (polled from the moment of the kill), whether rank
0's stream completed or ended with an error, and whether rank 0 is still the same process.
With the engine sentinel, rank 0 keeps its stream and re-forms the group with the
replacement serve starts for rank 1; before it, serve restarted the whole group. `--root`
runs another tree's serve (e.g. a worktree of an older commit), to compare the two in one
sitting.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from benchmarks.workload import mixtral_checkpoint  # noqa: E402


def one_run(model: Path, root: Path) -> tuple[float, str, bool]:
    import grpc
    from corestream.common.v1 import common_pb2
    from corestream.generate.v1 import generate_service_pb2 as pb
    from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

    from tests.integration import cluster as cluster_module
    from tests.integration.cluster import Cluster

    cluster_module.REPO = root  # serve runs from that tree (its services, its protos)

    def sampling(tokens: int) -> Any:
        return common_pb2.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)

    def answers(stub: Any, rank: int) -> bool:
        try:
            stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                             data_parallel_rank=rank, sampling=sampling(4)),
                          timeout=10)
            return True
        except grpc.RpcError:
            return False

    cluster = Cluster(["--model", str(model), "--engines", "2", "--data-parallel-timeout",
                       "15", "--kv-cache-memory", "16MiB"], env={"OMP_NUM_THREADS": "1"},
                      startup_timeout=300)
    try:
        with grpc.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            assert answers(stub, 0) and answers(stub, 1)
            stream = stub.GenerateStream(pb.GenerateStreamRequest(
                token_ids=pb.TokenIds(ids=[9, 8, 7]), data_parallel_rank=0,
                sampling=sampling(200)), timeout=300)
            next(stream)
            survivor = cluster.engine_pid(0)
            os.kill(cluster.engine_pid(1), signal.SIGKILL)
            killed = time.monotonic()
            ended: list[str] = []

            def drain() -> None:
                try:
                    for _ in stream:
                        pass
                    ended.append("completed")
                except grpc.RpcError as e:
                    ended.append(e.code().name)

            reader = threading.Thread(target=drain)
            reader.start()
            while not (answers(stub, 0) and answers(stub, 1)):
                time.sleep(0.2)
            serving = time.monotonic() - killed
            reader.join()
            return serving, ended[0], cluster.engine_pid(0) == survivor
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the tree whose serve runs (default: this one)")
    args = parser.parse_args()
    root = args.root.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        model = mixtral_checkpoint(Path(tmp) / "mixtral")
        print(f"{root}: rank 1 of 2 SIGKILLed while rank 0 streams")
        print(f"{'run':<5}{'serving again (s)':>19}{'rank 0 stream':>16}{'rank 0 same':>13}")
        for run in range(args.runs):
            serving, stream, same = one_run(model, root)
            print(f"{run:<5}{serving:>19.1f}{stream:>16}{str(same):>13}")


if __name__ == "__main__":
    main()
