#!/usr/bin/env bash
# OpenVINO's own int4 IR of a registry model, exported offline from the GGUF's dequantized weights, for
# the openvino_genai peer:  benchmarks/peers/export_openvino.sh qwen2.5-coder-1.5b
#   -> $SPECSTACK_CACHE/openvino/MODEL-int4-g32 (default ~/.cache/specstack) (openvino_model.xml + openvino_{de,}tokenizer.xml),
#      loadable by openvino_genai.LLMPipeline(dir, "CPU") in the main environment.
# Env: PYTHON (default python, 3.11: the local torch wheel is cp311), VENV (default $CACHE/venvs/ov-export),
#      SPECSTACK_CACHE (default ~/.cache/specstack, as specstack's own cache).
set -euo pipefail
MODEL=${1:?usage: $0 MODEL   (a registry GGUF model, e.g. qwen2.5-coder-1.5b)}
PYTHON=${PYTHON:-python}
CACHE=${SPECSTACK_CACHE:-$HOME/.cache/specstack}
VENV=${VENV:-$CACHE/venvs/ov-export}
HF_DIR=$CACHE/hf/$MODEL
OUT=$CACHE/openvino/$MODEL-int4-g32
cd "$(dirname "$0")/../.."

# A venv of its own: optimum-intel pins transformers 5.5.x, the main environment has 5.25.
if ! "$VENV/bin/python" -c "import optimum.intel, openvino_tokenizers" 2>/dev/null; then
  "$PYTHON" -m venv "$VENV"
  # torch first and pinned: it is the local CPU wheel; an unpinned one resolves to a multi-GB CUDA build.
  "$VENV/bin/pip" install torch==2.13.0
  # openvino and openvino-tokenizers must match the main env's openvino-genai 2026.4.1 (IR and tokenizer ops).
  "$VENV/bin/pip" install torch==2.13.0 openvino==2026.4.1 openvino-tokenizers==2026.4.1.0 \
    "optimum-intel[openvino]==2.2.0" optimum==2.3.0 nncf==3.4.0 transformers==5.5.4
  # torchvision (an optimum-intel dependency, unused for LLMs) is built against CUDA torch and fails to
  # load with torch+cpu ("operator torchvision::nms does not exist"); without it transformers skips it.
  "$VENV/bin/pip" uninstall -y torchvision
  "$VENV/bin/python" -c "import torch; assert torch.version.cuda is None, torch.__version__"
fi

# The bf16 HF checkpoint dequantized from the GGUF (main environment: it has the registry and transformers 5).
[ -f "$HF_DIR/model.safetensors" ] || "$PYTHON" benchmarks/peers/export_checkpoint.py "$MODEL" "$HF_DIR"

# --weight-format int4 without --sym: asymmetric int4 (scale + zero point), like Q4_K's scale + min.
# --group-size 32: Q4_K's sub-block size.  --ratio 1.0: every linear layer int4 (none kept int8).
# The embedding and lm_head stay int8_asym per-channel (NNCF's backup precision; no --all-layers).
# No --dataset: data-free round-to-nearest, as llama.cpp's quantize is without an imatrix.
# The tokenizer and detokenizer IR come from openvino-tokenizers in the venv.
mkdir -p "$(dirname "$OUT")"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VENV/bin/optimum-cli" export openvino \
  --model "$HF_DIR" --task text-generation-with-past \
  --weight-format int4 --group-size 32 --ratio 1.0 "$OUT"
ls -la "$OUT"
