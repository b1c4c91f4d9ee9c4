"""Corrupt GGUF files (issue 18, kind 4; unit/corrupt.py holds the mutations and the checks): blind damage,
header flips, metadata missing or impossible, no metadata at all, and a safetensors file named .gguf."""
from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from unit.corrupt import blind_damage, error_or_load, expect_error, header_flips, load_fp32, tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf_file(tiny_llama, tmp_path_factory) -> Path:
    return tiny_gguf(tiny_llama, tmp_path_factory.mktemp("gguf"))


def _gguf_kv_end(path: Path) -> int:
    """Where the GGUF's tensor data starts: mutations before it hit the metadata or tensor infos."""
    import gguf

    return gguf.GGUFReader(path).data_offset


def _set_u32(data: bytes, key: str, value: int) -> bytes:
    """The GGUF with the uint32 metadata value of `key` replaced (keys are length-prefixed strings)."""
    k = key.encode()
    at = data.index(struct.pack("<Q", len(k)) + k) + 8 + len(k)
    assert struct.unpack("<I", data[at : at + 4])[0] == 4, "not a uint32 value"  # GGUFValueType.UINT32
    return data[: at + 4] + struct.pack("<I", value) + data[at + 8 :]


def test_damaged_gguf(tiny_gguf_file, tmp_path):
    data = tiny_gguf_file.read_bytes()
    header = _gguf_kv_end(tiny_gguf_file)
    for label, damaged in blind_damage(data, header):
        path = tmp_path / f"{label}.gguf"
        path.write_bytes(damaged)
        expect_error(lambda p=path: load_fp32(p), str(path))
    for label, damaged in header_flips(data, header):
        path = tmp_path / f"{label}.gguf"
        path.write_bytes(damaged)
        error_or_load(lambda p=path: load_fp32(p), str(path))


@pytest.mark.parametrize("change, phrase", [
    (lambda d: d.replace(b"general.architecture", b"general.architecturX"), "has no general.architecture"),
    (lambda d: d.replace(b"llama.embedding_length", b"llama.embedding_lengtX"), "llama.embedding_length is missing"),
    (lambda d: _set_u32(d, "llama.attention.head_count", 0), "llama.attention.head_count must be >= 1, got 0"),
    (lambda d: _set_u32(d, "llama.attention.head_count_kv", 3), "must be a multiple of llama.attention.head_count_kv"),
    (lambda d: _set_u32(d, "llama.block_count", 10**9), "describes 1000000000 layers, its weights hold 3"),
    (lambda d: _set_u32(d, "llama.embedding_length", 1 << 20), "weight embed has shape"),
    (lambda d: d.replace(b"blk.0.attn_q.weight", b"blk.X.attn_q.weight"), "tensor blk.X.attn_q.weight"),
], ids=["no-architecture", "no-width", "zero-heads", "kv-heads", "more-layers", "wider", "bad-name"])
def test_gguf_metadata(tiny_gguf_file, tmp_path, change, phrase):
    path = tmp_path / "m.gguf"
    path.write_bytes(change(tiny_gguf_file.read_bytes()))
    expect_error(lambda: load_fp32(path), str(path), phrase)


def test_gguf_without_any_metadata(tmp_path):
    import gguf

    path = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.kv_data[0].pop("general.architecture")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expect_error(lambda: load_fp32(path), str(path), "general.architecture")


def test_safetensors_named_gguf(tiny_llama, tmp_path):
    path = tmp_path / "weights.gguf"
    shutil.copy(tiny_llama.path / "model.safetensors", path)
    expect_error(lambda: load_fp32(path), str(path), "not a readable GGUF file")
