"""Fuzz the `specstack` command line (issue 18): malformed inputs for every command, each run in-process
through `specstack.cli.entry.main`, each checked against the error contract:

- the exit code is 0 or 2 (bench-ties may also answer 1, its documented "a divergence is no near-tie");
  130 never (no case sends a signal);
- on exit 2 the last line of stderr is the one `specstack: error: <message>` line;
- no exception escapes `main` (one that does is the traceback a user would see) and stderr holds no
  'Traceback';
- the case ends within its time bound;
- no file that existed before changes, except the outputs the case named and only on exit 0; a case
  that fails leaves nothing new behind, and one that succeeds writes only where it was told to.

A case is made from a seed and an index alone (`make_case`), so one failure reruns by itself:
`python benchmarks/fuzz_cli.py --seed S --case I`. Every case works on the tiny models of `Fixtures`
(a random Llama checkpoint with a 64-token context, a GGUF of its own, a draft, a trigram, a finished
bench run, ...) and copies of them in a workspace folder of its own, so nothing real is loaded and a
failing case cannot damage the next. tests/cli/test_fuzz.py runs a bounded number in CI;
benchmarks/fuzz_cli.py runs as many as asked.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ERROR_PREFIX = "specstack: error: "
CASE_SECONDS = 20.0  # the time bound of one case (every valid case here runs in about a second)
MEMORY_HEADROOM = 4 << 30  # address space a case may add: an unbounded allocation fails instead of swapping
TINY_CONTEXT = 64
COMMANDS = ("generate", "bench", "bench-forward", "bench-ties", "ngram train", "throughput",
            "throughput-calibrate", "throughput-check", "train-draft", "draft-acceptance")

# ---------------------------------------------------------------------------------------------------
# Bad values
# ---------------------------------------------------------------------------------------------------
# integers argparse takes (out of bounds, or odd spellings of small ones) and text it rejects
BAD_INTS = ("0", "-1", str(2**70), str(-2**70), "99999999999", str(2**63), "-0", " 3", "1_0", "\u0663")
NOT_INTS = ("1e400", "nan", "", "x", "1.5", "inf", "0x10")
BAD_FLOATS = ("0", "-1", "1e400", "nan", "inf", "-inf", "", "x", "1e-300", "5e-324", str(2**70), "-0", "1e308",
              "0x1p3", "1_0")
HUGE = ("65", "100", "10000", "100000", str(2**31), str(2**63), str(2**70))
METHOD_VALUES = ("0", "-1", "", "x", "nan", "1.5", " 2", "1e3", *HUGE)
ODD_STRINGS = ("", " ", ":", ",", ";", "=", "/", "::", ",,", "\udcff", "\u00e9", "a" * 300, "-", "--", "\t\n")
WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")


# ---------------------------------------------------------------------------------------------------
# The inputs cases start from
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fixtures:
    """Valid inputs, built once; cases copy and damage them. `cache` is SPECSTACK_CACHE for every case."""

    root: Path
    model: Path  # a tiny random Llama checkpoint (Hugging Face folder, the default model's tokenizer)
    gguf: Path  # a tiny Llama GGUF with a 260-token tokenizer of its own
    gguf_variants: tuple[Path, ...]  # the same GGUF, each missing or breaking one piece of metadata
    draft: Path  # a trained-draft file for `model`
    trigram: Path  # a Katz trigram over `model`'s vocabulary
    sequences: Path  # a `train-draft --sequences` file of `model`'s tokens (16 per sequence)
    prompts: Path  # a prompt JSONL
    corpus: Path  # a folder of small Python files
    run: Path  # a finished `specstack bench` run on `model` (ar, chain:k=2, ngram)
    hardware: Path  # a calibration file of `specstack throughput-calibrate`
    cache: Path

    def inputs(self) -> list[Path]:
        """What no case may change."""
        return [self.model, self.gguf, *self.gguf_variants, self.draft, self.trigram, self.sequences, self.prompts,
                self.corpus, self.run, self.hardware]


def build_tiny_checkpoint(path: Path, context: int = TINY_CONTEXT) -> Path:
    """A random Llama checkpoint with the default model's tokenizer (read from its GGUF, offline)."""
    from tiny_checkpoints import Tiny

    from specstack.models.loading import load_tokenizer
    from specstack.models.registry import DEFAULT_MODEL, resolve

    tok = load_tokenizer(resolve(DEFAULT_MODEL), None)
    Tiny("llama", 0, vocab=len(tok), hidden=64, layers=2, ff=128, max_pos=context, init=None, tie=True,
         bos=tok.bos_token_id, eos=tok.eos_token_id).save(path, tok)
    return path


FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


def fim_tokenizer() -> Any:
    """The default model's tokenizer with Qwen2.5-Coder's fill-in-the-middle tokens added (the default model
    has none): what a FIM checkpoint of the tests reads."""
    from specstack.models.loading import load_tokenizer
    from specstack.models.registry import DEFAULT_MODEL, resolve

    tok = load_tokenizer(resolve(DEFAULT_MODEL), None)
    tok.add_special_tokens({"additional_special_tokens": list(FIM_TOKENS)})
    return tok


def build_fim_checkpoint(path: Path, context: int = TINY_CONTEXT) -> Path:
    """A random Llama checkpoint whose tokenizer has Qwen2.5-Coder's FIM tokens (fim.py finds them)."""
    from tiny_checkpoints import Tiny

    tok = fim_tokenizer()
    Tiny("llama", 7, vocab=len(tok), hidden=64, layers=2, ff=128, max_pos=context, init=None, tie=True,
         bos=tok.bos_token_id, eos=tok.eos_token_id).save(path, tok)
    return path


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-character table: a byte-level BPE vocabulary with no merges."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    extra = iter(range(256, 512))
    return [chr(b if b in keep else next(extra)) for b in range(256)]


GGUF_KEYS = ("llama.block_count", "llama.context_length", "llama.embedding_length", "llama.feed_forward_length",
             "llama.attention.head_count", "llama.attention.head_count_kv", "llama.vocab_size",
             "llama.rope.dimension_count", "general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.tokens")


def write_tiny_gguf(path: Path, drop: str | None = None, override: tuple[str, Any] | None = None) -> Path:
    """A tiny llama GGUF (fp32 tensors, 2 blocks, d 64, context 64) with a byte-level tokenizer;
    `drop` leaves one metadata key out, `override` gives one key another value (and type)."""
    import gguf
    import numpy as np

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_symbols(), "\u0120t"]
    n_vocab, d, n_layers, heads, kv_heads, d_ff = len(tokens), 64, 2, 4, 2, 128
    meta: dict[str, Any] = {
        "general.architecture": "llama", "llama.block_count": n_layers, "llama.context_length": TINY_CONTEXT,
        "llama.embedding_length": d, "llama.feed_forward_length": d_ff, "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads, "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-6, "llama.vocab_size": n_vocab,
        "llama.rope.dimension_count": d // heads, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (n_vocab - 3),
        "tokenizer.ggml.merges": ["\u0120 t"], "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }
    if drop is not None:
        meta.pop(drop, None)
    if override is not None:
        meta[override[0]] = override[1]
    w = gguf.GGUFWriter(str(path), arch=str(meta.get("general.architecture", "llama")))
    w.kv_data[0].pop("general.architecture", None)  # written below with the others (or dropped)
    for key, value in meta.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str, list)):
            continue
        if isinstance(value, list):
            vtype = gguf.GGUFValueType.ARRAY
        elif isinstance(value, str):
            vtype = gguf.GGUFValueType.STRING
        elif isinstance(value, float):
            vtype = gguf.GGUFValueType.FLOAT32
        else:
            vtype = gguf.GGUFValueType.UINT32 if 0 <= value < 2**32 else gguf.GGUFValueType.INT64
        w.add_key_value(key, value, vtype)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    tensor("token_embd.weight", n_vocab, d)
    tensor("output_norm.weight", d)
    for i in range(n_layers):
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", d)
        tensor(p + "ffn_norm.weight", d)
        tensor(p + "attn_q.weight", d, d)
        tensor(p + "attn_k.weight", kv_heads * d // heads, d)
        tensor(p + "attn_v.weight", kv_heads * d // heads, d)
        tensor(p + "attn_output.weight", d, d)
        tensor(p + "ffn_gate.weight", d_ff, d)
        tensor(p + "ffn_up.weight", d_ff, d)
        tensor(p + "ffn_down.weight", d, d_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


GGUF_OVERRIDES: tuple[tuple[str, Any], ...] = (
    ("llama.attention.head_count", 0), ("llama.attention.head_count", "four"), ("llama.block_count", 0),
    ("llama.block_count", 9), ("llama.embedding_length", 65), ("llama.context_length", 0),
    ("llama.vocab_size", 7), ("llama.attention.head_count_kv", 3), ("general.architecture", "gpt2"),
    ("llama.feed_forward_length", 2**31), ("llama.rope.freq_base", float("nan")), ("tokenizer.ggml.model", "bert"),
    ("tokenizer.ggml.eos_token_id", 10**6), ("llama.context_length", 2**31),
)


def _corpus(root: Path) -> Path:
    root.mkdir()
    for i in range(6):
        (root / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i % 3}\n\n\nclass C{i}:\n"
                                       f"    def g(self, y):\n        return [y] * {i}\n", encoding="utf-8")
    return root


def _prompts(path: Path) -> Path:
    rows = [{"task_id": "a", "prompt": "def add(a, b):"}, {"task_id": "b", "prompt": "The sky is"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _trigram(model: Path, corpus: Path, path: Path) -> Path:
    from specstack.drafting.katz import KatzTrigram
    from specstack.models.loading import load_tokenizer
    from specstack.models.registry import resolve

    tok = load_tokenizer(resolve(str(model)), None)
    streams = [tok(f.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
               for f in sorted(corpus.glob("*.py"))]
    return KatzTrigram.train(streams, len(tok)).save(path)


def _draft(model: Path, path: Path) -> Path:
    from specstack.config import WindowSpec
    from specstack.models.draft_file import save_draft
    from specstack.models.loading import load_model
    from specstack.training.prune import build_draft

    target = load_model(str(model), dtype="fp32", tokenizer=False)
    save_draft(build_draft(target.model, n_layers=1, keep=(1,), window=WindowSpec(1, 16)), path,
               {"target": str(model)})
    return path


def _sequences(path: Path, vocab: int) -> Path:
    import torch

    from specstack.training.data import save_sequences

    g = torch.Generator().manual_seed(0)
    save_sequences(path, torch.randint(0, vocab, (4, 16), generator=g), torch.randint(0, vocab, (2, 16), generator=g),
                   {"data": "fuzz"})
    return path


def _cli(argv: Sequence[str]) -> None:
    """Run a command that must succeed (what builds a fixture)."""
    from specstack.cli.entry import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    if code != 0:
        raise RuntimeError(f"fixture command failed ({code}): {shlex.join(argv)}\n{err.getvalue()}")


def build_fixtures(root: Path, model: Path | None = None) -> Fixtures:
    """Every valid input, under `root`; `model`: a tiny checkpoint already built (else one is)."""
    root.mkdir(parents=True, exist_ok=True)
    cache = root / "cache"
    with _cache_env(cache):
        return _build_fixtures(root, cache, model or build_tiny_checkpoint(root / "tiny-llama"))


@contextmanager
def _cache_env(cache: Path) -> Iterator[None]:
    """SPECSTACK_CACHE=cache inside the block."""
    old = os.environ.get("SPECSTACK_CACHE")
    os.environ["SPECSTACK_CACHE"] = str(cache)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SPECSTACK_CACHE", None)
        else:
            os.environ["SPECSTACK_CACHE"] = old


def _build_fixtures(root: Path, cache: Path, model: Path) -> Fixtures:
    corpus = _corpus(root / "corpus")
    prompts = _prompts(root / "prompts.jsonl")
    tri = _trigram(model, corpus, root / "tiny-trigram.npz")
    draft = _draft(model, root / "tiny-draft.safetensors")
    seq = _sequences(root / "seq.safetensors", json.loads((model / "config.json").read_text())["vocab_size"])
    gguf_file = write_tiny_gguf(root / "tiny.gguf")
    variants = [write_tiny_gguf(root / f"tiny-no-{k.replace('.', '_')}.gguf", drop=k) for k in GGUF_KEYS]
    variants += [write_tiny_gguf(root / f"tiny-{k.replace('.', '_')}-{i}.gguf", override=(k, v))
                 for i, (k, v) in enumerate(GGUF_OVERRIDES)]
    run = root / "run"
    _cli(["bench", "--model", str(model), "--prompts", str(prompts), "--methods", "ar;chain:k=2;ngram",
          "--dtype", "fp32", "--draft", "self:1", "--draft-dtype", "fp32", "--ngram", str(tri),
          "--max-new-tokens", "4", "--out", str(run)])
    hardware = root / "calibration.json"
    _cli(["throughput-calibrate", "--model", str(model), "--dtype", "fp32", "--draft", "self:1", "--draft-dtype",
          "fp32", "--contexts", "8,24", "--tokens", "1,2", "--repeats", "1", "--warmup", "0", "--out", str(hardware)])
    for fmt in ("fp32", "bf16"):  # the converted-weights cache, so that cases on the fixtures load fast
        for m in (model, gguf_file):
            _cli(["generate", "--model", str(m), "--prompt", "hi", "--max-new-tokens", "1", "--dtype", fmt])
    fx = Fixtures(root, model, gguf_file, tuple(variants), draft, tri, seq, prompts, corpus, run, hardware, cache)
    (root / INDEX).write_text(json.dumps({k: [str(p) for p in v] if isinstance(v, tuple) else str(v)
                                          for k, v in vars(fx).items()}, indent=1))
    return fx


INDEX = "fixtures.json"  # written last: fixtures with it are complete


def fixtures_at(root: Path, model: Path | None = None) -> Fixtures:
    """The fixtures under `root`, built there first unless a complete set is already there."""
    if not (root / INDEX).is_file():
        return build_fixtures(root, model)
    saved = json.loads((root / INDEX).read_text())
    return Fixtures(**{k: tuple(map(Path, v)) if isinstance(v, list) else Path(v) for k, v in saved.items()})


# ---------------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Put:
    """One path a case creates in its workspace before it runs: bytes, or a copy of a fixture (file or
    folder), cut to its first `cut` bytes and with bytes XOR-ed at `flips`; or the removal of a path."""

    rel: str
    data: bytes | None = None
    source: Path | None = None
    cut: int | None = None
    flips: tuple[tuple[int, int], ...] = ()
    remove: bool = False
    folder: bool = False  # an empty folder

    def make(self, ws: Path) -> None:
        path = ws / self.rel
        if self.remove:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.folder:
            path.mkdir(exist_ok=True)
            return
        if self.source is not None and self.source.is_dir():
            shutil.copytree(self.source, path, dirs_exist_ok=True)
            return
        data = bytearray(self.data if self.data is not None else self.source.read_bytes())
        if self.cut is not None:
            del data[self.cut:]
        for offset, mask in self.flips:
            if offset < len(data):
                data[offset] ^= mask
        if path.exists() and path.is_dir():
            shutil.rmtree(path)
        path.write_bytes(bytes(data))

    def __str__(self) -> str:
        if self.remove:
            return f"{self.rel}: removed"
        if self.folder:
            return f"{self.rel}/: an empty folder"
        what = repr(self.data[:80]) + ("..." if len(self.data) > 80 else "") if self.data is not None else \
            f"a copy of {self.source.name}"
        if self.cut is not None:
            what += f" cut to {self.cut} bytes"
        if self.flips:
            what += f" with bytes flipped at {[o for o, _ in self.flips]}"
        return f"{self.rel}: {what}"


@dataclass(frozen=True)
class Case:
    seed: int
    index: int
    ws: str  # the case's own folder
    command: str
    argv: tuple[str, ...]
    puts: tuple[Put, ...]
    outputs: tuple[str, ...]  # paths the case was told to write (a folder: anything under it)
    note: str  # what is malformed
    codes: frozenset[int] = frozenset({0, 2})

    def line(self) -> str:
        return shlex.join(["specstack", *self.argv])


class Builder:
    """A command line under construction: a valid baseline, then malformations."""

    def __init__(self, rng: random.Random, fx: Fixtures, ws: Path, command: str) -> None:
        self.rng, self.fx, self.ws, self.command = rng, fx, ws, command
        self.positionals: list[str] = []
        self.options: list[tuple[str, str | tuple[str, ...] | None]] = []
        self.puts: list[Put] = []
        self.outputs: list[str] = []
        self.notes: list[str] = []
        self.codes = {0, 2}

    # the command line
    def opt(self, flag: str, value: str | tuple[str, ...] | None = None) -> None:
        """Set `flag` (replacing it where it was given)."""
        self.drop(flag)
        self.options.append((flag, value))

    def add(self, flag: str, value: str | None = None) -> None:
        """Give `flag` once more (a repeatable flag, or a duplicate)."""
        self.options.append((flag, value))

    def positional(self, i: int, value: str) -> None:
        self.positionals[i] = value

    def drop(self, flag: str) -> None:
        self.options = [(f, v) for f, v in self.options if f != flag]

    def get(self, flag: str) -> str | tuple[str, ...] | None:
        return next((v for f, v in self.options if f == flag), None)

    def argv(self) -> tuple[str, ...]:
        out = [*self.command.split(), *self.positionals]
        for flag, value in self.options:
            out += [flag, *([] if value is None else [value] if isinstance(value, str) else value)]
        return tuple(out)

    # the workspace
    def path(self, rel: str) -> str:
        return str(self.ws / rel)

    def put(self, rel: str, **kw: Any) -> str:
        self.puts.append(Put(rel, **kw))
        return self.path(rel)

    def output(self, path: str) -> str:
        self.outputs.append(path)
        return path

    def note(self, text: str) -> None:
        self.notes.append(text)

    def pick(self, items: Sequence[Any]) -> Any:
        return self.rng.choice(items)

    def name(self, stem: str) -> str:
        """A workspace name not used yet by this case."""
        used = {p.rel.split("/")[0] for p in self.puts}
        n = 0
        while f"{stem}{n}" in used:
            n += 1
        return f"{stem}{n}"


# ---------------------------------------------------------------------------------------------------
# Damaged bytes, JSON and files
# ---------------------------------------------------------------------------------------------------
def random_bytes(rng: random.Random) -> bytes:
    return rng.randbytes(rng.choice((0, 1, 3, 17, 64, 500)))


def damage_bytes(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """One blind damage to `data`."""
    n = len(data)
    kind = rng.choice(("cut", "flip", "insert", "delete", "garbage", "random", "invalid-utf8"))
    if kind == "cut" or n == 0:
        at = rng.randrange(n + 1) if n else 0
        return data[:at], f"cut to {at} of {n} bytes"
    if kind == "flip":
        b = bytearray(data)
        spots = sorted(rng.sample(range(n), min(n, rng.choice((1, 3, 20)))))
        for at in spots:
            b[at] ^= rng.randrange(1, 256)
        return bytes(b), f"{len(spots)} bytes flipped"
    if kind == "insert":
        at = rng.randrange(n + 1)
        return data[:at] + rng.randbytes(rng.choice((1, 9, 100))) + data[at:], f"random bytes inserted at {at}"
    if kind == "delete":
        at = rng.randrange(n)
        return data[:at] + data[at + rng.choice((1, 8, 64)):], f"bytes deleted at {at}"
    if kind == "garbage":
        return data + rng.randbytes(rng.choice((1, 50))), "random bytes appended"
    if kind == "invalid-utf8":
        at = rng.randrange(n + 1)
        return data[:at] + rng.choice((b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00")) + data[at:], \
            f"an invalid UTF-8 byte at {at}"
    return random_bytes(rng), "random bytes"


def bad_json_value(rng: random.Random) -> Any:
    return rng.choice((None, 0, -1, 1.5, 2**70, -2**70, float("nan"), float("inf"), "", "x", [], {}, [1, "a"],
                       True, "\udcff", 10**9))


def damage_json(rng: random.Random, doc: Any) -> tuple[Any, str]:
    """A value inside `doc` (a JSON document) replaced, removed, or the whole document replaced."""
    paths: list[tuple[Any, ...]] = []

    def walk(node: Any, at: tuple[Any, ...]) -> None:
        paths.append(at)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*at, k))
        elif isinstance(node, list):
            for i, v in enumerate(node[:5]):
                walk(v, (*at, i))

    walk(doc, ())
    at = rng.choice(paths)
    if not at or rng.random() < 0.1:
        return bad_json_value(rng), "the document replaced"
    doc = json.loads(json.dumps(doc))  # a copy
    parent = doc
    for k in at[:-1]:
        parent = parent[k]
    key = at[-1]
    if isinstance(parent, dict) and rng.random() < 0.3:
        del parent[key]
        return doc, f"{'.'.join(map(str, at))} removed"
    value = bad_json_value(rng)
    parent[key] = value
    return doc, f"{'.'.join(map(str, at))} = {value!r}"


def dumps(doc: Any) -> bytes:
    return json.dumps(doc, indent=1).encode("utf-8", "surrogatepass")


def damaged_json_file(b: Builder, source: Path, rel: str) -> str:
    """A copy of a JSON file, damaged blindly or in its structure."""
    data = source.read_bytes()
    if b.rng.random() < 0.6:
        doc, what = damage_json(b.rng, json.loads(data))
        data = dumps(doc)
    else:
        data, what = damage_bytes(b.rng, data)
    b.note(f"{source.name}: {what}")
    return b.put(rel, data=data)


def damaged_jsonl(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """One line of a JSONL file damaged (JSON or bytes), removed, repeated, or a line added."""
    lines = data.split(b"\n")
    i = rng.randrange(max(1, len([x for x in lines if x.strip()])))
    kind = rng.choice(("json", "json", "bytes", "repeat", "add", "empty-object", "blank"))
    if kind == "json":
        doc, what = damage_json(rng, json.loads(lines[i]))
        lines[i] = json.dumps(doc).encode("utf-8", "surrogatepass")
    elif kind == "bytes":
        lines[i], what = damage_bytes(rng, lines[i])
    elif kind == "repeat":
        lines.insert(i, lines[i])
        what = "repeated"
    elif kind == "add":
        lines.insert(i, rng.choice((b"{}", b"[]", b"null", b"1", b'"x"', b"{", random_bytes(rng))))
        what = f"{lines[i][:20]!r} inserted"
    elif kind == "empty-object":
        lines[i] = b"{}"
        what = "now {}"
    else:
        lines[i] = b""
        what = "blanked"
    return b"\n".join(lines), f"line {i + 1} {what}"


def input_file(b: Builder, valid: Path, damage: Callable[[Builder, Path, str], str], ext: str) -> str:
    """A path where a readable file of `valid`'s kind is expected: damaged, missing, a folder, empty, ..."""
    kind = b.pick(("damaged", "damaged", "damaged", "random", "empty", "missing", "folder", "dev-null"))
    rel = b.name("in") + ext
    if kind == "damaged":
        return damage(b, valid, rel)
    b.note(f"{valid.name} -> {kind}")
    if kind == "random":
        return b.put(rel, data=random_bytes(b.rng))
    if kind == "empty":
        return b.put(rel, data=b"")
    if kind == "missing":
        return b.path(rel)
    if kind == "folder":
        return b.put(rel, folder=True)
    return "/dev/null"


def damaged_copy(b: Builder, source: Path, rel: str) -> str:
    data, what = damage_bytes(b.rng, source.read_bytes())
    b.note(f"{source.name}: {what}")
    return b.put(rel, data=data)


def damaged_jsonl_copy(b: Builder, source: Path, rel: str) -> str:
    data, what = damaged_jsonl(b.rng, source.read_bytes())
    b.note(f"{source.name}: {what}")
    return b.put(rel, data=data)


def output_path(b: Builder, ext: str, folder: bool = False) -> str:
    """Where an output is to be written: fresh (valid), or a path that cannot take it."""
    kind = b.pick(("fresh", "missing-parent", "folder", "proc", "dev-full", "under-a-file", "existing", "empty",
                   "no-suffix" if not folder else "existing-file"))
    rel = b.name("out")
    if kind not in ("fresh",):
        b.note(f"output -> {kind}")
    if kind == "fresh":
        return b.output(b.path(rel + ext))
    if kind == "missing-parent":
        return b.output(b.path(f"no/such/{rel}{ext}"))
    if kind == "folder":
        return b.output(b.put(rel, folder=True)) if folder else b.put(rel, folder=True)
    if kind == "proc":
        return f"/proc/x{ext}"
    if kind == "dev-full":
        return "/dev/full"
    if kind == "under-a-file":
        b.put(rel, data=b"a file")
        return b.output(b.path(f"{rel}/x{ext}"))
    if kind == "existing":
        return b.output(b.put(rel + ext, data=b"old content\n"))
    if kind == "existing-file":  # a file where a folder is expected
        return b.put(rel, data=b"a file")
    if kind == "no-suffix":
        return b.output(b.path(rel))
    return ""  # the empty path


# ---------------------------------------------------------------------------------------------------
# Damaged fixtures
# ---------------------------------------------------------------------------------------------------
def _safetensors_parts(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def _safetensors_bytes(tensors: dict[str, Any], meta: dict[str, str]) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)


def model_folder(b: Builder) -> str:
    """A copy of the tiny checkpoint with one file damaged, removed or replaced."""
    rel = b.name("model")
    b.put(rel, source=b.fx.model)
    target = b.pick(("config.json", "config.json", "config.json", "model.safetensors", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"))
    kind = b.pick(("structure", "structure", "bytes", "remove", "random"))
    source = b.fx.model / target
    if kind == "remove":
        b.put(f"{rel}/{target}", remove=True)
        b.note(f"checkpoint: {target} removed")
    elif kind == "random":
        b.put(f"{rel}/{target}", data=random_bytes(b.rng))
        b.note(f"checkpoint: {target} = random bytes")
    elif kind == "structure" and target.endswith(".json"):
        damaged_json_file(b, source, f"{rel}/{target}")
    elif kind == "structure":
        import torch

        tensors, meta = _safetensors_parts(source)
        name = b.pick(sorted(tensors))
        how = b.pick(("drop", "shape", "dtype"))
        if how == "drop":
            del tensors[name]
        elif how == "shape":
            tensors[name] = tensors[name].flatten()[: max(1, tensors[name].numel() // 2)]
        else:
            tensors[name] = tensors[name].to(torch.int8)
        b.note(f"checkpoint: tensor {name} {how}")
        b.put(f"{rel}/{target}", data=_safetensors_bytes(tensors, meta))
    elif target == "model.safetensors":  # blind damage to 12 MB: a cut or flips in the header
        size = source.stat().st_size
        if b.rng.random() < 0.5:
            cut = b.rng.randrange(size)
            b.put(f"{rel}/{target}", source=source, cut=cut)
            b.note(f"checkpoint: model.safetensors cut to {cut} bytes")
        else:
            flips = tuple((b.rng.randrange(min(size, 400)), b.rng.randrange(1, 256)) for _ in range(b.rng.randint(1, 4)))
            b.put(f"{rel}/{target}", source=source, flips=flips)
            b.note("checkpoint: model.safetensors header bytes flipped")
    else:
        damaged_copy(b, source, f"{rel}/{target}")
    return b.path(rel)


def gguf_file(b: Builder) -> str:
    """The tiny GGUF missing or breaking metadata, cut, or with flipped bytes."""
    kind = b.pick(("variant", "variant", "cut", "flip"))
    if kind == "variant":
        v = b.pick(b.fx.gguf_variants)
        b.note(f"GGUF: {v.stem}")
        return str(v)
    size = b.fx.gguf.stat().st_size
    rel = b.name("m") + ".gguf"
    if kind == "cut":
        cut = b.rng.choice((0, 3, 4, 8, 24, b.rng.randrange(size)))
        b.note(f"GGUF cut to {cut} bytes")
        return b.put(rel, source=b.fx.gguf, cut=cut)
    flips = tuple((b.rng.randrange(min(size, 8000)), b.rng.randrange(1, 256)) for _ in range(b.rng.randint(1, 3)))
    b.note(f"GGUF: bytes flipped at {[o for o, _ in flips]}")
    return b.put(rel, source=b.fx.gguf, flips=flips)


def model_spec(b: Builder) -> str:
    """A --model / --target value that is not a loadable model."""
    kind = b.pick(("folder", "folder", "folder", "gguf", "gguf", "gguf-valid", "missing", "file", "empty-folder",
                   "name", "hub", "empty"))
    if kind == "folder":
        return model_folder(b)
    if kind == "gguf":
        return gguf_file(b)
    b.note(f"model -> {kind}")
    if kind == "gguf-valid":
        return str(b.fx.gguf)
    if kind == "missing":
        return b.path("no-model")
    if kind == "file":
        return b.put(b.name("f") + ".bin", data=random_bytes(b.rng))
    if kind == "empty-folder":
        return b.put(b.name("m"), folder=True)
    if kind == "hub":
        return b.pick(("org/model", "a/b/c", "~/nope"))
    if kind == "name":
        return b.pick(("smollm2-1.7b", "SMOLLM2-135M", "gpt2", "x.gguf"))
    return b.pick(("", " "))


def draft_file(b: Builder) -> str:
    """A copy of the tiny draft damaged blindly or in its tensors and metadata."""
    rel = b.name("d") + ".safetensors"
    if b.rng.random() < 0.4:
        return damaged_copy(b, b.fx.draft, rel)
    tensors, meta = _safetensors_parts(b.fx.draft)
    how = b.pick(("format", "config", "config", "drop", "vocab", "shape"))
    if how == "format":
        meta["format"] = b.pick(("", "specstack-sequences", "x"))
    elif how == "config":
        doc, what = damage_json(b.rng, json.loads(meta["config"]))
        meta["config"] = json.dumps(doc)
        how = f"config {what}"
    elif how == "drop":
        name = b.pick(sorted(tensors))
        del tensors[name]
        how = f"tensor {name} dropped"
    elif how == "vocab":
        import torch

        tensors["vocab_ids"] = torch.full_like(tensors["vocab_ids"], b.pick((-1, 10**6)))
        how = "vocab ids out of range"
    else:
        name = b.pick(sorted(tensors))
        tensors[name] = tensors[name].flatten()[:3]
        how = f"tensor {name} reshaped"
    b.note(f"draft file: {how}")
    return b.put(rel, data=_safetensors_bytes(tensors, meta))


def draft_spec(b: Builder) -> str:
    """A --draft value: a damaged file, a bad self:N / magicdec:W, a damaged model, ..."""
    kind = b.pick(("file", "file", "self", "magicdec", "model", "missing", "odd"))
    if kind == "file":
        return draft_file(b)
    if kind == "model":
        return model_spec(b)
    b.note(f"draft -> {kind}")
    if kind == "self":
        return "self:" + b.pick(("0", "-1", "3", "x", "", *HUGE))
    if kind == "magicdec":
        return "magicdec:" + b.pick(("0", "-1", "x", "", "1", *HUGE))
    if kind == "missing":
        return b.path("no-draft.safetensors")
    return b.pick(("default", "self", "magicdec", "self:1:2", ":", "", str(b.fx.trigram)))


def trigram_file(b: Builder) -> str:
    """A damaged copy of the tiny trigram (.npz): blind, an array missing or changed, or its meta."""
    import numpy as np

    rel = b.name("t") + ".npz"
    if b.rng.random() < 0.4:
        return damaged_copy(b, b.fx.trigram, rel)
    with np.load(b.fx.trigram, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    name = b.pick(sorted(arrays))
    how = b.pick(("drop", "meta", "shape", "dtype"))
    if how == "drop":
        del arrays[name]
    elif how == "meta":
        doc, what = damage_json(b.rng, json.loads(str(arrays["meta"])))
        arrays["meta"] = np.array(json.dumps(doc))
        name = f"meta {what}"
    elif how == "shape":
        arrays[name] = arrays[name].reshape(-1)[: max(0, arrays[name].size - 1)]
    else:
        arrays[name] = arrays[name].astype(np.float64) * 1.5
    b.note(f"trigram: {name} {how}")
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return b.put(rel, data=buf.getvalue())


def sequences_file(b: Builder) -> str:
    """A damaged copy of the sequences file: blind, ids out of the vocabulary, odd shapes or types."""
    import torch

    rel = b.name("s") + ".safetensors"
    if b.rng.random() < 0.3:
        return damaged_copy(b, b.fx.sequences, rel)
    tensors, meta = _safetensors_parts(b.fx.sequences)
    part = b.pick(("train", "heldout"))
    how = b.pick(("ids", "empty", "1-d", "float", "short", "drop", "format"))
    t = tensors[part]
    if how == "ids":
        t = t.to(torch.int32)
        t[0, 3] = b.pick((60000, -5, 2**31 - 1))
    elif how == "empty":
        t = t[:0]
    elif how == "1-d":
        t = t.flatten()
    elif how == "float":
        t = t.float() + 0.5
    elif how == "short":
        t = t[:, :1]
    elif how == "format":
        meta["format"] = "specstack-spire-draft"
    if how == "drop":
        del tensors[part]
    else:
        tensors[part] = t
    b.note(f"sequences: {part} {how}")
    return b.put(rel, data=_safetensors_bytes(tensors, meta))


def run_folder(b: Builder, positional: bool = False) -> str:
    """A copy of the finished bench run with one of its files damaged, removed or replaced."""
    rel = b.name("run")
    b.put(rel, source=b.fx.run)
    target = b.pick(("results.jsonl", "results.jsonl", "results.jsonl", "run.json", "run.json", "summary.json"))
    kind = b.pick(("damage", "damage", "damage", "remove", "random", "identical"))
    if kind == "identical" and target == "results.jsonl":  # make bench-ties recheck a row
        lines = (b.fx.run / target).read_text().splitlines()
        i = b.rng.randrange(len(lines))
        row = json.loads(lines[i])
        row["identical_to_ar"] = False
        if b.rng.random() < 0.5:
            row[b.pick(sorted(row))] = bad_json_value(b.rng)
        lines[i] = json.dumps(row)
        b.note(f"run: results.jsonl line {i + 1} not identical to ar")
        b.put(f"{rel}/{target}", data=("\n".join(lines) + "\n").encode("utf-8", "surrogatepass"))
    elif kind == "remove":
        b.put(f"{rel}/{target}", remove=True)
        b.note(f"run: {target} removed")
    elif kind == "random":
        b.put(f"{rel}/{target}", data=random_bytes(b.rng))
        b.note(f"run: {target} = random bytes")
    elif target == "results.jsonl":
        damaged_jsonl_copy(b, b.fx.run / target, f"{rel}/{target}")
    else:
        damaged_json_file(b, b.fx.run / target, f"{rel}/{target}")
    return b.path(rel)


def prompts_file(b: Builder) -> str:
    """A prompt JSONL damaged, or with a prompt longer than the tiny context, or not a file."""
    def damage(b: Builder, source: Path, rel: str) -> str:
        if b.rng.random() < 0.25:
            b.note("prompts: a prompt longer than the context")
            row = {"task_id": "long", "prompt": "hello world " * 100}
            return b.put(rel, data=source.read_bytes() + json.dumps(row).encode() + b"\n")
        return damaged_jsonl_copy(b, source, rel)

    if b.rng.random() < 0.1:
        b.note("prompts -> a set name")
        return b.pick(("humaneval:3", "HumanEval", "sharegpt.jsonl", "", "-"))
    return input_file(b, b.fx.prompts, damage, ".jsonl")


# ---------------------------------------------------------------------------------------------------
# Method strings and other small languages
# ---------------------------------------------------------------------------------------------------
def _engine_params() -> dict[str, list[str]]:
    from specstack.engine.methods import METHODS

    return {name: [p.name for p in m.params] for name, m in METHODS.items()}


def method_text(rng: random.Random, peers: bool = False) -> str:
    """A method string with odd names, values, separators and duplicates."""
    params = _engine_params()
    names = [*params, "medusa", "CHAIN", "", " chain", "tree "] + (["hf", "hf-pld", "llamacpp", "hf-assisted"] if peers else [])
    name = rng.choice(names)
    keys = params.get(name.strip(), []) or ["k"]
    items = []
    for _ in range(rng.choice((0, 1, 1, 2, 3))):
        key = rng.choice([*keys, *keys, "kk", "", "dtype" if peers else "K", "tokens"])
        value = rng.choice([*METHOD_VALUES, "1", "2", "3"]) if key != "dtype" else rng.choice(("fp16", "", "int4"))
        form = rng.choice(("{k}={v}", "{k}={v}", "{k}={v}", "{k}", "{k}=={v}", "={v}", "{k}={v}={v}", "{k}:{v}"))
        items.append(form.format(k=key, v=value))
    sep = rng.choice((",", ",", ",,", ", ", ":"))
    text = name + (":" + sep.join(items) if items or rng.random() < 0.2 else "")
    return rng.choice(("{}", "{}", "{}", "{}", "{}:", ":{}", "{},", "{}::k=2")).format(text)


def method_list(rng: random.Random) -> str:
    parts = [method_text(rng, peers=True) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        parts.append(parts[0])  # listed twice
    return rng.choice((";", ";", "; ", ";;", ",")).join(parts)


def int_list_text(rng: random.Random, valid: Sequence[int]) -> str:
    items = [str(v) for v in rng.sample(list(valid), rng.randint(1, len(valid)))]
    items.insert(rng.randrange(len(items) + 1), rng.choice(BAD_INTS + HUGE + NOT_INTS))
    return rng.choice((",", ",", ", ", ",,", ";")).join(items)


def shape_text(rng: random.Random) -> str:
    """A throughput model description with one bad value (or a missing or unknown key)."""
    keys = {"layers": "8", "d_model": "512", "kv_heads": "8", "head_dim": "64", "d_ff": "2048", "heads": "8",
            "vocab": "32000"}
    key = rng.choice(sorted(keys))
    kind = rng.choice(("value", "value", "drop", "unknown", "dup"))
    if kind == "value":
        keys[key] = rng.choice(BAD_INTS + HUGE + NOT_INTS)
    elif kind == "drop":
        del keys[key]
    elif kind == "unknown":
        keys["wings"] = "2"
    text = ",".join(f"{k}={v}" for k, v in keys.items())
    return text + (f",{key}=3" if kind == "dup" else "")


def tau_text(rng: random.Random) -> str:
    value = lambda: rng.choice((*BAD_FLOATS, "1", "2.5", "5", "auto"))  # noqa: E731
    return rng.choice((value(), f"vanilla={value()},spire={value()}", f"spire={value()},spire=2", f"={value()}",
                       f"magicdec:{value()}", f"auto,{rng.choice(('spire', 'x', ''))}={value()}", "auto,auto",
                       f"vanilla={value()};magicdec=2"))


def data_spec(b: Builder) -> str:
    """A train-draft --data value with odd sources, folders and weights."""
    w = lambda: b.pick((*BAD_FLOATS, "1", "0.5"))  # noqa: E731
    corpus = str(b.fx.corpus)
    return b.pick((
        lambda: f"code={corpus}:{w()}", lambda: f"code={corpus}:1,code={corpus}:1", lambda: f"code={b.path('nope')}:1",
        lambda: "code=/dev/null:1", lambda: f"sharegpt={b.fx.prompts}:1", lambda: f"code={corpus}",
        lambda: f"code={corpus}:1:2", lambda: f"code={corpus}:1,", lambda: b.pick((":", "", ",", "code=:1")),
        lambda: f"sharegpt={b.put(b.name('sg'), data=random_bytes(b.rng))}:1",
        lambda: f"code={b.put(b.name('c'), folder=True)}:1"))()


def odd_choice(b: Builder, flag: str) -> None:
    b.opt(flag, b.pick(("fp16", "FP32", "", "int3", "cuda:0", "tpu", "x")))
    b.note(f"{flag} odd")


def bad_int(b: Builder, flags: Sequence[str]) -> None:
    """One of `flags` set to a bad integer: mostly one argparse takes, so that the command's own checks
    are reached."""
    flag = b.pick(flags)
    value = b.pick(NOT_INTS if b.rng.random() < 0.25 else BAD_INTS + HUGE)
    b.opt(flag, value)
    b.note(f"{flag} {value!r}")


def bad_float(b: Builder, flags: Sequence[str]) -> None:
    flag = b.pick(flags)
    value = b.pick(BAD_FLOATS)
    b.opt(flag, value)
    b.note(f"{flag} {value!r}")


# ---------------------------------------------------------------------------------------------------
# One generator per command: a valid baseline on the tiny fixtures, then one or two malformations
# ---------------------------------------------------------------------------------------------------
Menu = Sequence[tuple[int, Callable[[Builder], None]]]


def apply(b: Builder, menu: Menu) -> None:
    """Zero (rarely: the valid baseline), one or two different malformations drawn from `menu`."""
    left = list(menu)
    for _ in range(b.rng.choices((0, 1, 2), weights=(1, 14, 5))[0]):
        entry = b.rng.choices(left, weights=[w for w, _ in left])[0]
        left.remove(entry)
        entry[1](b)
    if not b.notes:
        b.note("valid baseline")


def _method(b: Builder) -> None:
    text = method_text(b.rng)
    b.opt("--method", text)
    b.note(f"--method {text!r}")
    if b.rng.random() < 0.7:
        b.opt("--ngram", str(b.fx.trigram))
    if b.rng.random() < 0.5:
        b.opt("--draft", b.pick(("self:1", str(b.fx.draft), "magicdec:8")))


def _prompt_file(b: Builder) -> None:
    b.drop("--prompt")
    b.opt("--prompt-file", input_file(b, b.fx.corpus / "m1.py", damaged_copy, ".txt"))


def _prompt_text(b: Builder) -> None:
    text = b.pick(("", " \n", "\udcff\udcfe", "x" * 5000, "\x1b[31m", "<|im_end|>", "\u202e", "hello " * 70))
    b.opt("--prompt", text)
    b.note(f"--prompt {text[:20]!r}")


def _sampling(b: Builder) -> None:
    """Sampling on, with a bad top-p, top-k or seed."""
    b.opt("--temperature", b.pick(("0.7", "1e308", "5e-324")))
    bad_float(b, ["--top-p"]) if b.rng.random() < 0.5 else bad_int(b, ["--top-k", "--seed"])


def gen_generate(b: Builder) -> None:
    b.opt("--model", str(b.fx.model))
    b.opt("--prompt", "def add(a, b):")
    b.opt("--max-new-tokens", "3")
    b.opt("--dtype", "fp32")
    apply(b, (
        (3, lambda b: bad_int(b, ["--max-new-tokens", "--top-k", "--seed", "--threads"])),
        (2, lambda b: bad_float(b, ["--temperature", "--top-p"])),
        (2, _sampling),
        (5, _method),
        (4, lambda b: b.opt("--model", model_spec(b))),
        (3, lambda b: (b.opt("--method", b.pick(("chain:k=2", "tree:budget=4,depth=2"))), b.opt("--draft", draft_spec(b)))),
        (2, lambda b: (b.opt("--method", b.pick(("ngram", "staged:budget=4,depth=2"))), b.opt("--ngram", trigram_file(b)))),
        (2, _prompt_file),
        (1, _prompt_text),
        (2, lambda b: b.opt("--html", output_path(b, ".html"))),
        (1, lambda b: odd_choice(b, b.pick(("--dtype", "--device", "--draft-dtype")))),
        (1, lambda b: (b.add("--stop", b.pick(ODD_STRINGS)), b.note("--stop odd"))),
        (1, lambda b: (b.opt("--chat"), b.opt("--show-origins"), b.note("--chat --show-origins"))),
    ))


def _bench_read(b: Builder) -> None:
    """--compare, --ratios or --phases on damaged runs."""
    for flag in ("--out", "--prompts", "--methods"):
        b.drop(flag)
    mode = b.pick(("--compare", "--ratios", "--phases"))
    b.note(mode)
    if mode == "--compare":
        other = b.pick((lambda: str(b.fx.run), lambda: b.path("missing"), lambda: run_folder(b)))
        b.opt(mode, (run_folder(b), other()))
    elif mode == "--ratios":
        pairs = b.pick(("chain:k=2/ar", "ar/ar", "x/y", "ar", "/", "ar/", "chain:k=2/ar/ngram", "ngram/chain:k=2",
                        "ar/hf"))
        b.opt(mode, (run_folder(b), pairs))
        b.note(f"pairs {pairs!r}")
    else:
        b.opt(mode, run_folder(b))


def _bench_resume(b: Builder) -> None:
    """--resume on a damaged copy of the fixture run, with its settings."""
    b.note("--resume")
    b.opt("--out", b.output(run_folder(b)))
    b.opt("--resume")
    b.opt("--methods", "ar;chain:k=2;ngram")
    b.opt("--ngram", str(b.fx.trigram))
    b.opt("--max-new-tokens", "4")
    b.opt("--draft-dtype", "fp32")


def gen_bench(b: Builder) -> None:
    b.opt("--model", str(b.fx.model))
    b.opt("--prompts", str(b.fx.prompts))
    b.opt("--methods", "ar;chain:k=2")
    b.opt("--dtype", "fp32")
    b.opt("--draft", "self:1")
    b.opt("--max-new-tokens", "3")
    b.opt("--limit", "1")
    b.opt("--out", b.output(b.path("bench")))
    apply(b, (
        (3, lambda b: bad_int(b, ["--limit", "--repeats", "--max-new-tokens", "--top-k", "--seed", "--threads"])),
        (1, lambda b: bad_float(b, ["--temperature", "--top-p"])),
        (4, lambda b: (b.opt("--methods", method_list(b.rng)), b.opt("--ngram", str(b.fx.trigram)),
                       b.note(f"--methods {b.get('--methods')!r}"))),
        (2, lambda b: b.opt("--model", model_spec(b))),
        (3, lambda b: b.opt("--prompts", prompts_file(b))),
        (2, lambda b: b.opt("--out", output_path(b, "", folder=True))),
        (4, _bench_read),
        (3, _bench_resume),
        (1, lambda b: b.opt("--draft", draft_spec(b))),
        (1, lambda b: (b.opt("--methods", "ar;ngram"), b.opt("--ngram", trigram_file(b)))),
    ))


def gen_bench_forward(b: Builder) -> None:
    b.opt("--model", str(b.fx.model))
    for flag, value in (("--formats", "fp32"), ("--tokens", "1,2"), ("--context", "8"), ("--repeats", "1"),
                        ("--warmup", "0"), ("--prompts", "0"), ("--new-tokens", "2"), ("--threads", "1")):
        b.opt(flag, value)
    b.opt("--skip-hf")
    b.opt("--out", b.output(b.path("forward.json")))
    b.output(b.path("bench_out"))  # the default --out, under the working folder
    apply(b, (
        (5, lambda b: bad_int(b, ["--context", "--repeats", "--warmup", "--prompts", "--new-tokens", "--threads"])),
        (2, lambda b: (b.opt("--tokens", int_list_text(b.rng, (1, 2, 4))), b.note(f"--tokens {b.get('--tokens')!r}"))),
        (1, lambda b: (b.opt("--formats", b.pick(("fp16", "int4,,", "", ",", "fp32,fp32,bf16"))), b.note("--formats"))),
        (1, lambda b: (b.drop("--skip-hf"), b.opt("--hf-dtypes", b.pick(("fp16", "", ",", "bf16,bf16", "int4"))),
                       b.note("--hf-dtypes"))),
        (3, lambda b: b.opt("--model", model_spec(b))),
        (2, lambda b: b.opt("--out", output_path(b, ".json"))),
        (1, lambda b: (b.drop("--out"), b.note("default --out"))),
    ))


def gen_bench_ties(b: Builder) -> None:
    b.positionals.append(str(b.fx.run))
    b.opt("--threads", "1")
    b.codes = {0, 1, 2}  # 1: a divergence that is no near-tie (documented)

    def dir_kind(b: Builder) -> None:
        kind = b.pick(("missing", "file", "empty", "proc"))
        b.positional(0, {"missing": lambda: b.path("nope"), "file": lambda: b.put("f", data=b"x"),
                            "empty": lambda: b.put("e", folder=True), "proc": lambda: "/proc/self"}[kind]())
        b.note(f"DIR -> {kind}")

    apply(b, (
        (8, lambda b: b.positional(0, run_folder(b))),
        (2, dir_kind),
        (1, lambda b: bad_int(b, ["--threads"])),
    ))


def gen_ngram_train(b: Builder) -> None:
    b.opt("--model", str(b.fx.model))
    b.opt("--corpus", str(b.fx.corpus))
    b.opt("--out", b.output(b.path("tri.npz")))
    b.opt("--max-files", "3")

    def corpus(b: Builder) -> None:
        kind = b.pick(("bytes", "bytes", "empty", "missing", "dev-null", "file-bytes"))
        if kind == "bytes":
            rel = b.name("corpus")
            for i in range(3):
                b.put(f"{rel}/x{i}.py", data=damage_bytes(b.rng, (b.fx.corpus / "m1.py").read_bytes())[0])
            b.opt("--corpus", b.path(rel))
        elif kind == "empty":
            b.opt("--corpus", b.put(b.name("corpus"), folder=True))
        elif kind == "missing":
            b.opt("--corpus", b.path("none"))
        elif kind == "dev-null":
            b.opt("--corpus", "/dev/null")
        else:
            b.opt("--corpus", b.put(b.name("c") + ".py", data=random_bytes(b.rng)))
        b.note(f"corpus -> {kind}")

    apply(b, (
        (4, lambda b: bad_int(b, ["--k", "--min-count", "--min-count-bigram", "--max-files"])),
        (3, corpus),
        (2, lambda b: b.opt("--model", model_spec(b))),
        (3, lambda b: b.opt("--out", output_path(b, ".npz"))),
        (1, lambda b: (b.add("--ext", b.pick(ODD_STRINGS)), b.add("--exclude-dir", b.pick(ODD_STRINGS)),
                       b.note("--ext/--exclude-dir odd"))),
    ))


def gen_throughput(b: Builder) -> None:
    tiny = b.rng.random() < 0.3
    b.opt("--target", str(b.fx.model) if tiny else "spire-67m")
    if tiny:
        b.opt("--draft", "self:1")
    b.opt("--tau", "2")
    b.opt("--batch", "1,8")
    b.opt("--context", "512")
    b.opt("--plot", b.output(b.path("p.png")))
    b.output(b.path("throughput.png"))  # the default --plot, in the working folder

    def auto(b: Builder) -> None:
        b.opt("--target", str(b.fx.model))
        b.opt("--draft", "self:1")
        b.opt("--tau", "auto")
        b.opt("--k", "2")
        b.opt("--limit", "1")
        b.opt("--max-new-tokens", "3")
        b.opt("--engine-dtype", "fp32")
        b.opt("--prompts", str(b.fx.prompts))
        b.note("--tau auto")
        b.rng.choice((lambda: b.opt("--prompts", prompts_file(b)),
                      lambda: bad_int(b, ["--limit", "--max-new-tokens", "--threads", "--k"]),
                      lambda: b.opt("--target", model_spec(b)), lambda: b.opt("--draft", draft_spec(b))))()

    apply(b, (
        (3, lambda b: bad_int(b, ["--k", "--spire-layers", "--sparse-window"])),
        (2, lambda b: (b.opt(f := b.pick(("--batch", "--context")), int_list_text(b.rng, (1, 8, 512))),
                       b.note(f"{f} {b.get(f)!r}"))),
        (4, lambda b: (b.opt("--tau", tau_text(b.rng)), b.note(f"--tau {b.get('--tau')!r}"))),
        (3, lambda b: (b.opt(f := b.pick(("--target", "--draft")), shape_text(b.rng)), b.note(f"{f} {b.get(f)!r}"))),
        (2, lambda b: b.opt(b.pick(("--target", "--draft")), model_spec(b))),
        (2, lambda b: b.opt("--hardware", input_file(b, b.fx.hardware, damaged_json_file, ".json")
                            if b.rng.random() < 0.8 else b.pick(("", "local", "h100", "H100-FP8")))),
        (3, lambda b: b.opt(b.pick(("--plot", "--json")), output_path(b, b.pick((".png", ".json"))))),
        (1, lambda b: (b.drop("--plot"), b.note("default --plot"))),
        (1, lambda b: (b.opt("--designs", b.pick(("", ",", "spire,spire", "eagle"))), b.note("--designs"))),
        (2, auto),
        (1, lambda b: odd_choice(b, b.pick(("--dtype", "--draft-dtype", "--conventions")))),
    ))


def gen_throughput_calibrate(b: Builder) -> None:
    for flag, value in (("--model", str(b.fx.model)), ("--dtype", "fp32"), ("--draft", "self:1"),
                        ("--draft-dtype", "fp32"), ("--contexts", "8"), ("--tokens", "1,2"), ("--repeats", "1"),
                        ("--warmup", "0"), ("--threads", "1")):
        b.opt(flag, value)
    b.opt("--out", b.output(b.path("cal.json")))
    apply(b, (
        (3, lambda b: bad_int(b, ["--repeats", "--warmup", "--threads"])),
        (3, lambda b: (b.opt(f := b.pick(("--contexts", "--tokens")), int_list_text(b.rng, (1, 8, 16))),
                       b.note(f"{f} {b.get(f)!r}"))),
        (3, lambda b: b.opt("--model", model_spec(b))),
        (2, lambda b: b.opt("--draft", draft_spec(b))),
        (2, lambda b: b.opt("--out", output_path(b, ".json"))),
    ))


def gen_throughput_check(b: Builder) -> None:
    b.positionals.append(str(b.fx.run))
    b.opt("--hardware", "h100-fp8")
    apply(b, (
        (6, lambda b: b.positional(0, run_folder(b))),
        (2, lambda b: b.opt("--hardware", input_file(b, b.fx.hardware, damaged_json_file, ".json"))),
        (2, lambda b: bad_int(b, ["--context"])),
        (1, lambda b: odd_choice(b, "--conventions")),
    ))


def gen_train_draft(b: Builder) -> None:
    b.opt("--target", str(b.fx.model))
    if b.rng.random() < 0.7:
        b.opt("--sequences", str(b.fx.sequences))
    else:
        b.opt("--data", f"code={b.fx.corpus}:1")
    for flag, value in (("--seq-len", "16"), ("--train-sequences", "2"), ("--heldout-sequences", "1"),
                        ("--steps", "1"), ("--vocab", "64"), ("--layers", "1"), ("--batch-size", "1"),
                        ("--eval-every", "1"), ("--device", "cpu"), ("--threads", "1")):
        b.opt(flag, value)
    b.opt("--out", b.output(b.path("train")))

    def sequences(b: Builder) -> None:
        kind = b.pick(("damaged", "damaged", "new", "folder"))
        if kind == "damaged":
            b.opt("--sequences", sequences_file(b))
        elif kind == "new":  # written from --data
            b.opt("--sequences", b.output(b.path("new-seq.safetensors")))
            b.opt("--data", data_spec(b))
            b.note(f"--data {b.get('--data')!r}")
            if b.rng.random() < 0.5:
                b.opt("--prepare-only")
        else:
            b.opt("--sequences", b.put(b.name("s"), folder=True))
            b.note("--sequences a folder")

    def teacher(b: Builder) -> None:
        kind = b.pick(("file", "proc", "empty"))
        value = {"file": lambda: b.put("teacher-file", data=b"x"), "proc": lambda: "/proc/teacher",
                 "empty": lambda: b.output(b.put(b.name("teacher"), folder=True))}[kind]()
        b.opt("--teacher", value)
        b.note(f"--teacher -> {kind}")

    apply(b, (
        (5, lambda b: bad_int(b, ["--steps", "--train-sequences", "--heldout-sequences", "--seq-len", "--layers",
                                     "--vocab", "--window", "--batch-size", "--accumulate", "--draft-steps",
                                     "--eval-every", "--threads"])),
        (3, lambda b: bad_float(b, ["--omega", "--lr"])),
        (2, lambda b: (b.drop("--sequences"), b.opt("--data", data_spec(b)), b.note(f"--data {b.get('--data')!r}"))),
        (3, sequences),
        (2, lambda b: (b.opt("--contexts", int_list_text(b.rng, (8, 16))), b.note(f"--contexts {b.get('--contexts')!r}"))),
        (2, lambda b: b.opt("--target", model_spec(b))),
        (2, lambda b: b.opt("--out", output_path(b, "", folder=True))),
        (1, teacher),
        (1, lambda b: (b.opt("--resume"), b.note("--resume without a checkpoint"))),
        (1, lambda b: (b.opt("--recipe", "vanilla"), b.opt(b.pick(("--feature-input", "--no-target-acts",
                                                                   "--pruned-init"))), b.note("recipe flags"))),
    ))


def gen_draft_acceptance(b: Builder) -> None:
    b.positionals += [str(b.fx.draft), "magicdec:4"]
    for flag, value in (("--target", str(b.fx.model)), ("--sequences", str(b.fx.sequences)),
                        ("--heldout-sequences", "1"), ("--k", "2"), ("--contexts", "8,16"), ("--device", "cpu")):
        b.opt(flag, value)

    def design(b: Builder) -> None:
        b.positional(b.rng.randrange(len(b.positionals)), draft_spec(b))

    apply(b, (
        (2, lambda b: bad_int(b, ["--k", "--heldout-sequences"])),
        (2, lambda b: (b.opt("--contexts", int_list_text(b.rng, (8, 16))), b.note(f"--contexts {b.get('--contexts')!r}"))),
        (4, design),
        (3, lambda b: b.opt("--sequences", sequences_file(b))),
        (2, lambda b: b.opt("--target", model_spec(b))),
        (2, lambda b: b.opt("--json", output_path(b, ".json"))),
    ))


GENERATORS: dict[str, Callable[[Builder], None]] = {
    "generate": gen_generate, "bench": gen_bench, "bench-forward": gen_bench_forward, "bench-ties": gen_bench_ties,
    "ngram train": gen_ngram_train, "throughput": gen_throughput, "throughput-calibrate": gen_throughput_calibrate,
    "throughput-check": gen_throughput_check, "train-draft": gen_train_draft, "draft-acceptance": gen_draft_acceptance,
}


def make_case(seed: int, index: int, fx: Fixtures, ws: Path) -> Case:
    """Case `index` of the run with `seed`: the commands take turns, everything else is drawn."""
    rng = random.Random(f"{seed}:{index}")
    command = COMMANDS[(index + seed) % len(COMMANDS)]
    b = Builder(rng, fx, ws, command)
    GENERATORS[command](b)
    return Case(seed, index, str(ws), command, b.argv(), tuple(b.puts), tuple(b.outputs), "; ".join(b.notes),
                frozenset(b.codes))


# ---------------------------------------------------------------------------------------------------
# Running a case
# ---------------------------------------------------------------------------------------------------
class Stop(BaseException):
    """Raised into a case by the harness (a BaseException: `except Exception` in the code under test
    lets it through). kind: the failure it stands for."""

    kind = "harness stop"


class CaseTimeout(Stop):
    kind = "hang"


class TooManyThreads(Stop):
    """torch.set_num_threads(N) above THREADS_CAP: a process may not survive it (100000 threads
    segfault Python here), and in-process that would end the whole fuzz run."""

    kind = "unbounded thread count"


THREADS_CAP = 512  # the most --threads specstack accepts (validate.MAX_THREADS)


@dataclass
class Outcome:
    code: int | None  # None: main did not return
    out: str
    err: str
    seconds: float
    escaped: str | None = None  # the exception that escaped main: "Type at file:line in function"
    message: str = ""  # its message
    stopped: str | None = None  # the Stop kind that ended the case


def describe(e: BaseException) -> tuple[str, str]:
    """(type and the innermost specstack frame, the message) of an exception."""
    frames = traceback.extract_tb(e.__traceback__)
    own = [f for f in frames if f"{os.sep}specstack{os.sep}" in f.filename]
    where = own[-1] if own else (frames[-1] if frames else None)
    at = ""
    if where is not None:
        name = where.filename
        at = f" at {name[name.rfind(os.sep + 'specstack' + os.sep) + 1:] if own else name}:{where.lineno} in {where.name}"
    return f"{type(e).__name__}{at}", " ".join(str(e).split())[:300]


def _stream(errors: str) -> io.TextIOWrapper:
    """A captured stdout/stderr that encodes as the real ones do (UTF-8; stdout strict, stderr
    backslashreplace), with a .buffer."""
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors=errors, write_through=True)


def _text(stream: io.TextIOWrapper) -> str:
    stream.flush()
    return stream.buffer.getvalue().decode("utf-8", "backslashreplace")


@contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """Raise CaseTimeout into the block after `seconds` (main thread only; elsewhere the time is only
    measured)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_sig: int, _frame: Any) -> None:
        raise CaseTimeout(f"no answer within {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextmanager
def _process_state(argv: Sequence[str], ws: Path, cache: Path) -> Iterator[None]:
    """What a case may change in this process, restored after it: the working folder, sys.argv, the
    environment's cache, torch's thread count (one to start with; guarded), the SIGINT handler,
    warning filters."""
    import warnings

    import torch

    cwd, sys_argv = os.getcwd(), sys.argv
    sigint = signal.getsignal(signal.SIGINT)
    real_set, threads = torch.set_num_threads, torch.get_num_threads()

    def set_num_threads(n: int) -> None:
        if isinstance(n, int) and n > THREADS_CAP:
            raise TooManyThreads(f"torch.set_num_threads({n})")
        real_set(n)

    os.chdir(ws)
    sys.argv = ["specstack", *argv]
    real_set(1)  # tiny models: one thread is as fast, and kinder to a shared machine
    torch.set_num_threads = set_num_threads
    try:
        with warnings.catch_warnings(), _cache_env(cache):
            yield
    finally:
        torch.set_num_threads = real_set
        real_set(threads)
        signal.signal(signal.SIGINT, sigint)
        sys.argv = sys_argv
        os.chdir(cwd)


def _address_space() -> int:
    with open("/proc/self/status") as f:
        kb = next((int(line.split()[1]) for line in f if line.startswith("VmSize:")), 0)
    return kb * 1024


@contextmanager
def memory_cap(headroom: int = MEMORY_HEADROOM) -> Iterator[None]:
    """Cap this process's address space at its present size plus `headroom`: an allocation sized by an
    unbounded input fails (a MemoryError, reported) instead of taking the machine's memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _address_space() + headroom
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft != resource.RLIM_INFINITY and soft <= cap:
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def run_in_process(argv: Sequence[str], ws: Path, cache: Path, seconds: float = CASE_SECONDS) -> Outcome:
    """`specstack ARGV` through specstack.cli.entry.main in this process, in the folder `ws`."""
    from specstack.cli.entry import main

    out, err = _stream("strict"), _stream("backslashreplace")
    code, escaped, message, stopped = None, None, "", None
    start = time.perf_counter()
    with _process_state(argv, ws, cache), redirect_stdout(out), redirect_stderr(err):
        try:
            with _alarm(seconds):
                code = main(list(argv))
        except Stop as e:
            stopped, message = e.kind, str(e)
        except BaseException as e:  # noqa: B036 -- whatever escapes main is the traceback a user sees
            escaped, message = describe(e)
    return Outcome(code, _text(out), _text(err), time.perf_counter() - start, escaped, message, stopped)


def run_subprocess(argv: Sequence[str], ws: Path, cache: Path, seconds: float = CASE_SECONDS) -> Outcome:
    """`python -m specstack.cli ARGV` in the folder `ws`: the real entry point, end to end."""
    env = dict(os.environ, SPECSTACK_CACHE=str(cache))
    start = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "specstack.cli", *argv], cwd=ws, env=env, capture_output=True,
                           timeout=seconds)
    except subprocess.TimeoutExpired as e:
        err = (e.stderr or b"").decode("utf-8", "backslashreplace")
        return Outcome(None, "", err, time.perf_counter() - start, stopped=CaseTimeout.kind,
                       message=f"no answer within {seconds:.0f} s")
    return Outcome(p.returncode, p.stdout.decode("utf-8", "backslashreplace"),
                   p.stderr.decode("utf-8", "backslashreplace"), time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------------
# Checking a case
# ---------------------------------------------------------------------------------------------------
Snapshot = dict[str, tuple[Any, ...]]
DIGEST_LIMIT = 4 << 20  # bigger files are compared by size and mtime only


def snapshot(roots: Iterable[Path]) -> Snapshot:
    """Every file and folder under `roots`: files by size, mtime and (up to DIGEST_LIMIT) content."""
    found: Snapshot = {}
    for root in roots:
        if not root.exists():
            continue
        for p in [root, *(sorted(root.rglob("*")) if root.is_dir() and not root.is_symlink() else [])]:
            st = p.lstat()
            if p.is_dir() and not p.is_symlink():
                found[str(p)] = ("folder",)
            else:
                digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and st.st_size <= DIGEST_LIMIT \
                    else None
                found[str(p)] = ("file", st.st_size, st.st_mtime_ns, digest)
    return found


@dataclass(frozen=True)
class Problem:
    kind: str  # what broke
    where: str  # what to group by: the exception and its frame, or the command
    detail: str = ""


def _under(path: str, outputs: Sequence[str]) -> bool:
    """`path` is an output, inside one, or a folder above one (made to hold it)."""
    p = Path(path)
    return any(o and (p == Path(o) or Path(o) in p.parents or p in Path(o).parents) for o in outputs)


def file_problems(case: Case, code: int | None, before: Snapshot, after: Snapshot) -> list[Problem]:
    """Existing files unchanged unless they are outputs and the case succeeded; nothing new after a
    failure; nothing new outside the outputs after a success."""
    problems = []
    changed = [p for p, s in before.items() if after.get(p) != s]
    touched = [p for p in changed if code != 0 or not _under(p, case.outputs)]
    if touched:
        problems.append(Problem("changed an existing file", case.command,
                                ", ".join(f"{p} ({'removed' if p not in after else 'changed'})" for p in touched)))
    new = [p for p in after if p not in before]
    if code != 0 and new:
        files = any(after[p][0] == "file" for p in new)
        problems.append(Problem("left files behind after failing" if files else
                                "left an empty folder behind after failing", case.command, ", ".join(new[:6])))
    stray = [p for p in new if not _under(p, case.outputs)] if code == 0 else []
    if stray:
        problems.append(Problem("wrote where it was not told to", case.command, ", ".join(stray[:6])))
    return problems


def _lines(err: str) -> list[str]:
    """stderr's lines, progress-bar redraws (carriage returns) split out, blank ones dropped."""
    return [x for line in err.splitlines() for x in line.split("\r") if x.strip()]


def output_problems(case: Case, o: Outcome, seconds: float) -> list[Problem]:
    """The exit code, the one error line, no traceback, the time bound."""
    problems = []
    if o.stopped:
        problems.append(Problem(o.stopped, case.command, o.message))
    elif o.seconds > seconds:
        problems.append(Problem("hang", case.command, f"took {o.seconds:.0f} s (bound {seconds:.0f} s)"))
    if o.escaped:
        problems.append(Problem("exception escaped main", o.escaped, o.message))
    elif o.code == 130:
        problems.append(Problem("exit 130 without a signal", case.command))
    elif o.code is not None and o.code not in case.codes:
        problems.append(Problem(f"exit code {o.code}", case.command, (_lines(o.err) or [""])[-1][:300]))
    if "Traceback" in o.err:
        tb = o.err[o.err.index("Traceback"):].strip().splitlines()
        problems.append(Problem("traceback on stderr", tb[-1][:200] if tb else case.command))
    lines = _lines(o.err)
    errors = [x for x in lines if x.startswith(ERROR_PREFIX)]
    if o.code == 2:
        if not lines or not lines[-1].startswith(ERROR_PREFIX):
            problems.append(Problem("exit 2 without the error line last", case.command,
                                    repr(lines[-1][:200]) if lines else "stderr is empty"))
        elif len(errors) > 1:
            problems.append(Problem("more than one error line", case.command, " | ".join(errors)[:300]))
        elif not lines[-1][len(ERROR_PREFIX):].strip():
            problems.append(Problem("empty error message", case.command))
    if o.code == 0 and errors:
        problems.append(Problem("error line on success", case.command, errors[0][:200]))
    return problems


# ---------------------------------------------------------------------------------------------------
# A run of many cases
# ---------------------------------------------------------------------------------------------------
@dataclass
class Result:
    case: Case
    outcome: Outcome
    problems: list[Problem] = field(default_factory=list)


def _prune(folder: Path, keep: set[Path]) -> None:
    """Remove what appeared under `folder` since `keep` was listed (a case's cache entries)."""
    for p in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)


def run_case(case: Case, fx: Fixtures, ws: Path, seconds: float = CASE_SECONDS,
             runner: Callable[..., Outcome] = run_in_process) -> Result:
    """Make the case's workspace, run it, check it; the cache entries it made are removed."""
    ws.mkdir(parents=True, exist_ok=True)
    for put in case.puts:
        put.make(ws)
    roots = [ws, *fx.inputs()]
    before = snapshot(roots)
    cached = set(fx.cache.rglob("*"))
    with memory_cap():
        outcome = runner(case.argv, ws, fx.cache, seconds)
    after = snapshot(roots)
    problems = output_problems(case, outcome, seconds)
    if outcome.stopped is None:  # a case stopped half-way may leave its work behind: that is not the finding
        problems += file_problems(case, outcome.code, before, after)
    _prune(fx.cache, cached)
    return Result(case, outcome, problems)


def fuzz(seed: int, count: int, fx: Fixtures, root: Path, start: int = 0, seconds: float = CASE_SECONDS,
         keep: bool = False) -> Iterator[Result]:
    """Cases start .. start + count - 1 of `seed`, each in root/case<index> (removed after it unless
    `keep`)."""
    for index in range(start, start + count):
        ws = root / f"case{index}"
        case = make_case(seed, index, fx, ws)
        try:
            yield run_case(case, fx, ws, seconds)
        finally:
            if not keep:
                shutil.rmtree(ws, ignore_errors=True)


def short(text: str, case: Case, fx: Fixtures) -> str:
    """`text` with the case's workspace as $WS and the fixtures' folder as $FX, printable (an argument
    from undecodable bytes holds surrogates: escaped)."""
    text = text.replace(case.ws, "$WS").replace(str(fx.root), "$FX")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def case_text(r: Result, fx: Fixtures) -> str:
    """One case for a report: its command line, the files it was given, what went wrong."""
    c = r.case
    parts = [f"  case {c.index} [{c.note}] exit {r.outcome.code}, {r.outcome.seconds:.1f} s",
             f"    {short(c.line(), c, fx)}"]
    used = [p for p in c.puts if any(p.rel.split("/")[0] in arg for arg in c.argv)]  # not ones a later change replaced
    parts += [f"    {p}" for p in used if p.data is not None or p.remove or p.cut is not None or p.flips]
    parts += [f"    -> {p.kind}: {short(p.detail, c, fx)}" for p in r.problems if p.detail]
    return "\n".join(parts)


def report(results: Sequence[Result], fx: Fixtures, examples: int = 5) -> str:
    """The failures grouped by kind and where, each group with up to `examples` cases."""
    failed = [r for r in results if r.problems]
    seeds = sorted({r.case.seed for r in results})
    lines = [f"{len(failed)} of {len(results)} cases failed (seed {', '.join(map(str, seeds))}; $FX = {fx.root}, "
             f"$WS = the case's own folder; rerun one: python benchmarks/fuzz_cli.py --seed S --case I)"]
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in failed:
        for p in r.problems:
            groups.setdefault((p.kind, p.where), []).append(r)
    for (kind, where), rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"\n{kind}: {where} ({len(rs)} case{'s' * (len(rs) != 1)})")
        lines += [case_text(r, fx) for r in rs[:examples]]
        if len(rs) > examples:
            lines.append(f"  ... and cases {', '.join(str(r.case.index) for r in rs[examples:])}")
    return "\n".join(lines)
