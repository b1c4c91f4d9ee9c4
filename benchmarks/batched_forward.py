"""Milliseconds of one forward of B rows x T tokens at context 256 (median of 7 after 2 warm-ups),
for the source tree on sys.path: run it with PYTHONPATH=OLD_TREE to time an older commit the same way
(the before/after of docs/bench-history, "Batched decoding"; `specstack bench-forward --rows` is the
full curve of the current code).

    python benchmarks/batched_forward.py [FORMAT] [B1,B2,...] [T1,T2,...]     (default int4 1,4,8,16,32 1)
"""
import statistics
import sys
import time

import torch

from specstack.attention import build_batch
from specstack.models.loading import load_model

CONTEXT = 256


def median_ms(model, rows: int, tokens: int, repeats: int = 7) -> float:
    cache = model.new_cache(rows, CONTEXT + tokens + 8)
    ctx = torch.randint(0, model.config.vocab_size, (rows, CONTEXT), generator=torch.Generator().manual_seed(0))
    model.extend(ctx, cache, logit_rows=slice(0, 0))
    block = torch.randint(0, model.config.vocab_size, (rows, tokens))
    times = []
    for _ in range(repeats + 2):  # forwards write scratch only: every repeat runs at the same context
        t = time.perf_counter()
        model.forward(block, build_batch(cache, tokens), cache)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    torch.set_num_threads(2)
    fmt = sys.argv[1] if len(sys.argv) > 1 else "int4"
    rows = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1,4,8,16,32").split(",")]
    tokens = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1").split(",")]
    model = load_model("smollm2-135m", fmt).model
    for b in rows:
        for t in tokens:
            print(f"B={b} T={t} {median_ms(model, b, t):.1f} ms", flush=True)


if __name__ == "__main__":
    main()
