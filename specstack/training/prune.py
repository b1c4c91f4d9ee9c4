"""Build a SPIRe draft for a target: pruned initialisation (DESIGN §7 (b)) or a random start.

Pruning keeps the target's embedding and unembedding (shared at run time, never copied into the
draft's file), the chosen blocks (the paper keeps the last two) and the final norm. The draft's
vocabulary can be cut to the most frequent tokens (`vocab_ids`)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from specstack.config import WindowSpec
from specstack.errors import SpecstackError
from specstack.models.draft_file import shared_weights
from specstack.models.spire_draft import SpireConfig, SpireDraft
from specstack.models.transformer import Transformer
from specstack.weight_formats import weight_format

DEFAULT_WINDOW = WindowSpec(1, 256)  # sink 1 + window 256, in training and inference


def last_blocks(n_target_layers: int, n: int) -> tuple[int, ...]:
    return tuple(range(n_target_layers - n, n_target_layers))


def build_draft(target: Transformer, n_layers: int = 2, keep: Sequence[int] | None = None,
                window: WindowSpec | None = DEFAULT_WINDOW, feedback: bool = True,
                target_acts: bool = True, vocab_ids: torch.Tensor | None = None, seed: int = 0,
                feature_input: bool = False) -> SpireDraft:
    """A draft for `target` (an fp32 or bf16 Transformer). keep: target block per draft block
    (pruned init); None starts from random weights. With target activations, draft level i reads the
    target's hidden state after its block keep[i - 1] (after its last n_layers blocks if not pruned)."""
    tcfg = target.config
    if not weight_format(target.fmt).floats:
        raise SpecstackError(f"building a draft needs float target weights, got {target.fmt}")
    if keep is not None and (len(keep) != n_layers or not all(0 <= k < tcfg.n_layers for k in keep)):
        raise SpecstackError(f"keep {tuple(keep)}: {n_layers} block indices of the target's {tcfg.n_layers} needed")
    src = tuple(keep) if keep is not None else last_blocks(tcfg.n_layers, n_layers)
    config = SpireConfig(
        replace(tcfg, n_layers=n_layers),
        window=window,
        feedback=feedback and target_acts,
        target_layers=tuple(k + 1 for k in src) if target_acts else (),
        init="pruned:" + ",".join(map(str, keep)) if keep is not None else "random",
        feature_input=feature_input and target_acts,
    )
    torch.manual_seed(seed)
    draft = SpireDraft(config, vocab_ids)
    if keep is None:
        for blk in draft.layers:  # small init, as for a model trained from scratch
            for lin in (blk.qkv, blk.o, blk.up, blk.down):
                torch.nn.init.normal_(lin.weight, std=0.02)
                if lin.bias is not None:
                    torch.nn.init.zeros_(lin.bias)
    else:
        copy_blocks(draft, target, keep)
    return draft.attach_target(*(w.float() for w in shared_weights(target)))


@torch.no_grad()
def copy_blocks(draft: SpireDraft, target: Transformer, keep: Sequence[int]) -> None:
    """Draft block i <- target block keep[i] (fused QKV and gate/up, as the target stores them; biases
    where the target has them)."""
    for blk, k in zip(draft.layers, keep, strict=True):
        src = target.layers[k]
        blk.attn_norm.weight.copy_(src.attn_norm.weight.float())
        blk.mlp_norm.weight.copy_(src.mlp_norm.weight.float())
        for name in ("qkv", "o", "up", "down"):
            dst, from_ = getattr(blk, name), getattr(src, name)
            dst.weight.copy_(from_.weight.float())
            if dst.bias is not None:  # Qwen2's q/k/v biases
                dst.bias.copy_(from_.bias.float())
    draft.norm.copy_(target.norm.weight.float())
