"""transformers as a peer, on the same model file: `generate`, prompt lookup, assisted generation. The
other peers (llama.cpp's library and servers, OpenVINO GenAI) run in processes of their own: the table of
peers is bench/peer_table.py.

Every generate function here takes prompt token ids and returns exactly `n` new token ids: EOS does
not stop it (as the engine with stop_on_eos=False), so tokens/s compare like with like.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from specstack.config import SamplingParams
from specstack.machine import package_version
from specstack.models.registry import ModelSource

HF_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ---------------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------------
def hf_dtype(dtype: str) -> str:
    """transformers runs bf16 and fp32 only: the quantized formats fall back to bf16."""
    return dtype if dtype in HF_DTYPES else "bf16"


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def load_hf(src: ModelSource, dtype: str, device: str = "cpu") -> Any:
    """transformers' model of the same source (a GGUF is dequantized by transformers) in `dtype`."""
    from transformers import AutoModelForCausalLM

    with _quiet_transformers():
        if src.kind == "gguf":
            model = AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name,
                                                         dtype=HF_DTYPES[dtype])
        else:
            model = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=HF_DTYPES[dtype])
    return model.to(device).eval()


class ForwardCounter:
    """Counts forward calls of a transformers model (a hook on its top module)."""

    def __init__(self, model: Any) -> None:
        self.calls = 0
        model.register_forward_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.calls += 1


def hf_generate(model: Any, ids: Sequence[int], n: int, sampling: SamplingParams, pad_id: int | None,
                **extra: Any) -> list[int]:
    """Exactly n new tokens with transformers' `generate` (extra: prompt_lookup_num_tokens=,
    assistant_model=). eos_token_id=None keeps EOS from stopping (and, unlike min_new_tokens, from
    being suppressed), so the output follows the model as the engine's does."""
    x = torch.tensor([list(ids)], device=model.device)
    kw = _sampling_kwargs(sampling)
    with _quiet_transformers(), torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, eos_token_id=None,
                             pad_token_id=0 if pad_id is None else pad_id, **kw, **extra)
    return out[0, len(ids):].tolist()


def hf_generate_batch(model: Any, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams,
                      pad_id: int | None) -> list[list[int]]:
    """Exactly n new tokens for every prompt, all rows in one batched `generate`: prompts padded on the
    left (their ends line up where generation starts; the attention mask hides the padding), as
    transformers' docs prescribe for batched generation with a decoder-only model. EOS stops no row
    (eos_token_id=None, as hf_generate)."""
    pad = 0 if pad_id is None else pad_id
    width = max(len(p) for p in prompts)
    x = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    kw = _sampling_kwargs(sampling)
    with _quiet_transformers(), torch.inference_mode():
        out = model.generate(x, attention_mask=mask, max_new_tokens=n, eos_token_id=None, pad_token_id=pad, **kw)
    return out[:, width:].tolist()


def _sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """`generate`'s decoding arguments for our sampling parameters (seeding torch when sampling)."""
    if sampling.greedy:
        return {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    return {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,  # 0: off, as ours
            "top_p": sampling.top_p}


def hf_about(dtype: str, device: str) -> str:
    """What runs the transformers peers: the versions, the weights' dtype, the device."""
    return f"transformers {package_version('transformers')}, torch {package_version('torch')}, {dtype}, {device}"
