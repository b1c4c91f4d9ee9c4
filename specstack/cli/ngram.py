"""`specstack ngram train`: tokenise a text corpus with a model's tokenizer and fit draft2's Katz trigram.

    specstack ngram train --model smollm2-135m --corpus src/ more.py --out trigram.npz [--k 5] [--min-count 2]

Corpus paths are files (taken as they are) or directories (walked for --ext files, skipping
--exclude-dir names). Each file is one token stream: no n-gram crosses a file boundary. Files that
are not valid UTF-8 are skipped and counted. A thin adapter (DESIGN §1): the model lives in
specstack/drafting/ngram.py.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specstack.cli.common import add_checked
from specstack.errors import SpecstackError
from specstack.models.registry import DEFAULT_MODEL, ModelSource, resolve
from specstack.validate import ints

# Good-Turing discounts only the rarest counts (Katz used k = 5): past ~100 the count-of-counts is
# too sparse to estimate anything, and katz_estimate.py sizes an array by k
MAX_GOOD_TURING_K = 100
DEFAULT_EXTS = (".py",)
DEFAULT_EXCLUDE_DIRS = ("__pycache__", ".git", "site-packages", "node_modules")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("ngram", help="the n-gram draft (draft2): train a Katz trigram",
                              description="N-gram draft (draft2 of staged speculative decoding).")
    sub = p.add_subparsers(dest="ngram_command", metavar="ACTION", required=True)
    t = sub.add_parser("train", help="train a Katz backoff trigram on a text corpus",
                       description="Tokenise a corpus with the model's tokenizer and train a Katz backoff "
                                   "trigram (Good-Turing discounts), saved as a compressed .npz.")
    t.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"whose tokenizer and vocabulary (default: {DEFAULT_MODEL})")
    t.add_argument("--corpus", nargs="+", required=True, type=Path, metavar="PATH",
                   help="text files and/or directories (walked for --ext files)")
    t.add_argument("--out", required=True, type=Path, metavar="FILE", help="where to write the .npz")
    add_checked(t, "--k", ints(1, MAX_GOOD_TURING_K, "Good-Turing discounts only rare counts"), default=5,
                help=f"Good-Turing discounts for counts <= k, at most {MAX_GOOD_TURING_K} (default: 5)")
    t.add_argument("--min-count", type=int, default=1, metavar="N",
                   help="keep trigrams seen at least N times (default: 1, keep all)")
    t.add_argument("--min-count-bigram", type=int, default=None, metavar="N",
                   help="keep bigrams seen at least N times (default: --min-count)")
    t.add_argument("--max-files", type=int, default=None, metavar="N", help="use at most N files")
    t.add_argument("--ext", action="append", default=None, metavar=".EXT",
                   help="file extension to take from directories (repeatable; default: .py)")
    t.add_argument("--exclude-dir", action="append", default=None, metavar="NAME",
                   help="directory name to skip while walking (repeatable; default: "
                        f"{', '.join(DEFAULT_EXCLUDE_DIRS)})")
    t.set_defaults(func=cmd_train)
    return p


# ---------------------------------------------------------------------------------------------------
def collect_files(paths: Sequence[Path], exts: Sequence[str], exclude_dirs: Sequence[str],
                  max_files: int | None) -> list[Path]:
    """Files named directly, then each directory's matching files (sorted, deterministic)."""
    exts = tuple(e if e.startswith(".") else "." + e for e in exts)
    excluded = set(exclude_dirs)
    out: list[Path] = []
    seen: set[Path] = set()
    for path in paths:
        if not path.exists():
            raise SpecstackError(f"corpus path not found: {path}")
        if path.is_file():
            found = [path]
        elif path.is_dir():
            found = sorted(f for f in path.rglob("*") if f.suffix in exts and f.is_file()
                           and not excluded.intersection(f.relative_to(path).parts[:-1]))
        else:
            raise SpecstackError(f"corpus path is neither a file nor a directory: {path}")
        for f in found:
            r = f.resolve()
            if r not in seen:
                seen.add(r)
                out.append(f)
    if max_files is not None:
        out = out[:max_files]
    return out


def load_tokenizer_for(name: str) -> tuple[ModelSource, Any]:
    """The model's tokenizer without loading its weights (reusing load_model's on-disk cache)."""
    from specstack.models.loading import cache_root, load_tokenizer

    src = resolve(name)  # unknown names fail here with a SpecstackError
    if not src.has_tokenizer:
        raise SpecstackError(f"model {name!r} has no tokenizer")
    return src, load_tokenizer(src, _cache_dir(src, cache_root()))


def _cache_dir(src: ModelSource, root: Path) -> Path | None:
    try:
        from specstack.models.loading import model_cache_dir  # where load_model keeps the tokenizer

        d = model_cache_dir(src, root)
    except Exception:
        return None
    return d if d.is_dir() else None


def target_vocab_size(src: ModelSource, tokenizer: Any) -> int:
    """V of the target's output layer (the n-gram must cover it), at least the tokenizer's size."""
    from specstack.models.loading import cache_root

    vocab = len(tokenizer)
    cfg_file = None
    cdir = _cache_dir(src, cache_root())
    if cdir is not None and (cdir / "config.json").is_file():
        cfg_file = cdir / "config.json"
    elif src.kind == "hf" and (src.path / "config.json").is_file():
        cfg_file = src.path / "config.json"
    if cfg_file is not None:
        try:
            vocab = max(vocab, int(json.loads(cfg_file.read_text())["vocab_size"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    elif src.kind == "gguf":
        from specstack.models.configs import read_gguf_config

        vocab = max(vocab, read_gguf_config(src.path).vocab_size)
    return vocab


def tokenize_files(tokenizer: Any, files: Sequence[Path], batch: int = 16) -> tuple[list[list[int]], int, int]:
    """(token streams, skipped files, bytes read): one stream per UTF-8 file, with a progress bar."""
    from tqdm import tqdm

    streams: list[list[int]] = []
    skipped = nbytes = 0
    with tqdm(total=len(files), unit="file", desc="tokenizing", file=sys.stderr, disable=None) as bar:
        for i in range(0, len(files), batch):
            texts = []
            for f in files[i:i + batch]:
                try:
                    data = f.read_bytes()
                    texts.append(data.decode("utf-8"))
                    nbytes += len(data)
                except (OSError, UnicodeDecodeError):
                    skipped += 1
            texts = [t for t in texts if t.strip()]
            if texts:
                streams.extend(tokenizer(texts, add_special_tokens=False)["input_ids"])
            bar.update(len(files[i:i + batch]))
    return streams, skipped, nbytes


def cmd_train(args: argparse.Namespace) -> int:
    # 1. cheap checks
    if args.min_count < 1 or (args.min_count_bigram is not None and args.min_count_bigram < 1):
        raise SpecstackError("--min-count and --min-count-bigram must be >= 1")
    if args.max_files is not None and args.max_files < 1:
        raise SpecstackError(f"--max-files must be >= 1, got {args.max_files}")
    if args.out.exists() and args.out.is_dir():
        raise SpecstackError(f"--out is a directory: {args.out}")
    files = collect_files(args.corpus, args.ext or DEFAULT_EXTS, args.exclude_dir or DEFAULT_EXCLUDE_DIRS,
                          args.max_files)
    if not files:
        raise SpecstackError(f"no corpus files found (extensions: {', '.join(args.ext or DEFAULT_EXTS)})")
    resolve(args.model)
    # 2. tokenise
    t0 = time.perf_counter()
    src, tok = load_tokenizer_for(args.model)
    vocab = target_vocab_size(src, tok)
    streams, skipped, nbytes = tokenize_files(tok, files)
    n_tokens = sum(len(s) for s in streams)
    if n_tokens == 0:
        raise SpecstackError(f"the corpus is empty: no tokens in {len(files)} file(s)"
                             + (f" ({skipped} not valid UTF-8)" if skipped else ""))
    t1 = time.perf_counter()
    # 3. train and save
    from specstack.drafting.katz import KatzTrigram

    model = KatzTrigram.train(streams, vocab, k=args.k, min_count=args.min_count,
                              min_count_bigram=args.min_count_bigram)
    model.meta.update(model_name=src.name, corpus_files=len(files) - skipped, corpus_bytes=nbytes)
    try:
        out = model.save(args.out)
    except OSError as e:
        raise SpecstackError(f"cannot write {args.out}: {e.strerror or e}") from None
    t2 = time.perf_counter()
    # 4. stats
    m = model.meta
    print(f"corpus:   {len(files) - skipped} files ({skipped} skipped, not UTF-8), {nbytes / 1e6:.1f} MB, "
          f"{n_tokens:,} tokens (vocab {vocab:,})")
    print(f"distinct: {m['distinct']['unigram']:,} unigrams, {m['distinct']['bigram']:,} bigrams, "
          f"{m['distinct']['trigram']:,} trigrams")
    print(f"kept:     {m['kept']['bigram']:,} bigrams in {m['contexts']['bigram']:,} contexts, "
          f"{m['kept']['trigram']:,} trigrams in {m['contexts']['trigram']:,} contexts "
          f"(min counts: bigram {m['min_count_bigram']}, trigram {m['min_count']})")
    for level in ("bigram", "trigram"):
        d = ", ".join(f"{x:.3f}" for x in m["discounts"][level])
        a = m["A"][level]
        print(f"discount: {level} d_1..d_{args.k} = {d}" + (f" (A = {a:.4f})" if a is not None else ""))
    print(f"saved:    {out} ({out.stat().st_size / 1e6:.2f} MB); tokenize {t1 - t0:.1f} s, train+save {t2 - t1:.1f} s")
    return 0
