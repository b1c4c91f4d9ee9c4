"""The one builder of the tests' tiny random checkpoints: a family, its sizes and a seed -> a Hugging Face
folder (and the transformers model it holds). tests/conftest.py (a target of each family),
tests/lossless/conftest.py (drafts, the V = 8 pair) and `build_tiny_checkpoint` / `build_fim_checkpoint`
below (a Llama with the default model's tokenizer, for the command line, the server and the fuzz fixtures
of tests/fuzz/) all build through `Tiny.save`, so a checkpoint is named by its `Tiny` alone and the same
spec always gives the same weights."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Larger than transformers' default (0.02) so logits spread over several units: near-ties are rare
# and a wrong mask or position changes logits far beyond the 1e-4 tolerance of the parity tests.
INIT_RANGE = 0.15
VOCAB = 257
MAX_POS = 256
TINY_CONTEXT = 64  # the context of the default-tokenizer checkpoints below

# family -> (config class, model class) in transformers
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


@dataclass(frozen=True)
class Tiny:
    """A tiny random checkpoint. A field left None takes transformers' default for the family."""

    family: str
    seed: int  # torch's global seed just before the model is built (and its extra spread drawn)
    vocab: int = VOCAB
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2  # not gpt2
    ff: int | None = None  # the MLP's width
    head_dim: int | None = None  # qwen3: a head size other than hidden / heads
    max_pos: int = MAX_POS
    init: float | None = INIT_RANGE  # initializer_range
    rope_theta: float | None = None
    eps: float | None = None  # rms_norm_eps
    tie: bool | None = None  # tie_word_embeddings
    bos: int | None = 1
    eos: int | None = 2

    def config(self) -> Any:
        import transformers

        cls = getattr(transformers, CLASSES[self.family][0])
        if self.family == "gpt2":
            kw = {"vocab_size": self.vocab, "n_embd": self.hidden, "n_layer": self.layers, "n_head": self.heads,
                  "n_positions": self.max_pos, "n_inner": self.ff, "initializer_range": self.init,
                  "bos_token_id": self.bos, "eos_token_id": self.eos, "tie_word_embeddings": self.tie}
        else:
            kw = {"vocab_size": self.vocab, "hidden_size": self.hidden, "num_hidden_layers": self.layers,
                  "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                  "intermediate_size": self.ff, "head_dim": self.head_dim, "max_position_embeddings": self.max_pos,
                  "rope_theta": self.rope_theta, "rms_norm_eps": self.eps, "initializer_range": self.init,
                  "bos_token_id": self.bos, "eos_token_id": self.eos, "tie_word_embeddings": self.tie}
        return cls(**{k: v for k, v in kw.items() if v is not None})

    def build(self) -> torch.nn.Module:
        """The transformers model (fp32, eval), its weights drawn from `seed`."""
        import transformers

        cfg = self.config()
        torch.manual_seed(self.seed)
        model = getattr(transformers, CLASSES[self.family][1])(cfg).float().eval()
        _spread(self.family, model)
        return model

    def save(self, path: Path, tokenizer: Any = None) -> torch.nn.Module:
        """Build it into the folder `path` (with `tokenizer`'s files, if given); returns the model."""
        model = self.build()
        model.save_pretrained(str(path))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
        return model


@torch.no_grad()
def _spread(family: str, model: torch.nn.Module) -> None:
    """What a family's defaults leave too uniform for a missing piece to show, drawn after the weights:
    qwen2's q/k/v biases (0 by default) as widely as the weights, so a dropped or misplaced bias moves logits
    far past the tolerance; qwen3's q/k norm weights (1 by default) in [0.5, 1.5], so a missing norm shows."""
    for name, p in model.named_parameters():
        if family == "qwen2" and name.endswith(".bias"):
            p.normal_(0, INIT_RANGE)
        elif family == "qwen3" and name.endswith(("q_norm.weight", "k_norm.weight")):
            p.uniform_(0.5, 1.5)


def llama(seed: int, vocab: int, layers: int, hidden: int, max_pos: int, init: float | None) -> Tiny:
    """A Llama with 4 heads over 2 KV heads and an MLP twice as wide as the model (the tests' drafts)."""
    return Tiny("llama", seed, vocab=vocab, hidden=hidden, layers=layers, ff=2 * hidden, max_pos=max_pos, init=init,
                rope_theta=10000.0, eps=1e-6, tie=False)


def build_tiny_checkpoint(path: Path, context: int = TINY_CONTEXT) -> Path:
    """A random Llama checkpoint with the default model's tokenizer (read from its GGUF, offline)."""
    from specstack.models.loading import load_tokenizer
    from specstack.models.registry import DEFAULT_MODEL, resolve

    tok = load_tokenizer(resolve(DEFAULT_MODEL), None)
    Tiny("llama", 0, vocab=len(tok), hidden=64, layers=2, ff=128, max_pos=context, init=None, tie=True,
         bos=tok.bos_token_id, eos=tok.eos_token_id).save(path, tok)
    return path


FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


def fim_tokenizer() -> Any:
    """The default model's tokenizer with Qwen2.5-Coder's fill-in-the-middle tokens added (the default model
    has none): what a FIM checkpoint of the tests reads."""
    from specstack.models.loading import load_tokenizer
    from specstack.models.registry import DEFAULT_MODEL, resolve

    tok = load_tokenizer(resolve(DEFAULT_MODEL), None)
    tok.add_special_tokens({"additional_special_tokens": list(FIM_TOKENS)})
    return tok


def build_fim_checkpoint(path: Path, context: int = TINY_CONTEXT) -> Path:
    """A random Llama checkpoint whose tokenizer has Qwen2.5-Coder's FIM tokens (fim.py finds them)."""
    tok = fim_tokenizer()
    Tiny("llama", 7, vocab=len(tok), hidden=64, layers=2, ff=128, max_pos=context, init=None, tie=True,
         bos=tok.bos_token_id, eos=tok.eos_token_id).save(path, tok)
    return path
