"""OpenVINO GenAI as a peer (`openvino`, `openvino-pld`, `openvino-ir`, `openvino-spec`), loaded in the
peer's own process (bench/peer_child.py). `LLMPipeline` reads the same GGUF as the engine (GenAI's own GGUF
reader), or an OpenVINO IR with int4 weights exported from that GGUF's dequantized weights
(benchmarks/peers/export_openvino.sh); prompt lookup takes its n-gram size and draft length in the
config of every call; draft-model speculation takes a draft IR (GenAI refuses a GGUF draft). Torch-free:
the child imports only this.

Every generate takes prompt token ids and returns exactly `n` new token ids (`ignore_eos`), so tokens/s
compare like with like; the pipeline's prompt is the ids themselves (no chat template, no tokenizer).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specstack.config import SamplingParams
from specstack.files import cache_root
from specstack.machine import package_version

DIST = "openvino-genai"
IR_SUFFIX = "-int4-g32"  # benchmarks/peers/export_openvino.sh's folder: int4 weights, groups of 32


def ir_dir(model: str) -> Path:
    """Where benchmarks/peers/export_openvino.sh puts a registry model's int4 IR."""
    return cache_root() / "openvino" / f"{model}{IR_SUFFIX}"


def unavailable(is_gguf: bool, ir: Path | None = None) -> str | None:
    """Why OpenVINO GenAI cannot run the model here (None when it can), without importing it; `ir`: the IR
    folder the method needs, if it needs one."""
    if package_version(DIST) is None or package_version("openvino") is None:
        return 'openvino-genai is not installed: pip install -e ".[openvino]"'
    if ir is not None and not (ir / "openvino_model.xml").is_file():
        return f"no OpenVINO IR at {ir}: make it with benchmarks/peers/export_openvino.sh"
    if ir is None and not is_gguf:
        return "the model is not a GGUF file"
    return None


def load(model: str, threads: int, prompt_lookup: int = 0, ngram: int = 3, draft: str | None = None,
         draft_tokens: int = 5) -> tuple[Any, str]:
    """A pipeline on `model` (a GGUF file or an IR folder): plain, with prompt lookup (`prompt_lookup` draft
    tokens from n-grams up to `ngram`), or with a draft model (an IR folder, `draft_tokens` a step); and
    what it is: the versions and the precision the CPU plugin computes in."""
    import openvino as ov
    import openvino_genai as og

    props: dict[str, Any] = {"INFERENCE_NUM_THREADS": threads}
    if draft is not None:
        props["draft_model"] = og.draft_model(draft, "CPU", INFERENCE_NUM_THREADS=threads)
    pipe = og.LLMPipeline(model, "CPU", prompt_lookup=prompt_lookup > 0, **props)
    config = pipe.get_generation_config()
    if prompt_lookup > 0:
        config.num_assistant_tokens, config.max_ngram_size = prompt_lookup, ngram
    elif draft is not None:
        config.num_assistant_tokens = draft_tokens
    core = ov.Core()
    precision = core.get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()
    caps = ",".join(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
    about = (f"openvino-genai {package_version(DIST)}, openvino {ov.get_version()}; reads "
             f"{'the GGUF' if model.endswith('.gguf') else 'the int4 IR ' + model}; CPU plugin computes in "
             f"{precision} (capabilities {caps})")
    return (pipe, config), about


def generate(model: Any, ids: Sequence[int], n: int, sampling: SamplingParams) -> dict[str, Any]:
    """Exactly n new tokens (EOS ignored) for the prompt ids; a seeded sampler when sampling."""
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    pipe, config = model
    config.max_new_tokens, config.min_new_tokens, config.ignore_eos = n, 0, True
    config.do_sample = not sampling.greedy
    if not sampling.greedy:
        config.temperature, config.top_p = sampling.temperature, sampling.top_p
        if sampling.top_k:  # 0: off, GenAI's default (no limit) stays
            config.top_k = sampling.top_k
        if sampling.seed is not None:
            config.rng_seed = sampling.seed
    x = np.array([list(ids)], dtype=np.int64)
    result = pipe.generate(og.TokenizedInputs(ov.Tensor(x), ov.Tensor(np.ones_like(x))), config)
    return {"tokens": [int(t) for t in result.tokens[0][:n]]}
