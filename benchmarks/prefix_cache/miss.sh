#!/usr/bin/env bash
# Issue 33's "the cache costs nothing on a miss": the same tree served twice, with its prefix cache on and
# with --no-prefix-cache (each `specstack serve --threads 2 --max-batch 8`, a real process on 127.0.0.1,
# started one after the other), driven by the default bench-serve load (HumanEval prompts, which share
# little: the rows report how many tokens hit) at each level in the order on, off, off, on, so a drift of
# the machine falls on both alike.
#   bash benchmarks/prefix_cache/miss.sh OUT_DIR [MODEL]   (env: LEVELS, default "1 8"; TOKENS, default 64)
set -euo pipefail
mkdir -p "$1"; out=$(cd "$1" && pwd); model="${2:-smollm2-135m}"
serve() {  # port flags...
  local port=$1; shift
  python -m specstack.cli serve --model "$model" --threads 2 --max-batch 8 --port "$port" --log-level error "$@" \
    > "$out/server-$port.log" 2>&1 &
  echo $!
}
wait_ready() { for _ in $(seq 900); do curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0; sleep 1; done; return 1; }
p_on=$(serve 8041); trap 'kill $p_on 2>/dev/null || true' EXIT; wait_ready 8041
p_off=$(serve 8042 --no-prefix-cache); trap 'kill $p_on $p_off 2>/dev/null || true' EXIT; wait_ready 8042
for c in ${LEVELS:-1 8}; do
  for pass in on-1 off-1 off-2 on-2; do
    port=$([ "${pass%-*}" = on ] && echo 8041 || echo 8042)
    python -m specstack.cli bench-serve --url "http://127.0.0.1:$port/v1" --label "cache-$pass" --concurrency "$c" \
      --limit 12 --max-tokens "${TOKENS:-64}" --ignore-eos --out "$out/c$c-$pass" > /dev/null
  done
done
