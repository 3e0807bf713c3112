"""A trainer process for the weight-update tests: hosts the weight-transfer group as
rank 0 and broadcasts a checkpoint folder's tensors, in file order.

    python -m tests.integration.rl_trainer PORT WORLD_SIZE FOLDER [--die-after N]

Prints "joined" once the engines joined and "sent" once every tensor went; with
--die-after it exits abruptly after N tensors (a trainer that dies mid-broadcast).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from safetensors.torch import load_file

from services.engine.weights.trainer import broadcast_weights, trainer_group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("world_size", type=int)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--die-after", type=int, default=-1)
    args = parser.parse_args()
    tensors = [item for file in sorted(args.folder.glob("*.safetensors"))
               for item in load_file(file).items()]
    group = trainer_group("127.0.0.1", args.port, args.world_size, timeout_s=60)
    print("joined", flush=True)
    if args.die_after >= 0:
        broadcast_weights(group, tensors[:args.die_after])
        print("dying", flush=True)
        sys.stdout.flush()
        os._exit(3)
    broadcast_weights(group, tensors)
    print("sent", flush=True)
    os._exit(0)  # gloo's threads need no orderly shutdown here


if __name__ == "__main__":
    main()
