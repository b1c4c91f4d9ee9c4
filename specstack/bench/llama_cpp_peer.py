"""llama-cpp-python as a peer (`llamacpp`, `llamacpp-pld`), loaded in the peer's own process
(bench/peer_child.py): the same GGUF as the engine's, the prompt as token ids (same vocabulary), plain or
with llama-cpp-python's prompt-lookup drafting. Torch-free: the child imports only this.

Every generate here takes prompt token ids and returns exactly `n` new token ids: EOS does not stop it
(as the engine with stop_on_eos=False), so tokens/s compare like with like.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specstack.config import SamplingParams
from specstack.errors import SpecstackError
from specstack.machine import package_version

DIST = "llama_cpp_python"


def unavailable(is_gguf: bool) -> str | None:
    """Why llama-cpp-python cannot run the model here (None when it can), without importing it."""
    if not is_gguf:
        return "the model is not a GGUF file"
    if package_version(DIST) is None:
        return 'llama-cpp-python is not installed: pip install -e ".[peers]" (docs/benchmarks.md, Peers, has its flags)'
    return None


def load(gguf: str, threads: int, n_ctx: int, prompt_lookup: int = 0) -> tuple[Any, str]:
    """The model (with prompt-lookup drafting of `prompt_lookup` tokens when > 0) and what it is: the
    package's version and the instruction sets its llama.cpp was built with."""
    import llama_cpp
    from llama_cpp import Llama

    draft = None
    if prompt_lookup > 0:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup)
    llm = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, draft_model=draft,
                verbose=False)
    if llm is None:
        raise SpecstackError("llama-cpp-python cannot load this model here (see its log)")
    system = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    return llm, f"llama-cpp-python {package_version(DIST)}; {system}"


def generate(llm: Any, ids: Sequence[int], n: int, sampling: SamplingParams) -> dict[str, Any]:
    """Exactly n new tokens; the state is reset first so a repeated prompt pays its prefill again (no
    prefix-cache reuse)."""
    llm.reset()
    if sampling.seed is not None:
        llm.set_seed(sampling.seed)
    if sampling.greedy:
        kw = {"temp": 0.0, "top_k": 1, "top_p": 1.0}
    else:
        kw = {"temp": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}
    out: list[int] = []
    # generate() never stops by itself (EOS is the caller's business)
    for tok in llm.generate(list(ids), min_p=0.0, typical_p=1.0, repeat_penalty=1.0, reset=True, **kw):
        out.append(int(tok))
        if len(out) == n:
            break
    return {"tokens": out}
