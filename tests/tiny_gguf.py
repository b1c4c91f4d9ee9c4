"""GGUF blocks of the quant types a Q4_K_M file holds, written as real GGUF files, and a tiny Qwen2 GGUF in
those types with transformers' model of exactly its weights (tests/unit/test_gguf_quants.py and the
batch-invariance tests load it); and a tiny fp32 Llama GGUF with a byte-level tokenizer of its own, whole or
missing or breaking one piece of metadata (the fuzz fixtures of tests/fuzz/fixtures.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from tiny_checkpoints import TINY_CONTEXT


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


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-character table: a byte-level BPE vocabulary with no merges."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    extra = iter(range(256, 512))
    return [chr(b if b in keep else next(extra)) for b in range(256)]


def write_tiny_llama_gguf(path: Path, drop: str | None = None, override: tuple[str, Any] | None = None) -> Path:
    """A tiny llama GGUF (fp32 tensors, 2 blocks, d 64, context 64) with a byte-level tokenizer;
    `drop` leaves one metadata key out, `override` gives one key another value (and type)."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_symbols(), "\u0120t"]
    n_vocab, d, n_layers, heads, kv_heads, d_ff = len(tokens), 64, 2, 4, 2, 128
    meta: dict[str, Any] = {
        "general.architecture": "llama", "llama.block_count": n_layers, "llama.context_length": TINY_CONTEXT,
        "llama.embedding_length": d, "llama.feed_forward_length": d_ff, "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads, "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-6, "llama.vocab_size": n_vocab,
        "llama.rope.dimension_count": d // heads, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (n_vocab - 3),
        "tokenizer.ggml.merges": ["\u0120 t"], "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }
    if drop is not None:
        meta.pop(drop, None)
    if override is not None:
        meta[override[0]] = override[1]
    w = gguf.GGUFWriter(str(path), arch=str(meta.get("general.architecture", "llama")))
    w.kv_data[0].pop("general.architecture", None)  # written below with the others (or dropped)
    for key, value in meta.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str, list)):
            continue
        if isinstance(value, list):
            vtype = gguf.GGUFValueType.ARRAY
        elif isinstance(value, str):
            vtype = gguf.GGUFValueType.STRING
        elif isinstance(value, float):
            vtype = gguf.GGUFValueType.FLOAT32
        else:
            vtype = gguf.GGUFValueType.UINT32 if 0 <= value < 2**32 else gguf.GGUFValueType.INT64
        w.add_key_value(key, value, vtype)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    tensor("token_embd.weight", n_vocab, d)
    tensor("output_norm.weight", d)
    for i in range(n_layers):
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", d)
        tensor(p + "ffn_norm.weight", d)
        tensor(p + "attn_q.weight", d, d)
        tensor(p + "attn_k.weight", kv_heads * d // heads, d)
        tensor(p + "attn_v.weight", kv_heads * d // heads, d)
        tensor(p + "attn_output.weight", d, d)
        tensor(p + "ffn_gate.weight", d_ff, d)
        tensor(p + "ffn_up.weight", d_ff, d)
        tensor(p + "ffn_down.weight", d, d_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
