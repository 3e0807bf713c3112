"""How much memory the KV cache gets: a byte size, or a fraction of free memory.

`--kv-cache-memory` accepts `268435456`, `256MiB`, `2GiB`, `1.5GB` (bytes), or a
float in (0, 1] such as `0.5`: that share of the device memory still free once
the weights are loaded (on CPU, of the host's MemAvailable, or of what the process's
memory cgroup still allows where that is less: a pod's memory limit). A bare integer is
always bytes, so `1` is one byte and `1.0` is all free memory. `auto` (the default)
is the smaller of 4 GiB and half the free memory: as much as vLLM's CPU backend is
usually given, and on a small machine or in a small pod still room for the rest.
`KVCacheLayout` turns those bytes into blocks. No torch here: the runner supplies the
free-memory probe for its device, and allocates the blocks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.engine.worker.cgroup import CGROUP_ROOT, MEMBERSHIP, cgroup_memory_room

_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_PATTERN = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)")
EXAMPLES = ("bytes (268435456, 256MiB, 2GiB), a fraction in (0, 1] of free memory (0.5) "
            "or auto (the smaller of 4GiB and half the free memory)")
AUTO_MAX_BYTES = 4 << 30


@dataclass(frozen=True, slots=True)
class KVCacheMemory:
    """At most one of num_bytes and fraction is set; neither means auto."""

    num_bytes: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, value: str | int) -> KVCacheMemory:
        """Raises ValueError (without the field name; the config adds it)."""
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 1:
                raise ValueError(f"must be >= 1 byte, got {value}")
            return cls(num_bytes=value)
        text = str(value).strip().lower()
        if text == "auto":
            return cls()
        match = _PATTERN.fullmatch(text)
        if match is None or match.group(2) not in _UNITS:
            raise ValueError(f"must be {EXAMPLES}, got {value!r}")
        number, unit = match.groups()
        if not unit and "." in number:
            fraction = float(number)
            if not 0 < fraction <= 1:
                raise ValueError(f"a fraction of free memory must be in (0, 1], got {value!r}")
            return cls(fraction=fraction)
        # Integers stay exact; floats only where the user wrote a decimal point.
        scale = _UNITS[unit]
        num_bytes = int(float(number) * scale) if "." in number else int(number) * scale
        if num_bytes < 1:
            raise ValueError(f"must be >= 1 byte, got {value!r}")
        return cls(num_bytes=num_bytes)

    @property
    def is_auto(self) -> bool:
        return self.num_bytes is None and self.fraction is None

    def resolve(self, free_memory: Callable[[], int]) -> int:
        """Bytes for the KV cache; `free_memory` is only probed for a fraction."""
        if self.num_bytes is not None:
            return self.num_bytes
        if self.fraction is None:
            return min(AUTO_MAX_BYTES, free_memory() // 2)
        return int(free_memory() * self.fraction)


def available_host_memory(
    meminfo: Path = Path("/proc/meminfo"), cgroup_root: Path = CGROUP_ROOT,
    membership: Path = MEMBERSHIP,
) -> int:
    """Bytes this process can still allocate: the host's MemAvailable, capped by the room
    left under its memory cgroup's limit.

    NOTE: in a container MemAvailable is the node's; a fraction of it can exceed the
    pod's memory limit many times over, and the kernel's OOM killer ends the engine.
    """
    kib = next((line.split()[1] for line in meminfo.read_text().splitlines()
                if line.startswith("MemAvailable:")), None)
    if kib is None:
        raise RuntimeError(f"no MemAvailable in {meminfo}")
    available = int(kib) * 1024  # the kernel reports kB (KiB)
    room = cgroup_memory_room(cgroup_root, membership)
    return available if room is None else min(available, room)


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """One rank's KV cache: per layer, keys and values of `num_kv_heads` heads for each
    token slot of every block."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    """KV heads on this rank (its share under tensor parallelism)."""
    head_dim: int
    itemsize: int
    """Bytes per element of the cache's dtype."""

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer."""
        per_token = 2 * self.num_kv_heads * self.head_dim * self.itemsize * self.num_layers
        return per_token * self.block_size

    def block_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's cache: `[2, num_blocks, block_size, kv_heads, head_dim]`."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def sequence_blocks(self, tokens: int) -> int:
        """The blocks one sequence of `tokens` tokens takes."""
        return -(-tokens // self.block_size)

    def num_blocks(self, kv_bytes: int, max_model_len: int, memory: str | int) -> int:
        """The blocks that `kv_bytes` hold; ValueError when one max_model_len sequence
        does not fit (`memory`: the --kv-cache-memory that gave the bytes, for the
        message)."""
        num_blocks = kv_bytes // self.block_bytes
        needed = self.sequence_blocks(max_model_len)
        if num_blocks < needed:
            raise ValueError(
                f"kv_cache_memory {memory!r} ({kv_bytes} bytes) holds "
                f"{num_blocks} blocks of {self.block_bytes} bytes, but one max_model_len "
                f"({max_model_len}) sequence needs {needed}: raise "
                f"kv_cache_memory to at least {needed * self.block_bytes} or lower max_model_len"
            )
        return num_blocks
