"""One draft forward of one token after 300 committed ones, alone (weights warm), as the engine runs
it: the draft in int8 beside the default int4 target, 2 threads. Median of 300, twice per draft.

    python benchmarks/spire_cpu_cost/forward_cost.py DRAFT.safetensors [DRAFT.safetensors ...]
"""
from __future__ import annotations

import sys
import time

import torch

from specstack.attention import build_batch
from specstack.models.draft_file import load_draft_file
from specstack.models.loading import load_model


def forward_ms(path: str, target) -> float:
    m = load_draft_file(path, target, "int8").model
    cache = m.new_cache(1, 4096)
    ids = torch.randint(0, target.config.vocab_size, (1, 300))
    if m.target_hidden_layers:  # verified tokens come from the target's activations
        hidden = torch.randn(1, 300, len(m.target_hidden_layers), target.config.d_model)
        m.write_memories(ids, hidden, cache)
    else:
        m.forward(ids, build_batch(cache, 300), cache)
        cache.commit_all()
    token = torch.randint(0, target.config.vocab_size, (1, 1))

    mask, offset = torch.ones(1, 1, dtype=torch.bool), torch.tensor([0])

    def one() -> None:  # a drafted token in a new block of scratch (never committed)
        m.forward(token, build_batch(cache, 1, mask, offset), cache)

    for _ in range(30):
        one()
    times = []
    for _ in range(300):
        t = time.perf_counter()
        one()
        times.append(time.perf_counter() - t)
    return sorted(times)[150] * 1e3


def main() -> None:
    torch.set_num_threads(2)
    target = load_model("smollm2-135m", dtype="int4", tokenizer=False)
    for _ in range(2):
        for path in sys.argv[1:]:
            print(f"{path}: {forward_ms(path, target):.2f} ms")


if __name__ == "__main__":
    main()
