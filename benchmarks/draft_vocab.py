"""FR-Spec's draft vocabulary for a registered model (issue 29): its tokens ranked by frequency in the
CPython standard library (no test suites, as the shipped trigram) and ShareGPT's conversations, counted
with the model's own tokenizer; the first 32,768 ids ship as specstack/data/<name>-token-rank.npy and
`--draft-vocab K` takes the first K. Never HumanEval.

    python benchmarks/draft_vocab.py --model qwen2.5-coder-1.5b --out specstack/data/qwen2.5-coder-token-rank.npy
"""
from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

from specstack.bench.datasets import json_array_items, sharegpt_path
from specstack.models.loading import load_tokenizer, model_cache_dir
from specstack.models.registry import resolve
from specstack.training.token_rank import rank_tokens, save_rank

SKIP = {"test", "tests", "idle_test", "__pycache__", "site-packages", "encodings", "pydoc_data"}


def stdlib_texts() -> list[str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(lib.rglob("*.py")):
        if SKIP & set(p.relative_to(lib).parts):
            continue
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def sharegpt_texts(skip: int, limit: int) -> list[str]:
    """Every turn of conversations skip .. skip + limit: the bench's chat prompts are the first turns of
    the first conversations, so those are left out."""
    out: list[str] = []
    with open(sharegpt_path(), encoding="utf-8") as f:
        for i, conv in enumerate(json_array_items(f)):
            if i >= skip + limit:
                break
            if i >= skip and isinstance(conv, dict):
                out += [t.get("value") or "" for t in conv.get("conversations") or [] if isinstance(t, dict)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--keep", type=int, default=32768)
    ap.add_argument("--sharegpt", type=int, default=20000, help="conversations read")
    ap.add_argument("--sharegpt-skip", type=int, default=2000, help="the first conversations, left out")
    args = ap.parse_args()
    src = resolve(args.model)
    tok = load_tokenizer(src, model_cache_dir(src))
    code, chat = stdlib_texts(), sharegpt_texts(args.sharegpt_skip, args.sharegpt)
    ranked, total = rank_tokens(lambda t: tok(t, add_special_tokens=False)["input_ids"], code + chat, len(tok),
                                args.keep)
    save_rank(args.out, ranked)
    print(f"{len(code)} stdlib files + {len(chat)} ShareGPT turns: {total:,} tokens; kept the {args.keep:,} most "
          f"frequent of {len(tok):,} -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
