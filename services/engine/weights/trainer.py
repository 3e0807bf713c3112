"""The trainer's side of live weight updates, for a trainer process in Python.

    group = trainer_group("127.0.0.1", port, world_size)   # while the engines join
    ... POST /start_weight_update; then POST /update_weights with update_info(tensors)
    broadcast_weights(group, tensors)                       # while that call waits
    ... POST /finish_weight_update

or, on the same machine, `write_shared_tensors(tensors)` and the path, names, dtypes,
shapes and offsets it returns in the update's body. The engines' side is
`sources.py` and `transfer_group.py`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from services.engine.parallel.collectives import Collectives, connect
from services.engine.weights.transfer_group import DEFAULT_TIMEOUT_S, TRAINER_RANK

_ALIGN = 64


def trainer_group(master_address: str, master_port: int, world_size: int,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> Collectives:
    """Host the group as rank 0; returns once the engines' ranks have joined."""
    return connect(Collectives, TRAINER_RANK, world_size, master_address, master_port, None,
                   timeout_s)


def update_info(tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The body of an update that broadcasts `tensors` in this order."""
    return {"names": [name for name, _ in tensors],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors]}


def broadcast_weights(group: Collectives, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    for _, tensor in tensors:
        group.broadcast(tensor.detach().contiguous(), TRAINER_RANK)


def write_shared_tensors(tensors: Sequence[tuple[str, torch.Tensor]],
                         folder: str | None = None) -> dict[str, Any]:
    """Write `tensors` into one new file in /dev/shm (or `folder`); returns the update's
    body naming it. The caller removes the file once the update finished."""
    folder = folder or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    fd, path = tempfile.mkstemp(prefix="corestream-weights-", dir=folder)
    offsets = []
    offset = 0
    for _, tensor in tensors:
        offsets.append(offset)
        offset += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    with os.fdopen(fd, "wb") as file:
        file.truncate(offset)
        for (_, tensor), start in zip(tensors, offsets, strict=True):
            file.seek(start)
            file.write(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return {"path": path, "offsets": offsets, **update_info(tensors)}
