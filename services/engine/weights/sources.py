"""Where a live update's tensors come from: each source announces the tensors it will
deliver (so a bad update fails before any arrives) and then yields them in order.

- `DiskSource`: a safetensors checkpoint folder (all of a model's tensors, or some);
- `BroadcastSource`: tensors a trainer broadcasts, one by one, over the weight-transfer
  group (`transfer_group.py`), as announced in the update's names, dtypes and shapes;
- `SharedMemorySource`: tensors a trainer on the same machine wrote into one file in
  /dev/shm, at announced byte offsets (`trainer.write_shared_tensors` writes one).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from services.engine.models.checkpoint_layout import SAFETENSORS_DTYPES
from services.engine.parallel.collectives import Collectives
from services.engine.weights.staging import WantedTensor, WeightUpdateError

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16,
    "half": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
}


def dtype_from_name(name: str, field: str = "dtype") -> torch.dtype:
    """A floating dtype by its torch name ("bfloat16", "torch.float32")."""
    dtype = _DTYPE_NAMES.get(name.removeprefix("torch."))
    if dtype is None:
        raise WeightUpdateError(f"{field} {name!r} is not a floating-point dtype "
                                f"(choose from {', '.join(sorted(_DTYPE_NAMES))})")
    return dtype


def wanted_tensors(names: Sequence[str], dtype_names: Sequence[str],
                   shapes: Sequence[Sequence[int]]) -> list[WantedTensor]:
    """An announced update's tensors from its three parallel lists."""
    if not len(names) == len(dtype_names) == len(shapes):
        raise WeightUpdateError(
            f"names, dtype_names and shapes must be as long as each other: got "
            f"{len(names)}, {len(dtype_names)} and {len(shapes)}")
    if len(set(names)) < len(names):
        repeated = sorted({n for n in names if list(names).count(n) > 1})
        raise WeightUpdateError(f"tensor {repeated[0]!r} is named more than once")
    wanted = []
    for name, dtype_name, shape in zip(names, dtype_names, shapes, strict=True):
        if any(int(d) < 0 for d in shape):
            raise WeightUpdateError(f"tensor {name!r}: shape {list(shape)} has a negative size")
        wanted.append(WantedTensor(name, dtype_from_name(dtype_name, f"tensor {name!r}: dtype"),
                                   tuple(int(d) for d in shape)))
    return wanted


class TensorSource(Protocol):
    @property
    def wanted(self) -> list[WantedTensor]:
        """Every tensor the source will yield, in order."""
        ...

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def drain(self) -> None:
        """Take whatever the sender insists on sending after the update was refused."""
        ...

    def describe(self) -> str: ...


class DiskSource:
    def __init__(self, folder: str | Path, architectures: Sequence[str]) -> None:
        """A checkpoint folder for a model of `architectures` (config.json's, if the folder
        has one, must name the same)."""
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise WeightUpdateError(f"path {str(folder)!r} is not a folder")
        config = self.folder / "config.json"
        if config.is_file():
            theirs = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
            if list(theirs) != list(architectures):
                raise WeightUpdateError(
                    f"path {str(folder)!r} holds a checkpoint of {theirs}; this engine serves "
                    f"{list(architectures)}")
        self._files = sorted(self.folder.glob("*.safetensors"))
        if not self._files:
            raise WeightUpdateError(f"path {str(folder)!r} has no *.safetensors files")
        self._wanted: list[WantedTensor] = []
        for file in self._files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    part = f.get_slice(name)
                    dtype = SAFETENSORS_DTYPES.get(part.get_dtype(), torch.uint8)
                    self._wanted.append(WantedTensor(name, dtype, tuple(part.get_shape())))

    @property
    def wanted(self) -> list[WantedTensor]:
        return self._wanted

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self._files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118
                    yield name, f.get_tensor(name)

    def drain(self) -> None:
        pass  # nobody sends: the files wait

    def describe(self) -> str:
        return f"disk {self.folder}"


class BroadcastSource:
    def __init__(self, group: Collectives, wanted: list[WantedTensor], src: int = 0) -> None:
        """The tensors rank `src` (the trainer) broadcasts over `group`, as `wanted` says."""
        self._group = group
        self._wanted = wanted
        self._src = src

    @property
    def wanted(self) -> list[WantedTensor]:
        return self._wanted

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for tensor in self._wanted:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype)
            self._group.broadcast(buffer, self._src)
            yield tensor.name, buffer

    def drain(self) -> None:
        """Receive (and drop) every announced tensor: a refused update must still take
        its broadcasts, or the trainer's side of the group would wait for it."""
        for _ in self.tensors():
            pass

    def describe(self) -> str:
        return f"broadcast from trainer rank {self._src}"


@dataclass(frozen=True, slots=True)
class SharedMemorySource:
    path: str
    """A file under /dev/shm (or any file) holding the tensors' bytes."""
    wanted_list: list[WantedTensor]
    offsets: list[int]
    """Byte offset of each tensor in the file, in `wanted_list`'s order."""

    @property
    def wanted(self) -> list[WantedTensor]:
        return self.wanted_list

    def check(self) -> None:
        if len(self.offsets) != len(self.wanted_list):
            raise WeightUpdateError(f"offsets has {len(self.offsets)} entries for "
                                    f"{len(self.wanted_list)} tensors")
        try:
            size = os.stat(self.path).st_size
        except OSError as exc:
            raise WeightUpdateError(f"shared-memory file {self.path!r}: {exc.strerror}") from None
        for tensor, offset in zip(self.wanted_list, self.offsets, strict=True):
            nbytes = _numel(tensor.shape) * tensor.dtype.itemsize
            if offset < 0 or offset + nbytes > size:
                raise WeightUpdateError(
                    f"tensor {tensor.name!r}: bytes [{offset}, {offset + nbytes}) lie outside "
                    f"the shared-memory file {self.path!r} ({size} bytes)")

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        with open(self.path, "rb") as file:
            # Copy-on-write: torch wants a writable buffer, and the trainer's file stays as
            # it is.
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            for tensor, offset in zip(self.wanted_list, self.offsets, strict=True):
                count = _numel(tensor.shape)
                flat = torch.frombuffer(mapped, dtype=tensor.dtype, count=count, offset=offset)
                yield tensor.name, flat.view(tensor.shape)
                del flat
        finally:
            # The staging copied every tensor it keeps; a view still alive in the caller
            # (BufferError) keeps the map until it goes.
            with contextlib.suppress(BufferError):
                mapped.close()

    def drain(self) -> None:
        pass

    def describe(self) -> str:
        return f"shared memory {self.path}"


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """A source as a message can carry it (to tensor-parallel workers too): every rank
    opens its own (`open_source`) and reads its own shard from it."""

    kind: str
    """"disk", "broadcast" or "shared_memory"."""
    path: str = ""
    wanted: tuple[WantedTensor, ...] = ()
    offsets: tuple[int, ...] = ()


SOURCE_KINDS = ("disk", "broadcast", "shared_memory")


def spec_to_json(spec: SourceSpec) -> dict[str, Any]:
    """`spec` as JSON, for a tensor-parallel worker (`spec_from_json`)."""
    return {"kind": spec.kind, "path": spec.path, "offsets": list(spec.offsets),
            "wanted": [[w.name, str(w.dtype).removeprefix("torch."), list(w.shape)]
                       for w in spec.wanted]}


def spec_from_json(data: dict[str, Any]) -> SourceSpec:
    wanted = wanted_tensors([w[0] for w in data["wanted"]], [w[1] for w in data["wanted"]],
                            [w[2] for w in data["wanted"]])
    return SourceSpec(data["kind"], data["path"], tuple(wanted), tuple(data["offsets"]))


def open_source(spec: SourceSpec, architectures: Sequence[str],
                group: Collectives | None) -> TensorSource:
    """`spec`'s source for a model of `architectures`; `group`: this rank's membership
    in the weight-transfer group, for broadcasts."""
    if spec.kind == "disk":
        return DiskSource(spec.path, architectures)
    if spec.kind == "broadcast":
        if group is None:
            raise WeightUpdateError("no weight-transfer group: init it first "
                                    "(init_weight_transfer_engine)")
        return BroadcastSource(group, list(spec.wanted))
    if spec.kind == "shared_memory":
        source = SharedMemorySource(spec.path, list(spec.wanted), list(spec.offsets))
        source.check()
        return source
    raise WeightUpdateError(f"source {spec.kind!r} is not one of {', '.join(SOURCE_KINDS)}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
