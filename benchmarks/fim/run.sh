#!/usr/bin/env bash
# Issue 34's editor benchmark in one run: our server and llama-server on the same GGUF, one after the other,
# each a real process on 127.0.0.1, each sent the same held-out infill cases (infill_bench.py), then stopped;
# compare.py writes OUT_DIR/summary.md.
#   specstack     specstack serve --model MODEL (its default method: auto), cases cold, cached, with
#                 speculation off (--ar: exact match and plain decoding's speed) and as plain completions (τ)
#   llama-server  llama.cpp's server on the same GGUF, one slot, its prompt cache on (its default)
#
#   usage: benchmarks/fim/run.sh OUT_DIR [MODEL]      (default MODEL: qwen2.5-coder-1.5b)
#   THREADS (2), CASES (24), CTX (4096), SERVE_FLAGS (""), LLAMA_FLAGS (""), PYTHON (python)
set -euo pipefail
if [[ $# -lt 1 || $# -gt 2 ]]; then echo "usage: $0 OUT_DIR [MODEL]" >&2; exit 2; fi
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
mkdir -p "$1"; OUT="$(cd "$1" && pwd)"
MODEL="${2:-qwen2.5-coder-1.5b}"
cd "$REPO"
PY="${PYTHON:-python}"; THREADS="${THREADS:-2}"; CASES="${CASES:-24}"; CTX="${CTX:-4096}"
LLAMA_SERVER="${LLAMA_SERVER:-$HOME/.cache/specstack/llama_cpp/build/bin/llama-server}"
read -r -a SERVE_EXTRA <<< "${SERVE_FLAGS:-}"
read -r -a LLAMA_EXTRA <<< "${LLAMA_FLAGS:-}"
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_health() {  # URL PID
    for _ in $(seq 1 900); do
        if curl -sf "$1/health" >/dev/null 2>&1; then return 0; fi
        kill -0 "$2" 2>/dev/null || return 1
        sleep 1
    done
    return 1
}
{ echo "model $MODEL, threads $THREADS, context $CTX, cases $CASES; commit $(git rev-parse --short HEAD)"
  lscpu | grep "Model name"
  echo "flags: $(grep -o -w 'avx[0-9a-z_]*\|amx[0-9a-z_]*\|fma' /proc/cpuinfo | sort -u | tr '\n' ' ')"; } > "$OUT/settings.txt"

PORT=$(free_port)
echo "[specstack] starting on $PORT" >&2
"$PY" -m specstack.cli serve --model "$MODEL" --threads "$THREADS" --host 127.0.0.1 --port "$PORT" --max-batch 1 \
    --max-context "$CTX" "${SERVE_EXTRA[@]}" 2> "$OUT/specstack.log" &
PID=$!
if wait_health "http://127.0.0.1:$PORT" $PID; then
    "$PY" benchmarks/fim/infill_bench.py --url "http://127.0.0.1:$PORT" --label specstack --out "$OUT/specstack.jsonl" \
        --cases "$CASES" --ar --plain
else
    echo "specstack did not come up (see specstack.log)" >> "$OUT/notes.txt"
fi
kill $PID; wait $PID || true

GGUF=$("$PY" -c "from specstack.models.registry import resolve; print(resolve('$MODEL').path)")
if [[ -x "$LLAMA_SERVER" ]]; then
    PORT=$(free_port)
    echo "[llama-server] starting on $PORT" >&2
    "$LLAMA_SERVER" -m "$GGUF" -t "$THREADS" -tb "$THREADS" -c "$CTX" --parallel 1 --host 127.0.0.1 --port "$PORT" \
        "${LLAMA_EXTRA[@]}" > "$OUT/llama-server.log" 2>&1 &
    PID=$!
    if wait_health "http://127.0.0.1:$PORT" $PID; then
        "$PY" benchmarks/fim/infill_bench.py --url "http://127.0.0.1:$PORT" --label llama-server \
            --out "$OUT/llama-server.jsonl" --cases "$CASES"
    else
        echo "llama-server did not come up (see llama-server.log)" >> "$OUT/notes.txt"
    fi
    kill $PID; wait $PID || true
else
    echo "llama-server not built (benchmarks/build_llama_cpp.sh): not run" >> "$OUT/notes.txt"
fi
"$PY" benchmarks/fim/compare.py "$OUT" > "$OUT/summary.md"
cat "$OUT/summary.md"
