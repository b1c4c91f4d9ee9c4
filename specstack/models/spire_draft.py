"""The SPIRe draft model (DESIGN §7): a few Llama blocks built for cheap drafting.

What makes it a SPIRe draft, each part switchable for ablations (SpireConfig):
(a) sliding-window KV: every query sees the first `sink` positions and the last `window` (training too);
(b) pruned initialisation from the target (prune.py): its embedding and unembedding are shared, not
    copies, and its blocks start as chosen target blocks (the paper keeps the last two);
(c) feedback memory: the keys/values a block keeps for a token come from a *memory*, a learned mix
    m_t = sum_l softmax(w_i)_l x^l_t of all the token's layer outputs x^0 (embedding) .. x^L, instead of
    from the block's own input; a token is therefore a context only once its whole pass is done;
(d) target activations: for tokens the target has verified, the levels x^1..x^L are the target's
    own hidden states at `target_layers` (returned by its scoring forward at no extra cost), so the
    draft reads the target's deep features of the whole verified context.
(e) feature input (EAGLE's idea, an addition to SPIRe): the stream of token t starts from its
    embedding plus a projection of the top-level feature of token t - 1: the target's final hidden
    state when t - 1 is verified, else the draft's own. It starts at zero (the plain SPIRe draft).
With (c) off a block's memory is its own input level (a plain decoder). Without (d), (c) and (e) are
off as well: feedback over the draft's own levels would make every prefill sequential.

A reduced draft vocabulary (`vocab_ids`, the most frequent tokens) shrinks the unembedding, the
largest cost of a small draft at 49k tokens; the draft's probability of every other token is 0,
which verification handles like any other draft distribution.

Two forwards share the blocks, each a transformer.Block (the target's own block, over trainable parts):
- `forward(tokens, batch, cache)`: the engine's interface (a DecoderModel, models/base.py: a drafter
  runs it like any model). Tokens of one forward see the cache (memories) and themselves; after the
  pass their memories replace the keys/values they were written with. `write_memories` stores
  verified tokens from target hidden states without running the draft (ReadsTargetActivations).
- `train_forward`: the same computation for a whole sequence at once, unrolled for k draft steps:
  draft step j at position t sees target memories before t - j + 1 and, for the j - 1 tokens after
  them, the memories the draft made itself in steps j - r (exactly what a chain of k drafts sees).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specstack.attention import AttentionBatch, causal_block_mask, unrolled_step_mask, window_mask
from specstack.cache import KVCache, cache_slots
from specstack.config import ModelConfig, WindowSpec
from specstack.errors import SpecstackError
from specstack.models.base import Extends, ModelOutput
from specstack.models.feature_cache import FeatureCache
from specstack.models.quant import QLinear
from specstack.models.row_ops import apply_rope, rms_norm
from specstack.models.transformer import Block, BlockCache, Norm, blocks_of, register_rope


@dataclass(frozen=True)
class SpireConfig:
    model: ModelConfig  # the draft's shape: the target's widths, n_layers = draft blocks, full vocab_size
    window: WindowSpec | None = field(default_factory=lambda: WindowSpec(1, 256))  # (a); None = full
    feedback: bool = True  # (c)
    target_layers: tuple[int, ...] = ()  # (d): target hidden layer per draft level 1..L; () = off
    init: str = "random"  # (b): "pruned:28,29" (target blocks) or "random"; a record of how it started
    feature_input: bool = False  # (e) EAGLE-style: the previous token's top-level feature joins the input

    def __post_init__(self) -> None:
        b = self.model.block
        if (b.norm, b.activation, b.position, b.o_bias, b.mlp_bias, b.qk_norm) != (
                "rms", "swiglu", "rope", False, False, False):
            raise SpecstackError("SPIRe drafts are Llama blocks (RMSNorm, SwiGLU, RoPE, biases on q/k/v at most, as "
                                 f"Qwen2's): the target's {self.model.arch} blocks are not")
        if self.target_layers and len(self.target_layers) != self.model.n_layers:
            raise SpecstackError(f"target_layers {self.target_layers}: one target layer per draft block "
                                 f"({self.model.n_layers}) is needed")
        if self.feedback and not self.target_layers:
            raise SpecstackError("feedback memory needs target activations (without them every prefill "
                                 "would run token by token)")
        if self.feature_input and not self.target_layers:
            raise SpecstackError("feature input needs target activations")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> SpireConfig:
        d = json.loads(text)
        m = d.pop("model")
        m["eos_token_ids"] = tuple(m["eos_token_ids"])
        w = d.pop("window")
        return SpireConfig(ModelConfig(**m), WindowSpec(**w) if w else None,
                           target_layers=tuple(d.pop("target_layers")), **d)


@dataclass(frozen=True)
class TrainableParts:
    """The draft's block parts (transformer.BlockParts): plain nn.Linear layers and norms that take
    gradients, in fp32; SpireDraft.quantize_ puts the layers in a small weight format for inference."""

    def linear(self, name: str, n_in: int, n_out: int, bias: bool) -> nn.Linear:
        return nn.Linear(n_in, n_out, bias=bias)

    def norm(self, dim: int, eps: float, rms: bool) -> Norm:
        return Norm(dim, eps, rms, torch.float32, trainable=True)


# A block's tensors by the names draft files store them under (the shipped drafts and every file
# train-draft wrote, from before the draft's blocks were transformer.Blocks, whose norms are modules):
# a state dict is written with the stored names and read with either, so old and new files are alike.
STORED_NAMES = {"attn_norm.weight": "attn_norm", "mlp_norm.weight": "mlp_norm"}


def _to_stored_names(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
    for own, stored in STORED_NAMES.items():
        if prefix + own in state:
            state[prefix + stored] = state.pop(prefix + own)


def _from_stored_names(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
    for own, stored in STORED_NAMES.items():
        if prefix + stored in state:
            state[prefix + own] = state.pop(prefix + stored)


class DraftBlock(Block[nn.Linear | QLinear]):
    """A transformer.Block (a Llama block, with Qwen2's q/k/v biases where its target has them) over
    trainable parts, plus what SPIRe adds: the memory mix over levels (c) and kv_proj, the keys and
    values of memories. Trained as nn.Linear; SpireDraft.quantize_ replaces them with QLinear."""

    def __init__(self, cfg: ModelConfig, n_levels: int, layer: int) -> None:
        super().__init__(cfg, layer, TrainableParts())
        # memory mix over levels 0..L; starts leaning on the block's own input level (a plain decoder)
        mix = torch.zeros(n_levels)
        mix[layer] = 2.0
        self.mix = nn.Parameter(mix)
        self.kv: QLinear | None = None  # quantize_: the k/v rows of qkv in the small format
        self.register_state_dict_post_hook(_to_stored_names)
        self.register_load_state_dict_pre_hook(_from_stored_names)

    def kv_proj(self, h: torch.Tensor) -> torch.Tensor:
        """Keys and values [.., 2 * kv_dim] of normed memories: qkv's k/v rows only. A memory needs
        no query, and the q rows are 60 % of qkv's weights, read cold after each target forward."""
        if self.kv is not None:
            return self.kv(h)
        bias = self.qkv.bias
        return F.linear(h, self.qkv.weight[self.cfg.q_dim :].to(h.dtype),
                        None if bias is None else bias[self.cfg.q_dim :].to(h.dtype))


@dataclass(frozen=True)
class UnrolledKeys:
    """What a block's queries see in train_forward, handed to it as a cache would (transformer.BlockCache):
    the memories of earlier sources, per block (`earlier`: (keys, values), each [layers, B, Hkv, T, D]: the
    target's, then the draft's own of earlier steps), followed by the keys/values the block writes."""

    earlier: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.earlier:
            return k, v
        return (torch.cat([kv[0][layer] for kv in self.earlier] + [k], 2),
                torch.cat([kv[1][layer] for kv in self.earlier] + [v], 2))


def features(cache: KVCache) -> FeatureCache:
    """The cache of a draft with feature input: one that keeps a feature a slot (its new_cache gives it)."""
    if not isinstance(cache, FeatureCache):
        raise ValueError("feature input needs a cache that keeps features (new_cache gives it one)")
    return cache

class SpireDraft(Extends, nn.Module):
    """A DecoderModel that reads the target's activations (ReadsTargetActivations: models/base.py)."""

    # buffers (register_buffer), declared for the type checker
    vocab_ids: torch.Tensor  # [V'] the target's token ids the draft's head scores
    embed: torch.Tensor  # [V, d] the target's embedding (attach_target), not stored with the draft
    head: torch.Tensor  # [V', d] the target's unembedding rows vocab_ids (attach_target)
    rope_cos: torch.Tensor  # register_rope
    rope_signed_sin: torch.Tensor
    fuse: nn.Linear | QLinear  # feature input only; quantize_ replaces it

    def __init__(self, config: SpireConfig, vocab_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.spire = config
        self.config = config.model  # what the engine's drafters read (n_layers, max_seq_len, ...)
        cfg = config.model
        n_levels = cfg.n_layers + 1
        self.layers = nn.ModuleList(DraftBlock(cfg, n_levels, i) for i in range(cfg.n_layers))
        self.norm = nn.Parameter(torch.ones(cfg.d_model))
        if config.feature_input:  # starts at zero: the draft begins as if it had no feature input
            self.fuse_norm = nn.Parameter(torch.ones(cfg.d_model))
            self.fuse = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
            nn.init.zeros_(self.fuse.weight)
        ids = torch.arange(cfg.vocab_size) if vocab_ids is None else vocab_ids.long()
        self.register_buffer("vocab_ids", ids)
        # shared with the target, never stored with the draft: set by attach_target()
        self.register_buffer("embed", torch.zeros(0, cfg.d_model), persistent=False)
        self.register_buffer("head", torch.zeros(0, cfg.d_model), persistent=False)
        self.head_q: QLinear | None = None  # the unembedding in a small weight format (quantize_)
        register_rope(self, cfg)

    # -- set-up ---------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.norm.device

    def blocks(self) -> list[DraftBlock]:
        return blocks_of(self.layers, DraftBlock)

    @property
    def target_hidden_layers(self) -> tuple[int, ...]:
        """Target hidden states the draft reads for verified tokens (() = it runs them itself)."""
        return self.spire.target_layers

    def attach_target(self, embed: torch.Tensor, unembed: torch.Tensor) -> SpireDraft:
        """Share the target's embedding [V, d]; the draft's unembedding is the target's, rows vocab_ids."""
        shape = (self.config.vocab_size, self.config.d_model)
        if embed.shape != shape or unembed.shape != shape:
            raise SpecstackError(f"target embedding {tuple(embed.shape)} / unembedding {tuple(unembed.shape)} "
                                 f"do not fit the draft's {shape}")
        self.embed = embed
        self.head = unembed[self.vocab_ids.to(unembed.device)].to(self.norm.dtype).contiguous()
        return self

    def new_cache(self, batch_size: int = 1, capacity: int | None = None,
                  window: WindowSpec | None = None, max_rows: int | None = None,
                  max_capacity: int | None = None) -> KVCache:
        """window: None (or the draft's own): the window the draft was trained with, used in any case."""
        if window is not None and window != self.spire.window:
            raise SpecstackError(f"this SPIRe draft was trained with the window {self.spire.window}, not {window}")
        cap, most = cache_slots(self.config, capacity, max_capacity)
        if self.spire.feature_input:  # its slots keep each token's top-level feature too
            return FeatureCache(self.config, batch_size, cap, self.norm.dtype, self.device, self.spire.window,
                                self.config.d_model, max_rows, most)
        return KVCache(self.config, batch_size, cap, self.norm.dtype, self.device, self.spire.window, max_rows, most)

    def _rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope_cos[pos].unsqueeze(-2).to(dtype), self.rope_signed_sin[pos].unsqueeze(-2).to(dtype)

    def _memories_kv(self, levels: Sequence[torch.Tensor],
                     rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [layers, B, Hkv, T, D] that every block keeps for tokens whose levels x^0..x^L
        ([B, T, d] each) are known: block i's memory is its mix of the levels (its own input level
        without feedback), normed and projected by its qkv's k/v rows (kv_proj). All blocks at once
        (one mix, one norm, one RoPE, one cache write): at one token per forward these small kernels
        cost more than the projections themselves."""
        cfg = self.config
        n = len(self.layers)
        if self.spire.feedback:
            # one fp32 matmul [layers, levels] @ [levels, B*T*d]: cheaper than bf16's at any T on CPU
            # (docs/bench-history, "Cost per forward: SPIRe's extra work is not free at one token")
            w = torch.softmax(torch.stack([blk.mix for blk in self.blocks()]).float(), -1)
            stacked = torch.stack(list(levels))
            memories = torch.mm(w, stacked.view(len(levels), -1).float()).to(stacked.dtype).view(n, *stacked.shape[1:])
        else:
            memories = torch.stack(list(levels[:n]))  # a plain decoder: block i keeps its own input
        norm_w = torch.stack([blk.attn_norm.weight for blk in self.blocks()]).to(memories.dtype)[:, None, None]
        h = rms_norm(memories, norm_w, cfg.norm_eps)
        kv = torch.stack([blk.kv_proj(h[i]) for i, blk in enumerate(self.blocks())])
        _, b, t, _ = kv.shape
        k = apply_rope(kv[..., : cfg.kv_dim].view(n, b, t, cfg.n_kv_heads, cfg.head_dim), *rope)
        v = kv[..., cfg.kv_dim :].view(n, b, t, cfg.n_kv_heads, cfg.head_dim)
        return k.transpose(2, 3), v.transpose(2, 3)

    def _fused(self, x0: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The stream's input: token embedding plus the projected top-level feature of the token before."""
        f = rms_norm(prev, self.fuse_norm.to(prev.dtype), self.config.norm_eps)
        return x0 + self.fuse(f)

    def _previous_features(self, batch: AttentionBatch, cache: KVCache) -> torch.Tensor:
        """For each new token, the cached feature of the token at position - 1 on its path (a finished
        token: committed, or run by an earlier forward of this round); zeros where there is none
        (the first position, or a parent inside this same block)."""
        pos = batch.positions
        b, t = pos.shape
        d = self.config.d_model
        starts = features(cache).block_start()
        s = max(starts)
        if s == 0:
            return torch.zeros(b, t, d, dtype=self.norm.dtype, device=pos.device)
        # (a packed forward, [1, N] over several rows, never reaches here: only drafts that read the
        # target's activations have feature input, and their forwards are never packed)
        cand = cache.slot_pos[:b, :s].unsqueeze(1) == (pos - 1).unsqueeze(-1)  # the live rows
        if min(starts) < s:  # a row whose block starts earlier: its slots from there are this block's own
            slot = torch.arange(s, device=pos.device)
            cand &= slot < torch.tensor(starts, device=pos.device)[:, None, None]
        if batch.mask is not None:
            cand &= batch.mask[:, 0, :, :s]
        idx = cand.int().argmax(-1)
        feat = torch.gather(features(cache).feat[:b, :s], 1, idx.unsqueeze(-1).expand(b, t, d))
        return feat * cand.any(-1, keepdim=True)

    def _blocks(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch,
                cache: BlockCache) -> list[torch.Tensor]:
        """The blocks' outputs x^1..x^L [B, T, d] for the stream x [B, T, d] (transformer.Block.forward,
        which keeps it [B * T, d]); each block writes its keys/values to `cache` and attends to what it
        hands back."""
        b, t, d = x.shape
        h = x.reshape(b * t, d)
        out = []
        for blk in self.blocks():
            h = blk.forward(h, rope, batch, cache)
            out.append(h.view(b, t, d))
        return out

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.norm.to(x.dtype), self.config.norm_eps)
        if self.head_q is not None:
            return self.head_q(h)
        return F.linear(h, self.head.to(x.dtype))

    @torch.no_grad()
    def quantize_(self, fmt: str) -> SpireDraft:
        """For inference: the blocks' linears, the feature projection and the (attached) unembedding
        in a small weight format: at one row the int8/int4 kernels stream the weights faster than the
        CPU's bf16 matmul (docs/bench-history, "Cheaper draft forwards, trees sized by cost"); from
        QLinear's wide_rows on they multiply by the dense copy (full bf16 speed)."""
        if not self.head.numel():
            raise ValueError("attach the target's embeddings before quantising the draft")

        act = self.norm.dtype  # the kernels take fp32 activations too (a draft that computes in fp32)

        def small(lin: nn.Linear | QLinear) -> QLinear:
            if not isinstance(lin, nn.Linear):
                raise ValueError("the draft is quantised already")
            return QLinear.of_float(lin.weight, lin.bias, fmt, act)

        for blk in self.blocks():
            qkv = blk.qkv
            if not isinstance(qkv, nn.Linear):
                raise ValueError("the draft is quantised already")
            # the k/v rows quantised on their own give the same codes and scales (per-row formats)
            kv_bias = None if qkv.bias is None else qkv.bias[self.config.q_dim :]
            blk.kv = QLinear.of_float(qkv.weight[self.config.q_dim :], kv_bias, fmt, act)
            blk.qkv, blk.o, blk.up, blk.down = small(blk.qkv), small(blk.o), small(blk.up), small(blk.down)
            blk.gather_parts()
        if self.spire.feature_input:
            self.fuse = small(self.fuse)
        self.head_q = QLinear.of_float(self.head, None, fmt, act)
        return self

    def _levels_from_target(self, tokens: torch.Tensor, hidden: torch.Tensor) -> list[torch.Tensor]:
        """hidden [B, T, L, d] -> levels x^0..x^L: the embedding, then the target's hidden states."""
        x0 = F.embedding(tokens, self.embed).to(self.norm.dtype)
        return [x0] + [hidden[:, :, j].to(x0.dtype) for j in range(hidden.shape[2])]

    # -- the engine's forward -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, batch: AttentionBatch, cache: KVCache,
                hidden_layers: Sequence[int] = (), logit_rows: slice | torch.Tensor = slice(None)) -> ModelOutput:
        """DecoderModel.forward (models/base.py); the logits' columns are the draft's vocabulary
        (out.vocab_ids): spreading them over all 49k tokens cost more than the draft's head. logit_rows:
        a slice of each row's positions, or a tensor of indices into the flattened B * T tokens
        (logits [1, len, V'])."""
        cache.begin_block(batch.positions, batch.append, batch.counts)
        rope = self._rope(batch.positions, self.norm.dtype)
        x0 = F.embedding(tokens, self.embed).to(self.norm.dtype)
        x = self._fused(x0, self._previous_features(batch, cache)) if self.spire.feature_input else x0
        levels = [x0, *self._blocks(x, rope, batch, cache)]
        x = levels[-1]
        if self.spire.feedback:  # later forwards see these tokens through their memories
            cache.write_layers(*self._memories_kv(levels, rope))
        if self.spire.feature_input:
            features(cache).write_feature(x)
        picked = (x.reshape(-1, x.shape[-1]).index_select(0, logit_rows).unsqueeze(0)
                  if isinstance(logit_rows, torch.Tensor) else x[:, logit_rows])
        return ModelOutput(self._logits(picked).float(), {j: levels[j] for j in hidden_layers}, self.vocab_ids)

    @torch.inference_mode()
    def write_memories(self, tokens: torch.Tensor, hidden: torch.Tensor, cache: KVCache,
                       counts: Sequence[int] | None = None) -> None:
        """Commit verified tokens [1, T] to the cache from the target's hidden states [1, T, L, d] (no draft
        pass): their memories are mixed from the target's levels. counts: the tokens are packed, row b
        of the cache taking counts[b] of them in order (sum(counts) = T; 0: the row takes none); default
        all T go to the cache's one row."""
        dev = tokens.device
        if counts is None:
            counts = [tokens.shape[1]] * cache.batch_size
        pos = torch.cat([torch.arange(n, device=dev) + cache.next_pos[b] for b, n in enumerate(counts)]).unsqueeze(0)
        packed = cache.batch_size > 1
        cache.begin_block(pos, counts=counts if packed else None)
        rope = self._rope(pos, self.norm.dtype)
        levels = self._levels_from_target(tokens, hidden)
        cache.write_layers(*self._memories_kv(levels, rope))
        if self.spire.feature_input:
            features(cache).write_feature(levels[-1])
        cache.commit_prefix(counts)

    # -- training -------------------------------------------------------------------------------------
    def train_forward(self, tokens: torch.Tensor, target_hidden: torch.Tensor | None, steps: int) -> list[torch.Tensor]:
        """Logits [B, T, V'] of draft steps 1..`steps` at every position t (step j's query is the
        token at t, as if the j - 1 tokens before it were drafted and accepted); predicts token t + 1.
        Without target activations the draft is a plain decoder: every step is the same pass."""
        b, t = tokens.shape
        pos = torch.arange(t, device=tokens.device)
        rope = self._rope(pos.unsqueeze(0), torch.float32)
        x0 = F.embedding(tokens, self.embed).float()

        def batch(mask: torch.Tensor) -> AttentionBatch:  # every row the same [T, S] mask
            return AttentionBatch(pos.expand(b, t), mask[None, None], (t,) * b)

        if target_hidden is None:
            mask = window_mask(pos, pos, self.spire.window) & causal_block_mask(t, pos.device)  # [T, T]
            x = self._blocks(x0, rope, batch(mask), UnrolledKeys())[-1]
            return [self._logits(x)] * steps  # its own memories at every step: one pass says it all
        levels_t = [x0] + [target_hidden[:, :, j].float() for j in range(target_hidden.shape[2])]
        target_kv = self._memories_kv(levels_t, rope)  # (k, v), each [layers, B, Hkv, T, D]
        draft_kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step
        outs = []
        tops = [levels_t[-1]]  # top-level features: the target's, then each draft step's
        for j in range(1, steps + 1):
            # keys: target memories before t - j + 1 | the draft's step-(j - r) memory at t - r | self
            mask = unrolled_step_mask(pos, j, self.spire.window)  # [T, (j + 1) T]
            seen = UnrolledKeys([target_kv] + [draft_kv[j - r - 1] for r in range(1, j)])
            x = x0
            if self.spire.feature_input:  # the token before: the target's (step 1) or the previous step's
                x = self._fused(x0, F.pad(tops[j - 1][:, :-1], (0, 0, 1, 0)))
            levels = [x0, *self._blocks(x, rope, batch(mask), seen)]
            draft_kv.append(self._memories_kv(levels, rope))
            tops.append(levels[-1])
            outs.append(self._logits(levels[-1]))
        return outs
