"""The served model's tokenizer files as one zip, for GetTokenizer.

What goes in: the model folder's tokenizer and config files (`FILES`, then any
`*.jinja`, `*.tiktoken` or `*.model`), the files a router needs to build the same
tokenizer and chat template. A GGUF model's folder is its view
(services/common/gguf_checkpoint.py), whose tokenizer.json, tokenizer_config.json and
chat_template.jinja were written from the file's metadata, so it is zipped the same
way. A chat template given with --chat-template replaces the folder's as
chat_template.jinja: the bundle says what this server renders.

The archive is built once, off the event loop (reading and deflating a large
tokenizer.json takes ~100 ms), and kept: the folder is fixed for the process's life.
Entries are sorted and dated 1980-01-01, so the same files give the same bytes and
the same sha256 on every frontend.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

from corestream.vendor.smg_grpc_proto import common_pb2 as smg_common_pb2

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "added_tokens.json", "config.json", "generation_config.json", "vocab.json",
         "merges.txt", "tokenizer.model", "tiktoken.model", "chat_template.json")
PATTERNS = ("*.jinja", "*.tiktoken", "*.model")
CHUNK_BYTES = 64 * 1024
"""Per message: the size smg's gateway reads in."""
_EPOCH = (1980, 1, 1, 0, 0, 0)


def build_archive(folder: Path, chat_template: Path | None = None) -> bytes:
    """The zip of `folder`'s tokenizer files (FileNotFoundError when it has none)."""
    members: dict[str, bytes] = {}
    for name in FILES:
        if (folder / name).is_file():
            members[name] = (folder / name).read_bytes()
    for pattern in PATTERNS:
        for path in folder.glob(pattern):
            if path.is_file():
                members.setdefault(path.name, path.read_bytes())
    if chat_template is not None:
        members["chat_template.jinja"] = chat_template.read_bytes()
    if not any(name in members for name in ("tokenizer.json", "tokenizer.model",
                                            "vocab.json", "tiktoken.model")):
        raise FileNotFoundError(f"{folder} holds no tokenizer file")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in sorted(members):
            info = zipfile.ZipInfo(name, _EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, members[name])
    return buffer.getvalue()


def chunks(data: bytes, sha256: str) -> Iterator[smg_common_pb2.GetTokenizerChunk]:
    """The archive in CHUNK_BYTES pieces; the last carries the sha256 hex digest of the
    whole archive, the others an empty one."""
    for start in range(0, len(data), CHUNK_BYTES):
        end = min(start + CHUNK_BYTES, len(data))
        yield smg_common_pb2.GetTokenizerChunk(data=data[start:end],
                                               sha256=sha256 if end == len(data) else "")


class TokenizerArchive:
    """The archive of one folder, built on first use and kept."""

    def __init__(self, folder: Path, chat_template: Path | None = None) -> None:
        self._folder = folder
        self._chat_template = chat_template
        self._built: tuple[bytes, str] | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> tuple[bytes, str]:
        """(the zip's bytes, their sha256 hex digest)."""
        async with self._lock:  # callers during the build wait for the same one
            if self._built is None:
                data = await asyncio.to_thread(build_archive, self._folder,
                                               self._chat_template)
                self._built = data, hashlib.sha256(data).hexdigest()
            return self._built
