#!/bin/bash
# A/B of the stored width-cost curve (docs/bench-history, "The width-cost curve, measured again"): 20
# HumanEval problems, `ar;staged:cost=1,d2=3;tree:cost=1`, with the curve measured the old way (widths in
# a fixed order, T = 1 inflated) and the new way, alternating old, new, old2, new2.
# OLD and NEW are the key prefixes of the two curves in SPECSTACK_CACHE's width_costs.json (on the machine
# of the committed runs: OLD=f2c5e57e, NEW=7d139caf). The engine looks up the NEW key; for the "old" runs
# that entry holds the old curve. The store is put back as found at the end, whatever happens.
#
#     OLD=f2c5e57e NEW=7d139caf benchmarks/width_cost_ab/ab_curve.sh      (from the repository root)
#
# Output: bench_out/width_cost_ab/{old,new,old2,new2}/ (a `specstack bench` folder each) and their logs.
set -eu
: "${OLD:?key prefix of the old curve}" "${NEW:?key prefix of the new curve}"
STORE=${SPECSTACK_CACHE:-$HOME/.cache/specstack}/width_costs.json
OUT=${OUT:-bench_out/width_cost_ab}
mkdir -p "$OUT"
cp "$STORE" "$OUT/width_costs.found.json"
trap 'cp "$OUT/width_costs.found.json" "$STORE"' EXIT
use_old() {  # the NEW key holding the OLD curve
  python - "$OUT/width_costs.found.json" "$STORE" "$OLD" "$NEW" <<'PY'
import json
import sys

found, store, old, new = sys.argv[1:]
curves = json.load(open(found))
key = {p: next(k for k in curves if k.startswith(p)) for p in (old, new)}
curves[key[new]] = curves[key[old]]
json.dump(curves, open(store, "w"), indent=1)
PY
}
for run in old new old2 new2; do
  case $run in old*) use_old ;; new*) cp "$OUT/width_costs.found.json" "$STORE" ;; esac
  python -m specstack.cli bench --prompts humaneval --limit 20 --max-new-tokens 128 --threads 2 \
    --methods "ar;staged:cost=1,d2=3;tree:cost=1" --out "$OUT/$run" > "$OUT/$run.log" 2>&1
done
echo done
