"""How often the target's greedy token lies in a draft's reduced vocabulary: the ceiling a reduced
vocabulary puts on the draft's acceptance (a token outside it can never be proposed);
docs/bench-history, "The reduced vocabulary: a 4–6 % ceiling".

    python benchmarks/spire_training/vocab_coverage.py DRAFT.safetensors \
        [--teacher DIR/heldout] [--bench bench_out/RUN/results.jsonl]

--teacher: a teacher cache (train-draft): the target's argmax at every held-out position, and the
           share of the target's top-32 probability mass inside the vocabulary.
--bench:   a greedy `specstack bench` run: every token our `ar` emitted. It needs the rows' token ids,
           so a run in bench_out/ (a run committed under docs/bench keeps its rows without them).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specstack.bench.rows import read_rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("draft", type=Path)
    p.add_argument("--teacher", type=Path)
    p.add_argument("--bench", type=Path)
    args = p.parse_args()
    with safe_open(str(args.draft), "pt") as f:
        vocab = f.get_tensor("vocab_ids").long()
    inside = torch.zeros(max(int(vocab.max()) + 1, 1 << 17), dtype=torch.bool)  # any token id indexes it
    inside[vocab] = True
    print(f"{args.draft.name}: {len(vocab)} tokens")
    if args.teacher:
        total = hit = 0
        mass = 0.0
        for shard in sorted(args.teacher.glob("shard_*.safetensors")):
            s = load_file(str(shard))
            ids = s["topk_ids"].long()
            total += ids[..., 0].numel()
            hit += int(inside[ids[..., 0]].sum())
            mass += float((s["topk_logp"].float().exp() * inside[ids]).sum())
        print(f"teacher {args.teacher}: {total} positions, argmax inside {hit / total:.3f}, "
              f"top-32 probability mass inside {mass / total:.3f}")
    if args.bench:
        ar = [row for row in read_rows(args.bench) if row["method"] == "ar"]
        if not ar or any("tokens" not in row for row in ar):
            raise SystemExit(f"{args.bench}: no `ar` rows with token ids (rerun the benchmark into bench_out/)")
        tokens = [t for row in ar for t in row["tokens"]]
        share = sum(bool(inside[t]) for t in tokens) / len(tokens)
        print(f"bench {args.bench}: {len(tokens)} tokens of ar, inside {share:.3f}")


if __name__ == "__main__":
    main()
