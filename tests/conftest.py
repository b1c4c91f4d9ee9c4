"""Shared fixtures: tiny random transformers models (Llama with GQA, GPT-2, Qwen2, Qwen3), saved as checkpoints and
loaded back through specstack's own loader, so every parity test compares the two implementations
on exactly the same weights."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from families import ALL_FAMILIES, ENGINE_FAMILIES

from specstack.models.base import LoadedModel
from specstack.models.loading import load_model

VOCAB = 257
MAX_POS = 256
# Larger than transformers' default (0.02) so logits spread over several units: near-ties are rare
# and a wrong mask or position changes logits far beyond the 1e-4 tolerance of the parity tests.
INIT_RANGE = 0.15


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


def _llama(path: Path) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=MAX_POS, rope_theta=10000.0, rms_norm_eps=1e-6,
        initializer_range=INIT_RANGE, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    torch.manual_seed(1234)
    return LlamaForCausalLM(cfg).float().eval()


def _gpt2(path: Path) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=MAX_POS,
        initializer_range=INIT_RANGE, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
    )
    torch.manual_seed(4321)
    return GPT2LMHeadModel(cfg).float().eval()


def _qwen2(path: Path) -> torch.nn.Module:
    """Llama plus q/k/v biases (models/architectures.py); biases drawn as widely as the weights, so a
    dropped or misplaced bias moves logits far past the tolerance."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, max_position_embeddings=MAX_POS, rope_theta=1e6, rms_norm_eps=1e-6,
        initializer_range=INIT_RANGE, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    torch.manual_seed(2468)
    model = Qwen2ForCausalLM(cfg).float().eval()
    _random_biases(model)
    return model


def _qwen3(path: Path) -> torch.nn.Module:
    """q/k norms over each head, an explicit head size (d_model != heads x head_dim), tied embeddings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=96, max_position_embeddings=MAX_POS, rms_norm_eps=1e-6,
        initializer_range=INIT_RANGE, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )
    torch.manual_seed(1357)
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # norm weights start at 1: spread them so a missing q/k norm shows
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    return model


def _random_biases(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, INIT_RANGE)


BUILDERS = {"llama": _llama, "gpt2": _gpt2, "qwen2": _qwen2, "qwen3": _qwen3}
assert tuple(BUILDERS) == ALL_FAMILIES


def _build(arch: str, root: Path) -> TinyModel:
    path = root / arch
    hf = BUILDERS[arch](path)
    hf.save_pretrained(str(path))
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

