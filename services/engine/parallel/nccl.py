"""NcclCommunicator: a collective group's CUDA transport, NCCL through cupy.

UNTESTED: written against cupy.cuda.nccl's documented API, but no machine this project
tests on has a GPU, so no test runs it. Importing this module needs cupy; `collectives`
imports it only for a CUDA device and falls back to gloo through host memory without it.

Rank 0 creates the NCCL unique id and publishes it in the group's TCPStore, where the
other ranks read it; each group (DP, TP) has its own store, so one key serves both.
Collectives are enqueued on torch's current stream of the tensor's device, so they
order with the kernels around them without a host sync.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from cupy.cuda import Device, nccl

_UNIQUE_ID_KEY = "corestream/nccl_unique_id"


def _nccl_dtype(dtype: torch.dtype) -> int:
    names = {
        torch.float32: "NCCL_FLOAT32",
        torch.float16: "NCCL_FLOAT16",
        torch.bfloat16: "NCCL_BFLOAT16",
        torch.int32: "NCCL_INT32",
        torch.int64: "NCCL_INT64",
    }
    if dtype not in names or not hasattr(nccl, names[dtype]):
        raise TypeError(f"no NCCL type for {dtype} in this cupy build")
    return getattr(nccl, names[dtype])


class NcclCommunicator:
    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device):
        if rank == 0:
            unique_id = nccl.get_unique_id()
            store.set(_UNIQUE_ID_KEY, ",".join(str(b) for b in unique_id))
        else:
            # get blocks until rank 0 has set the key (or the store's timeout passes).
            unique_id = tuple(int(b) for b in store.get(_UNIQUE_ID_KEY).decode().split(","))
        self.device = device
        with Device(device.index if device.index is not None else 0):
            self._comm = nccl.NcclCommunicator(world_size, unique_id, rank)

    def _stream(self, tensor: torch.Tensor) -> int:
        return torch.cuda.current_stream(tensor.device).cuda_stream

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._comm.allReduce(
            tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), _nccl_dtype(tensor.dtype),
            nccl.NCCL_SUM, self._stream(tensor),
        )

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        """`out` `[world_size, *tensor.shape]`, contiguous, receives every rank's tensor."""
        self._comm.allGather(
            tensor.data_ptr(), out.data_ptr(), tensor.numel(), _nccl_dtype(tensor.dtype),
            self._stream(tensor),
        )

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Rank `src`'s `tensor` into every rank's, in place."""
        self._comm.broadcast(
            tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), _nccl_dtype(tensor.dtype),
            src, self._stream(tensor),
        )
