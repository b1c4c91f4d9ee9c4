"""Shared fixtures: tiny random transformers models (Llama with GQA, GPT-2, Qwen2, Qwen3), saved as checkpoints and
loaded back through specstack's own loader, so every parity test compares the two implementations
on exactly the same weights."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from families import ALL_FAMILIES, ENGINE_FAMILIES
from tiny_checkpoints import VOCAB, Tiny

from specstack.models.base import LoadedModel
from specstack.models.loading import load_model


@dataclass
class TinyModel:
    arch: str
    hf: torch.nn.Module  # the transformers model (fp32, eval)
    lm: LoadedModel  # the same weights loaded by specstack (fp32)
    path: Path

    @torch.no_grad()
    def hf_logits(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """HF logits [T, V] (fp32) of one sequence run from scratch."""
        t = torch.as_tensor(ids, dtype=torch.long).view(1, -1)
        return self.hf(t).logits[0].float()


# One target per family (V = 257, context 256, weights drawn with INIT_RANGE). qwen2: Llama plus q/k/v biases
# (models/architectures.py), drawn as widely as the weights; qwen3: q/k norms over each head (spread around 1),
# an explicit head size (d_model != heads x head_dim), tied embeddings.
BUILDERS = {
    "llama": Tiny("llama", 1234, layers=3, ff=128, rope_theta=10000.0, eps=1e-6, tie=False),
    "gpt2": Tiny("gpt2", 4321, bos=VOCAB - 1, eos=VOCAB - 1),
    "qwen2": Tiny("qwen2", 2468, ff=96, rope_theta=1e6, eps=1e-6, tie=False),
    "qwen3": Tiny("qwen3", 1357, ff=96, head_dim=32, eps=1e-6, tie=True),
}
assert tuple(BUILDERS) == ALL_FAMILIES


def _build(arch: str, root: Path) -> TinyModel:
    path = root / arch
    hf = BUILDERS[arch].save(path)
    lm = load_model(str(path), dtype="fp32", use_cache=False, tokenizer=False)
    return TinyModel(arch, hf, lm, path)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: _build(arch, root) for arch in BUILDERS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, TinyModel]) -> TinyModel:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_gpt2(tiny_models: dict[str, TinyModel]) -> TinyModel:
    return tiny_models["gpt2"]


@pytest.fixture(params=ENGINE_FAMILIES)
def tiny(request: pytest.FixtureRequest, tiny_models: dict[str, TinyModel]) -> TinyModel:
    """Each test taking `tiny` runs on each block flavour of ENGINE_FAMILIES."""
    return tiny_models[request.param]

