"""Shared by the corrupt-file tests (issue 18, kind 4: test_corrupt_checkpoints.py, test_corrupt_gguf.py,
test_corrupt_drafts.py, test_corrupt_cli.py): every loader turns a malformed file into one SpecstackError
naming the file and what is wrong, never a traceback; the command line answers it with exit 2 and one
error line; a damaged cache is rebuilt from the source.

Each file starts valid (the tiny models of tests/conftest.py, a GGUF written as llama.cpp does, a draft
pruned from the tiny Llama, a small trigram) and is then cut, overwritten with random bytes, flipped in
its header, or given a malformed config. Mutations use a fixed seed and a bounded count. Here: the
mutations, the two checks (`expect_error`, `error_or_load`) and the valid files more than one module
starts from.
"""
from __future__ import annotations

import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from unit.test_quant import _write_tiny_llama_gguf

from specstack.errors import SpecstackError
from specstack.models.loading import load_model

SEED = 18
FLIPS = 12  # header mutations per file


def blind_damage(data: bytes, header: int) -> list[tuple[str, bytes]]:
    """Files no reader may accept: empty, random bytes, cut inside the header, in the middle, one byte short."""
    rng = random.Random(SEED)
    return [("empty", b""), ("random", rng.randbytes(len(data))), ("random-short", rng.randbytes(64)),
            ("cut-4", data[:4]), ("cut-header", data[: header // 2]), ("cut-middle", data[: len(data) // 2]),
            ("cut-tail", data[:-64])]  # past any padding to an alignment (GGUF pads to 32 bytes)


def header_flips(data: bytes, header: int) -> list[tuple[str, bytes]]:
    """FLIPS copies with 1 to 3 random bytes of the header replaced: a reader may accept some (a flip in
    a name or a value), but must never fail other than with a SpecstackError."""
    rng = random.Random(SEED)
    out = []
    for i in range(FLIPS):
        b = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(header)] = rng.randrange(256)
        out.append((f"flip-{i}", bytes(b)))
    return out


def safetensors_header(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def expect_error(load: Callable[[], object], *names: str) -> str:
    """`load()` raises a SpecstackError whose one-line message names every one of `names`."""
    with pytest.raises(SpecstackError) as e:
        load()
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in names), msg
    return msg


def error_or_load(load: Callable[[], object], *names: str) -> None:
    """`load()` either succeeds or raises a SpecstackError naming `names`: nothing else escapes."""
    try:
        load()
    except SpecstackError as e:
        assert all(n in str(e) for n in names), str(e)


def load_fp32(path: Path, **kw) -> object:
    return load_model(str(path), dtype="fp32", use_cache=False, tokenizer=False, **kw)


def hf_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def with_byte_tokenizer(tiny_llama: Any, folder: Path) -> Path:
    """The tiny Llama with a tokenizer of its own (its 256 bytes, no merges, and an end token): enough
    for `specstack generate`, built in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab={**vocab, "</s>": len(vocab)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    path = hf_copy(tiny_llama.path, folder / "tiny")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(str(path))
    return path


def tiny_gguf(tiny_llama: Any, folder: Path) -> Path:
    """The tiny Llama as a GGUF, written as llama.cpp does."""
    path = folder / "tiny.gguf"
    _write_tiny_llama_gguf(tiny_llama.hf, path, tied=False)
    return path
