#!/usr/bin/env bash
# Issue 33's prefix-cache benchmark in one run: three servers on the same model, one at a time, each a
# real process on 127.0.0.1 waited for on /health, each driven by `specstack bench-serve` with the three
# prefix-cache workloads (chat, editor, prefix-probe), then stopped:
#   specstack-cache    specstack serve with its prefix cache ($CACHE_ON_FLAGS: the cache is on by default)
#   specstack-nocache  specstack serve $CACHE_OFF_FLAGS (default --no-prefix-cache)
#   llama-server       llama.cpp's server on the same GGUF, its prompt cache on (its default); skipped with
#                      a note if it is not built (benchmarks/build_llama_cpp.sh) or MODEL is not a GGUF
# A server whose flags this `specstack serve` does not have is skipped with a note, as is a server that
# does not come up; a workload that fails is noted and the run goes on. Finally compare.py writes
# OUT_DIR/summary.md: one table per workload, a block of rows per server.
#
#   usage: benchmarks/prefix_cache/run.sh OUT_DIR [MODEL]     (MODEL: a registry name or a .gguf; default smollm2-135m)
#
# Run it from anywhere (it runs from the repository root), in the project's environment. Every knob is an
# environment variable, each with its default here:
#   THREADS (2)        CPU threads of each server (-t / -tb for llama-server)
#   CTX (4096)         tokens per sequence: our --max-context, llama-server's context per slot
#   CONVERSATIONS (10), TURNS (5), CONCURRENCY (4), CHAT_TOKENS (32)      --workload chat
#   EDITOR_REQUESTS (40), EDITOR_TOKENS (16)                             --workload editor
#   PROBE_REPEATS (3), PROBE_N (8), PROBE_TOKENS (8)                     --workload prefix-probe
#   CHAT_FLAGS, EDITOR_FLAGS, PROBE_FLAGS ("")    more bench-serve flags of one workload (e.g. --turn-chars 200)
#   TIMEOUT (600)      seconds per request;  STARTUP_S (900) seconds for a server to answer /health 200
#   LLAMA_SERVER       default: where build_llama_cpp.sh puts it;  LLAMA_FLAGS (""): more llama-server flags
#   SERVE_FLAGS ("")   more flags for both of our servers (e.g. "--dtype w4a8")
#   PYTHON (python)    the interpreter with specstack installed
#
# A smoke test on tiny settings:
#   CONVERSATIONS=2 TURNS=2 EDITOR_REQUESTS=4 PROBE_REPEATS=1 THREADS=1 benchmarks/prefix_cache/run.sh bench_out/pc_smoke
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
    echo "usage: $0 OUT_DIR [MODEL]" >&2
    exit 2
fi
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
mkdir -p "$1"
OUT="$(cd "$1" && pwd)"
MODEL="${2:-smollm2-135m}"
cd "$REPO"

PY="${PYTHON:-python}"
THREADS="${THREADS:-2}"
CTX="${CTX:-4096}"
CONVERSATIONS="${CONVERSATIONS:-10}"
TURNS="${TURNS:-5}"
CONCURRENCY="${CONCURRENCY:-4}"
CHAT_TOKENS="${CHAT_TOKENS:-32}"
EDITOR_REQUESTS="${EDITOR_REQUESTS:-40}"
EDITOR_TOKENS="${EDITOR_TOKENS:-16}"
PROBE_REPEATS="${PROBE_REPEATS:-3}"
PROBE_N="${PROBE_N:-8}"
PROBE_TOKENS="${PROBE_TOKENS:-8}"
TIMEOUT="${TIMEOUT:-600}"
STARTUP_S="${STARTUP_S:-900}"
LLAMA_SERVER="${LLAMA_SERVER:-$HOME/.cache/specstack/llama_cpp/build/bin/llama-server}"

# ---- the servers' flags, all here ---------------------------------------------------------------------
# n=PROBE_N samples need that many rows at once (our --max-batch, llama-server's slots); chat needs CONCURRENCY
SLOTS=$(( PROBE_N > CONCURRENCY ? PROBE_N : CONCURRENCY ))
read -r -a SERVE_EXTRA <<< "${SERVE_FLAGS:-}"
OURS=("$PY" -m specstack.cli serve --model "$MODEL" --threads "$THREADS" --host 127.0.0.1
      --max-batch "$SLOTS" --max-context "$CTX" "${SERVE_EXTRA[@]}")
read -r -a CACHE_ON <<< "${CACHE_ON_FLAGS-}"                      # e.g. "--prefix-cache-mb 512"
read -r -a CACHE_OFF <<< "${CACHE_OFF_FLAGS---no-prefix-cache}"   # CACHE_OFF_FLAGS="" runs it without the flag
read -r -a LLAMA_EXTRA <<< "${LLAMA_FLAGS:-}"
# llama-server's prompt cache is on by default (requests' cache_prompt defaults to true): nothing to add.
# -c is the context of all slots together.
llama_argv() {
    LLAMA=("$LLAMA_SERVER" -m "$1" -t "$THREADS" -tb "$THREADS" --parallel "$SLOTS" -c $(( SLOTS * CTX ))
           --cont-batching --metrics --host 127.0.0.1 "${LLAMA_EXTRA[@]}")
}

# ---- the workloads' flags (every request: exactly its max_tokens, greedy) -------------------------------
read -r -a CHAT_EXTRA <<< "${CHAT_FLAGS:-}"
read -r -a EDITOR_EXTRA <<< "${EDITOR_FLAGS:-}"
read -r -a PROBE_EXTRA <<< "${PROBE_FLAGS:-}"
CHAT=(--conversations "$CONVERSATIONS" --turns "$TURNS" --concurrency "$CONCURRENCY" --max-tokens "$CHAT_TOKENS"
      "${CHAT_EXTRA[@]}")
EDITOR=(--requests "$EDITOR_REQUESTS" --max-tokens "$EDITOR_TOKENS" "${EDITOR_EXTRA[@]}")
PROBE=(--repeats "$PROBE_REPEATS" --n "$PROBE_N" --max-tokens "$PROBE_TOKENS" "${PROBE_EXTRA[@]}")

command -v curl >/dev/null || { echo "run.sh needs curl (to wait for /health)" >&2; exit 2; }
: > "$OUT/notes.txt"
: > "$OUT/servers.txt"
{
    echo "model $MODEL, threads $THREADS, context $CTX, rows $SLOTS; commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo "chat: ${CHAT[*]}"
    echo "editor: ${EDITOR[*]}"
    echo "prefix-probe: ${PROBE[*]}"
} > "$OUT/settings.txt"

note() {
    echo "note: $*" >&2
    echo "$*" >> "$OUT/notes.txt"
}

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

PID=""
stop_server() {  # SIGTERM, then SIGKILL after 30 s: no server outlives the script
    [[ -n "$PID" ]] || return 0
    if kill -0 "$PID" 2>/dev/null; then
        kill -TERM "$PID" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$PID" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$PID" 2>/dev/null && kill -KILL "$PID" 2>/dev/null || true
    fi
    wait "$PID" 2>/dev/null || true
    PID=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

start_server() {  # LABEL ARGV...: start it on a free port, wait for /health 200; sets PID and URL
    local label="$1"; shift
    local port log deadline code
    port="$(free_port)"
    log="$OUT/$label/server.log"
    mkdir -p "$OUT/$label"
    echo "$* --port $port" > "$OUT/$label/command.txt"
    echo "[$label] starting: $* --port $port" >&2
    "$@" --port "$port" > "$log" 2>&1 &
    PID=$!
    URL="http://127.0.0.1:$port"
    deadline=$(( SECONDS + STARTUP_S ))
    while :; do
        code="$(curl -s -o /dev/null -w '%{http_code}' "$URL/health" || true)"
        [[ "$code" == 200 ]] && return 0
        if ! kill -0 "$PID" 2>/dev/null; then
            note "$label did not start (see $log): $(tail -n 3 "$log" | tr '\n' ' ')"
            wait "$PID" 2>/dev/null || true
            PID=""
            return 1
        fi
        if (( SECONDS > deadline )); then
            note "$label did not answer /health 200 within $STARTUP_S s (see $log)"
            stop_server
            return 1
        fi
        sleep 0.5
    done
}

run_workloads() {  # LABEL: the three workloads against the server at $URL
    local label="$1" workload flags
    for workload in chat editor prefix-probe; do
        case "$workload" in
            chat) flags=("${CHAT[@]}") ;;
            editor) flags=("${EDITOR[@]}") ;;
            prefix-probe) flags=("${PROBE[@]}") ;;
        esac
        echo "[$label] bench-serve --workload $workload ${flags[*]}" >&2
        if ! "$PY" -m specstack.cli bench-serve --url "$URL/v1" --label "$label" --workload "$workload" --ignore-eos \
                --timeout "$TIMEOUT" --out "$OUT/$label/$workload" "${flags[@]}"; then
            note "$label: --workload $workload failed (see above)"
        fi
    done
}

has_flags() {  # FLAG...: whether this `specstack serve` has every --flag given
    local help f
    help="$("$PY" -m specstack.cli serve --help)"
    for f in "$@"; do
        [[ "$f" != --* ]] && continue
        grep -q -- "${f%%=*}\b" <<< "$help" || { echo "$f"; return 1; }
    done
    return 0
}

measure() {  # LABEL ARGV...
    local label="$1"; shift
    if start_server "$label" "$@"; then
        echo "$label" >> "$OUT/servers.txt"
        run_workloads "$label"
        stop_server
    fi
}

# ---- 1. our server, the prefix cache on, then off -----------------------------------------------------
for config in cache nocache; do
    if [[ $config == cache ]]; then flags=("${CACHE_ON[@]}"); else flags=("${CACHE_OFF[@]}"); fi
    if missing="$(has_flags "${flags[@]}")"; then
        measure "specstack-$config" "${OURS[@]}" "${flags[@]}"
    else
        note "specstack-$config skipped: this specstack serve has no $missing (set CACHE_ON_FLAGS / CACHE_OFF_FLAGS)"
    fi
done

# ---- 2. llama-server on the same GGUF, its prompt cache on ---------------------------------------------
GGUF="$("$PY" -c 'import sys
from specstack.models.registry import resolve
s = resolve(sys.argv[1])
print(s.path if s.kind == "gguf" else "")' "$MODEL")"
if [[ ! -x "$LLAMA_SERVER" ]]; then
    note "llama-server skipped: $LLAMA_SERVER not found (benchmarks/build_llama_cpp.sh builds it)"
elif [[ -z "$GGUF" ]]; then
    note "llama-server skipped: $MODEL is not a GGUF"
else
    llama_argv "$GGUF"
    measure llama-server "${LLAMA[@]}"
fi

# ---- 3. one summary ------------------------------------------------------------------------------------
"$PY" benchmarks/prefix_cache/compare.py "$OUT"
echo "wrote $OUT/summary.md" >&2
