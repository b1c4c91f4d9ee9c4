"""The architecture table: one entry per model family, keyed by Hugging Face `model_type` and GGUF
`general.architecture`, holding what the loaders need to know of it (DESIGN §3).

A family says what its blocks are made of (`BlockFeatures`: norm, activation, biases, q/k norm,
positions), where its config.json and GGUF metadata keep each size, how its tensors are named, and
whether llama.cpp's converter permuted its q/k rows. The decoder (transformer.py) and the loaders read
only these fields; no code asks which family a model is. To add a family, add one `Family` here
(docs/ARCHITECTURE.md, "Where to add things").

Torch-free: commands check a model's config before any model is built.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from specstack.config import BlockFeatures

# ModelConfig field -> config.json key, for the families whose config.json is Llama's
LLAMA_HF_KEYS: Mapping[str, str] = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "d_ff": "intermediate_size",
    "max_seq_len": "max_position_embeddings", "head_dim": "head_dim", "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta", "bos_token_id": "bos_token_id", "eos_token_ids": "eos_token_id",
}
GPT2_HF_KEYS: Mapping[str, str] = {
    "vocab_size": "vocab_size", "d_model": "n_embd", "n_layers": "n_layer", "n_heads": "n_head",
    "n_kv_heads": "n_head", "d_ff": "n_inner", "max_seq_len": "n_positions", "norm_eps": "layer_norm_epsilon",
    "bos_token_id": "bos_token_id", "eos_token_ids": "eos_token_id",
}
# ModelConfig field -> GGUF metadata key; {a} is the file's general.architecture. head_dim: the first
# of the keys that is present.
GGUF_KEYS: Mapping[str, str] = {
    "vocab_size": "{a}.vocab_size", "d_model": "{a}.embedding_length", "n_layers": "{a}.block_count",
    "n_heads": "{a}.attention.head_count", "n_kv_heads": "{a}.attention.head_count_kv",
    "d_ff": "{a}.feed_forward_length", "max_seq_len": "{a}.context_length",
    "norm_eps": "{a}.attention.layer_norm_rms_epsilon", "rope_theta": "{a}.rope.freq_base",
    "bos_token_id": "tokenizer.ggml.bos_token_id", "eos_token_ids": "tokenizer.ggml.eos_token_id",
}
GGUF_HEAD_DIM_KEYS = ("{a}.attention.key_length", "{a}.rope.dimension_count")

# canonical name -> GGUF name of a block's tensors (every family llama.cpp writes with these names)
GGUF_BLOCK_TENSORS: Mapping[str, str] = {
    "attn_norm.weight": "attn_norm.weight", "mlp_norm.weight": "ffn_norm.weight",
    "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "o": "attn_output.weight",
    "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight",
    "q.bias": "attn_q.bias", "k.bias": "attn_k.bias", "v.bias": "attn_v.bias", "o.bias": "attn_output.bias",
    "q_norm.weight": "attn_q_norm.weight", "k_norm.weight": "attn_k_norm.weight",
}
GGUF_TOP_TENSORS: Mapping[str, str] = {"embed": "token_embd.weight", "norm.weight": "output_norm.weight",
                                       "head": "output.weight"}


@dataclass(frozen=True)
class Family:
    """One model family: its blocks' features and where its files keep everything."""

    name: str
    block: BlockFeatures
    hf_types: tuple[str, ...]  # config.json model_type values
    hf_keys: Mapping[str, str]  # ModelConfig field -> config.json key
    hf_layout: str  # how its state dict is laid out: "llama" (q/k/v/o, gate/up/down) or "gpt2" (Conv1D, fused)
    hf_defaults: Mapping[str, object] = field(default_factory=dict)
    gguf: bool = False  # whether its GGUF files load (the names above)
    gguf_permuted_qk: bool = False  # llama.cpp's converter interleaved the rotary halves of q/k rows
    # config.json flags that change the block in ways the runner does not implement (key -> what it is)
    hf_unsupported: Mapping[str, str] = field(default_factory=dict)


_LLAMA_DEFAULTS = {"max_seq_len": 2048, "norm_eps": 1e-6}
FAMILIES: tuple[Family, ...] = (
    Family("llama", BlockFeatures(), ("llama", "mistral"), LLAMA_HF_KEYS, "llama", _LLAMA_DEFAULTS,
           gguf=True, gguf_permuted_qk=True,
           hf_unsupported={"attention_bias": "attention biases", "mlp_bias": "MLP biases"}),
    Family("qwen2", BlockFeatures(qkv_bias=True), ("qwen2",), LLAMA_HF_KEYS, "llama",
           {"max_seq_len": 32768, "norm_eps": 1e-6}, gguf=True,
           hf_unsupported={"use_sliding_window": "sliding-window attention"}),
    Family("qwen3", BlockFeatures(qk_norm=True), ("qwen3",), LLAMA_HF_KEYS, "llama",
           {"max_seq_len": 40960, "norm_eps": 1e-6}, gguf=True,
           hf_unsupported={"attention_bias": "attention biases", "use_sliding_window": "sliding-window attention"}),
    Family("gpt2", BlockFeatures(norm="layer", activation="gelu_tanh", position="learned", qkv_bias=True,
                                 o_bias=True, mlp_bias=True), ("gpt2",), GPT2_HF_KEYS, "gpt2", {"norm_eps": 1e-5}),
)
BY_NAME: Mapping[str, Family] = {f.name: f for f in FAMILIES}
BY_HF_TYPE: Mapping[str, Family] = {t: f for f in FAMILIES for t in f.hf_types}


def family(name: str) -> Family:
    """The family named `name` (a KeyError for an unknown one: callers say what the file was)."""
    return BY_NAME[name]


def names(kind: str = "hf") -> str:
    """The families a kind of file may hold, for error messages."""
    if kind == "gguf":
        return ", ".join(f.name for f in FAMILIES if f.gguf)
    return ", ".join(t for f in FAMILIES for t in f.hf_types)


def block_shapes(cfg_d: int, q_dim: int, kv_dim: int, d_ff: int, head_dim: int,
                 block: BlockFeatures) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of one block (names without the `layers.{i}.` prefix) with its shape."""
    d = cfg_d
    shapes: dict[str, tuple[int, ...]] = {"q": (q_dim, d), "k": (kv_dim, d), "v": (kv_dim, d), "o": (d, q_dim),
                                          "up": (d_ff, d), "down": (d, d_ff)}
    if block.gated:
        shapes["gate"] = (d_ff, d)
    if block.qkv_bias:
        shapes.update({"q.bias": (q_dim,), "k.bias": (kv_dim,), "v.bias": (kv_dim,)})
    if block.o_bias:
        shapes["o.bias"] = (d,)
    if block.mlp_bias:
        shapes.update({"up.bias": (d_ff,), "down.bias": (d,)})
        if block.gated:
            shapes["gate.bias"] = (d_ff,)
    if block.qk_norm:
        shapes.update({"q_norm.weight": (head_dim,), "k_norm.weight": (head_dim,)})
    for name in ("attn_norm", "mlp_norm"):
        shapes[name + ".weight"] = (d,)
        if block.norm == "layer":
            shapes[name + ".bias"] = (d,)
    return shapes
