"""GetTokenizer's zip: the folder's tokenizer files, the same bytes every time."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import zipfile
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from services.frontend.tokenizer import TextTokenizer
from services.frontend.vllm_grpc.tokenizer_archive import (
    CHUNK_BYTES,
    TokenizerArchive,
    build_archive,
    chunks,
)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "tokenizer.json").write_text('{"model": {}}')
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)  # weights stay out
    return tmp_path


def names(data: bytes) -> list[str]:
    return zipfile.ZipFile(io.BytesIO(data)).namelist()


def test_the_tokenizer_files_and_nothing_else(folder: Path) -> None:
    assert names(build_archive(folder)) == [
        "chat_template.jinja", "config.json", "tokenizer.json", "tokenizer_config.json"]


def test_same_files_same_bytes_whatever_their_dates(folder: Path) -> None:
    first = build_archive(folder)
    os.utime(folder / "tokenizer.json", (1_000_000, 1_000_000))
    assert build_archive(folder) == first


def test_a_chat_template_flag_replaces_the_folders(folder: Path, tmp_path_factory:
                                                   pytest.TempPathFactory) -> None:
    template = tmp_path_factory.mktemp("t") / "mine.jinja"
    template.write_text("mine")
    archive = zipfile.ZipFile(io.BytesIO(build_archive(folder, template)))
    assert archive.read("chat_template.jinja") == b"mine"


def test_a_folder_without_a_tokenizer_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError):
        build_archive(tmp_path)


@pytest.mark.parametrize("size", [0, 1, CHUNK_BYTES, CHUNK_BYTES + 1, 3 * CHUNK_BYTES - 5])
def test_chunks_join_to_the_archive_and_the_last_carries_its_sha256(size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    sha = hashlib.sha256(data).hexdigest()
    pieces = list(chunks(data, sha))
    assert b"".join(p.data for p in pieces) == data
    assert all(len(p.data) <= CHUNK_BYTES for p in pieces)
    assert [p.sha256 for p in pieces] == [""] * (len(pieces) - 1) + [sha] * bool(pieces)


def test_the_archive_is_built_once(folder: Path) -> None:
    async def body() -> None:
        archive = TokenizerArchive(folder)
        first, second = await asyncio.gather(archive.get(), archive.get())
        assert first == second and first[1] == hashlib.sha256(first[0]).hexdigest()
        (folder / "tokenizer.json").write_text("changed")  # the folder is fixed for life
        assert await archive.get() == first

    asyncio.run(body())


def test_a_gguf_models_bundle_is_its_metadatas_tokenizer(smollm2_view: Path) -> None:
    # The view's files were written from the GGUF's metadata: what a router builds from
    # the bundle tokenizes as the frontend does, with the file's chat template.
    archive = zipfile.ZipFile(io.BytesIO(build_archive(smollm2_view)))
    assert {"tokenizer.json", "tokenizer_config.json", "config.json",
            "chat_template.jinja"} <= set(archive.namelist())
    rebuilt = Tokenizer.from_str(archive.read("tokenizer.json").decode())
    text = "Hello, GGUF tokenizers! 123"
    assert rebuilt.encode(text).ids == TextTokenizer.from_dir(smollm2_view).encode(text)
    assert b"im_start" in archive.read("chat_template.jinja")
