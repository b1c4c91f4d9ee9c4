#!/bin/bash
# A/B of the stored int4 width-cost curve: the old (fixed-order, T=1 inflated) against the new one.
# The key prefixes are this machine's curves (f2c5e57e: measured the old way, 7d139caf: the new way).
cd /work/main
F=/root/.cache/specstack/width_costs.json
cp $F /work/runs/s15/width_costs.new.json
python - <<'PY'
import json
d = json.load(open("/root/.cache/specstack/width_costs.json"))
d["7d139caf" + [k for k in d if k.startswith("7d139caf")][0][8:]] = d[[k for k in d if k.startswith("f2c5e57e")][0]]
json.dump(d, open("/root/.cache/specstack/width_costs.json", "w"), indent=1)
PY
M="ar;staged:cost=1,d2=3;tree:cost=1"
for r in old new old2 new2; do
  case $r in old*) python - <<'PY'
import json
d = json.load(open("/work/runs/s15/width_costs.new.json"))
k_new = [k for k in d if k.startswith("7d139caf")][0]; k_old = [k for k in d if k.startswith("f2c5e57e")][0]
d[k_new] = d[k_old]; json.dump(d, open("/root/.cache/specstack/width_costs.json", "w"), indent=1)
PY
  ;; new*) cp /work/runs/s15/width_costs.new.json $F ;; esac
  python -m specstack.cli bench --prompts humaneval --limit 20 --max-new-tokens 128 --threads 2 --methods "$M" \
    --out /work/runs/s15/curve_$r > /work/runs/s15/curve_$r.log 2>&1
done
cp /work/runs/s15/width_costs.new.json $F
echo done
