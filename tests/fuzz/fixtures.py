"""The valid inputs fuzz cases start from, built once under a folder and read back from it: a tiny
checkpoint with the default model's tokenizer, a GGUF of its own and its broken variants, a draft, a
trigram, a sequences file, prompts, a corpus, a finished bench run and a calibration file."""
from __future__ import annotations

import io
import json
import os
import shlex
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiny_checkpoints import build_tiny_checkpoint
from tiny_gguf import write_tiny_llama_gguf


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


GGUF_KEYS = ("llama.block_count", "llama.context_length", "llama.embedding_length", "llama.feed_forward_length",
             "llama.attention.head_count", "llama.attention.head_count_kv", "llama.vocab_size",
             "llama.rope.dimension_count", "general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.tokens")


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
    with cache_env(cache):
        return _build_fixtures(root, cache, model or build_tiny_checkpoint(root / "tiny-llama"))


@contextmanager
def cache_env(cache: Path) -> Iterator[None]:
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
    gguf_file = write_tiny_llama_gguf(root / "tiny.gguf")
    variants = [write_tiny_llama_gguf(root / f"tiny-no-{k.replace('.', '_')}.gguf", drop=k) for k in GGUF_KEYS]
    variants += [write_tiny_llama_gguf(root / f"tiny-{k.replace('.', '_')}-{i}.gguf", override=(k, v))
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
