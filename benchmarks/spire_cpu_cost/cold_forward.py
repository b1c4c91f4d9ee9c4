"""A draft forward (one token, int8, 2 threads) warm, and right after what the engine does between
two rounds: a target step (whose ~90 MB of weights push the draft's out of the caches), a 64 MB
memset (caches only), a 5 ms sleep (idle threads only). Median of 80 each.

    python benchmarks/spire_cpu_cost/cold_forward.py DRAFT.safetensors [DRAFT.safetensors ...]
"""
from __future__ import annotations

import sys
import time

import torch

from specstack.attention import build_batch
from specstack.models.draft_file import load_draft_file
from specstack.models.loading import load_model

MODES = ("warm", "after target step", "after 64 MB memset", "after sleep 5ms")


def main(paths: list[str]) -> None:
    torch.set_num_threads(2)
    target = load_model("smollm2-135m", dtype="int4", tokenizer=False)
    tc = target.model.new_cache(1, 4096)
    ids = torch.randint(0, 49152, (1, 300))
    target.model.forward(ids, build_batch(tc, 300), tc)
    tc.commit_all()
    for path in paths:
        m = load_draft_file(path, target, "int8").model
        cache = m.new_cache(1, 4096)
        if m.target_hidden_layers:
            m.write_memories(ids, torch.randn(1, 300, len(m.target_hidden_layers), 576), cache)
        else:
            m.forward(ids, build_batch(cache, 300), cache)
            cache.commit_all()
        tok = torch.randint(0, 49152, (1, 1))
        mask, off = torch.ones(1, 1, dtype=torch.bool), torch.tensor([0])
        buf = torch.zeros(64 * 2**20, dtype=torch.uint8)
        for mode in MODES:
            ts = []
            for i in range(80):
                if mode == "after target step":
                    target.model.forward(tok, build_batch(tc, 1), tc)
                elif mode == "after 64 MB memset":
                    buf.fill_(i % 7)
                elif mode == "after sleep 5ms":
                    time.sleep(0.005)
                t = time.perf_counter()
                m.forward(tok, build_batch(cache, 1, mask, off), cache)
                ts.append(time.perf_counter() - t)
            print(path.split("/")[-1], mode, f"{sorted(ts)[40] * 1e3:.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
