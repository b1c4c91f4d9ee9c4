"""GGUF blocks of the quant types a Q4_K_M file holds, written as real GGUF files, and a tiny Qwen2 GGUF in
those types with transformers' model of exactly its weights (tests/unit/test_gguf_quants.py and the
batch-invariance tests load it)."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _with_fp16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    """Write float16 `values` (one per block) at byte `offset` of each block."""
    blocks[..., offset : offset + 2] = values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def q4_k_blocks(rows: int, cols: int, seed: int, scale: float = 0.25) -> np.ndarray:
    """Random Q4_K super-blocks whose weights lie within about +-scale (codes, 6-bit scales and mins
    random; d and dmin chosen for that range)."""
    b = _rng(seed).integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    n = b.shape[:2]
    _with_fp16(b, 0, _rng(seed + 1).uniform(0.5, 1.0, n) * scale / (63 * 15))
    _with_fp16(b, 2, _rng(seed + 2).uniform(0.5, 1.0, n) * scale / 63)
    return b.reshape(rows, -1)


def q6_k_blocks(rows: int, cols: int, seed: int, scale: float = 0.25) -> np.ndarray:
    """Random Q6_K super-blocks (ql, qh, 16 int8 scales, d) within about +-scale."""
    b = _rng(seed).integers(0, 256, size=(rows, cols // 256, 210), dtype=np.uint8)
    b[..., 192:208] = _rng(seed + 1).integers(-64, 64, size=(rows, cols // 256, 16), dtype=np.int8).view(np.uint8)
    _with_fp16(b, 208, _rng(seed + 2).uniform(0.5, 1.0, b.shape[:2]) * scale / (64 * 32))
    return b.reshape(rows, -1)


def write_one(path: Path, data: np.ndarray, qtype: QT) -> object:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("t", np.ascontiguousarray(data), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path)).tensors[0]


def dequantized(data: np.ndarray, qtype: QT, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)).reshape(rows, cols)


def blocks_of(qtype: QT, rows: int, cols: int, seed: int) -> np.ndarray:
    if qtype == QT.Q4_K:
        return q4_k_blocks(rows, cols, seed)
    if qtype == QT.Q6_K:
        return q6_k_blocks(rows, cols, seed)
    return gguf.quants.quantize(_rng(seed).normal(0, 0.1, (rows, cols)).astype(np.float32), qtype)


# -- a tiny Qwen2 GGUF in a Q4_K_M file's types ------------------------------------------------------
D, FF, HEADS, KV, LAYERS, VOCAB = 256, 512, 4, 2, 2, 300
TYPES = {"attn_q": QT.Q4_K, "attn_k": QT.Q4_K, "attn_v": QT.Q6_K, "attn_output": QT.Q4_K, "ffn_gate": QT.Q5_0,
         "ffn_up": QT.Q5_0, "ffn_down": QT.Q6_K}
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}


def write_tiny_qwen2_gguf(path: Path) -> torch.nn.Module:
    """A Qwen2 GGUF (rows not permuted, q/k/v biases in F32) and transformers' model with exactly the
    weights it stores."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=D, intermediate_size=FF, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=128,
                      rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(7)
    hf = Qwen2ForCausalLM(cfg).float().eval()
    sd = hf.state_dict()
    rng = _rng(11)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(128)
    w.add_embedding_length(D)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_eos_token_id(2)

    def put(name: str, key: str, data: np.ndarray, qtype: QT | None, shape: tuple[int, ...]) -> None:
        if qtype is None:
            sd[key].copy_(torch.from_numpy(data).reshape(shape))
            w.add_tensor(name, np.ascontiguousarray(data))
        else:
            sd[key].copy_(dequantized(data, qtype, *shape))
            w.add_tensor(name, np.ascontiguousarray(data), raw_dtype=qtype)

    put("token_embd.weight", "model.embed_tokens.weight", blocks_of(QT.Q4_K, VOCAB, D, 1), QT.Q4_K, (VOCAB, D))
    seed = 100
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for gname, hname in HF_NAMES.items():
            rows, cols = sd[p + hname + ".weight"].shape
            seed += 10
            put(f"blk.{i}.{gname}.weight", p + hname + ".weight", blocks_of(TYPES[gname], rows, cols, seed),
                TYPES[gname], (rows, cols))
        for g in ("q", "k", "v"):
            b = rng.normal(0, 0.2, sd[f"{p}self_attn.{g}_proj.bias"].shape).astype(np.float32)
            put(f"blk.{i}.attn_{g}.bias", f"{p}self_attn.{g}_proj.bias", b, None, b.shape)
        for gname, hname in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            n = rng.uniform(0.5, 1.5, D).astype(np.float32)
            put(f"blk.{i}.{gname}.weight", p + hname + ".weight", n, None, (D,))
    put("output_norm.weight", "model.norm.weight", rng.uniform(0.5, 1.5, D).astype(np.float32), None, (D,))
    put("output.weight", "lm_head.weight", blocks_of(QT.Q8_0, VOCAB, D, 3), QT.Q8_0, (VOCAB, D))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf
