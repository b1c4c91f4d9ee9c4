#!/usr/bin/env bash
# Issue 31's serving check: the old commit's server and the new one's, both `specstack serve --threads 2
# --max-batch 32` on the default model (int4, method auto), each its own process on 127.0.0.1, driven
# level by level by the same `bench-serve` load (12 HumanEval prompts, 128 tokens each, ignore_eos),
# alternating old and new at each level; then 2,000 short requests to the new server with its resident
# memory read before, after 1,000 and after 2,000 (bench-serve reports process_resident_memory_bytes).
#   [RSS=0] [LEVELS="1 32"] bash benchmarks/one_engine_ab/serve.sh OLD_TREE NEW_TREE OUT_DIR   (RSS=0: the levels only)
set -euo pipefail
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd); mkdir -p "$3"; out=$(cd "$3" && pwd)
serve() {  # tree port (run from / so that the tree on PYTHONPATH, not the current folder, is imported)
  cd /
  PYTHONPATH=$1 python -m specstack.cli serve --threads 2 \
    --max-batch 32 --port "$2" --log-level error > "$out/server-$2.log" 2>&1 &
  echo $!
  cd - > /dev/null
}
wait_ready() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0; sleep 1; done; return 1; }
# one after the other: a server measuring its forward-cost curves at start must have the machine alone
p_old=$(serve "$old" 8031)
trap 'kill $p_old 2>/dev/null || true' EXIT
wait_ready 8031
p_new=$(serve "$new" 8032)
trap 'kill $p_old $p_new 2>/dev/null || true' EXIT
wait_ready 8032
for c in ${LEVELS:-1 8 32}; do
  for side in old new; do
    port=$([ $side = old ] && echo 8031 || echo 8032)
    specstack bench-serve --url "http://127.0.0.1:$port/v1" --label "$side" --concurrency "$c" --limit 12 \
      --max-tokens 128 --ignore-eos --out "$out/$side-c$c" > /dev/null
  done
done
kill $p_old
[ "${RSS:-1}" = 0 ] && exit 0  # RSS=0: the levels only
for half in 1 2; do
  specstack bench-serve --url http://127.0.0.1:8032/v1 --label new --concurrency 8 --requests 1000 --limit 12 \
    --max-tokens 4 --ignore-eos --out "$out/rss-$half" > /dev/null
done
