"""The GGUF quant-type table (models/gguf_quants.py) and a tiny Qwen2 GGUF in the types of a real
Q4_K_M file: Q4_0, Q4_1 and Q4_K blocks pack exactly into the int4 layout, every other type gets int8
layers under int4, and the whole file loads with transformers' logits."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from specstack.models.gguf_quants import layer_format, read_tensor
from specstack.models.loading import load_model, read_gguf
from specstack.models.quant import Q4Weight, QLinear


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


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q4_K])
def test_4_bit_types_keep_their_codes_exactly(tmp_path, qtype):
    rows, cols = 16, 512
    data = blocks_of(qtype, rows, cols, seed=3)
    qw = read_tensor(write_one(tmp_path / "t.gguf", data, qtype), want_codes=True)
    assert isinstance(qw, Q4Weight) and qw.q.shape == (rows, cols) and qw.d.shape == (rows, cols // 32)
    assert int(qw.q.max()) <= 15
    ref = dequantized(data, qtype, rows, cols)
    torch.testing.assert_close(qw.dequantize(), ref, atol=1e-6, rtol=0)  # the very weights gguf reads
    # and the int4 kernel computes with them up to the bf16 rounding of each group's scale and zero
    lin = QLinear(cols, rows, "int4").set_int4(qw.q, qw.d, qw.m)
    err = (lin.dequantized() - ref).norm() / ref.norm()
    assert err < 6e-3, f"relative error {err:.2g}"


@pytest.mark.parametrize("qtype", [QT.Q5_0, QT.Q6_K, QT.Q8_0])
def test_wider_types_are_dequantised(tmp_path, qtype):
    rows, cols = 8, 256
    data = blocks_of(qtype, rows, cols, seed=5)
    t = read_tensor(write_one(tmp_path / "t.gguf", data, qtype), want_codes=True)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
    assert torch.equal(t, dequantized(data, qtype, rows, cols))


def test_q4_k_keeps_its_super_blocks_and_k4a8_holds_the_very_weights(tmp_path):
    """k4a8 stores Q4_K's (d, dmin) per 256 and its 6-bit (sc, mn) per 32: the weights gguf reads, bit
    for bit, in 3 bytes of scales a group instead of w4a8's 8."""
    rows, cols = 16, 512
    data = blocks_of(QT.Q4_K, rows, cols, seed=4)
    qw = read_tensor(write_one(tmp_path / "t.gguf", data, QT.Q4_K), want_codes=True)
    assert isinstance(qw, Q4Weight) and qw.sup is not None and qw.sub is not None
    assert qw.sup.shape == (rows, cols // 256, 2) and qw.sub.shape == (rows, 2, cols // 32)
    assert int(qw.sub.max()) <= 63 and bool((qw.sup[..., 1] <= 0).all())
    lin = QLinear(cols, rows, "k4a8").set_int4(qw.q, qw.d, qw.m, qw.sup, qw.sub)
    assert torch.equal(lin.float_weight(), qw.dequantize())
    torch.testing.assert_close(lin.float_weight(), dequantized(data, QT.Q4_K, rows, cols), atol=1e-6, rtol=0)
    assert lin.step_bytes() == rows * cols // 2 + rows * (cols // 256) * 8 + rows * (cols // 32) * 2
    with pytest.raises(ValueError, match="super-blocks"):
        QLinear(cols, rows, "k4a8").set_int4(qw.q, qw.d, qw.m)


def test_layer_formats():
    assert layer_format("w4a8", ["Q4_K", "Q4_K", "Q4_K"]) == "k4a8"  # Q4_K's super-blocks
    assert layer_format("w4a8", ["Q4_K", "Q4_1"]) == "w4a8"  # a part without them: per-group scales
    assert layer_format("w4a8", ["Q4_K", "Q4_K", "Q6_K"]) == "q8a8"
    assert layer_format("int4", ["Q4_K", "Q4_K", "Q4_K"]) == "int4"
    assert layer_format("int4", ["Q4_K", "Q4_K", "Q6_K"]) == "int8"  # a fused qkv takes its widest part's
    assert layer_format("int4", ["Q5_0"]) == "int8" and layer_format("int4", ["Q8_0"]) == "int8"
    assert layer_format("int4", ["F32"]) == "int4"  # a float source is quantised as asked
    assert layer_format("int4", ["IQ2_XS"]) == "int8"  # any other type: never requantised into 4 bits
    for fmt in ("int8", "bf16", "fp32"):
        assert layer_format(fmt, ["Q4_K", "Q6_K"]) == fmt


# -- a tiny Qwen2 GGUF in a Q4_K_M file's types ------------------------------------------------------
D, FF, HEADS, KV, LAYERS, VOCAB = 256, 512, 4, 2, 2, 300
TYPES = {"attn_q": QT.Q4_K, "attn_k": QT.Q4_K, "attn_v": QT.Q6_K, "attn_output": QT.Q4_K, "ffn_gate": QT.Q4_K,
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


@pytest.fixture(scope="module")
def tiny_qwen2_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2-gguf") / "tiny-qwen2.gguf"
    return path, write_tiny_qwen2_gguf(path)


def test_tiny_qwen2_gguf_matches_transformers_in_fp32(tiny_qwen2_gguf):
    path, hf = tiny_qwen2_gguf
    lm = load_model(str(path), dtype="fp32", use_cache=False, tokenizer=False)
    cfg = lm.config
    assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.rope_theta) == (
        "qwen2", LAYERS, D, HEADS, KV, 1e6)
    assert cfg.block.qkv_bias and not cfg.tie_embeddings
    ids = torch.randint(0, VOCAB, (1, 21), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(ids).logits[0]
    cache = lm.model.new_cache(1, capacity=32)
    got = lm.model.extend(ids[:, :17], cache).logits[0]
    for i in range(17, 21):  # and decoding over the prefilled cache
        got = torch.cat([got, lm.model.extend(ids[:, i : i + 1], cache).logits[0]])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def close_to_transformers(lm, hf) -> torch.Tensor:
    """The loaded model's logits on 12 random tokens, checked within 5 % (relative norm) of the fp32
    transformers model's; returned."""
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf(ids).logits[0]
    got = lm.model.extend(ids, lm.model.new_cache(1, capacity=16)).logits[0]
    err = (got - expected).norm() / expected.norm()
    assert err < 0.05, f"relative logit error {err:.3f}"
    return got


def test_tiny_qwen2_gguf_int4_plan(tiny_qwen2_gguf):
    """Under int4: a qkv fused with a Q6_K v, a Q5_0 up and a Q6_K down get int8; the all-Q4_K o stays
    int4 from its codes; the Q8_0 head int8. Logits stay close to the fp32 model's."""
    path, hf = tiny_qwen2_gguf
    _, weights, formats = read_gguf(path, "int4")
    assert formats == {**{f"layers.{i}.{n}": "int8" for i in range(LAYERS) for n in ("qkv", "up", "down")},
                       "head": "int8"}
    assert isinstance(weights["layers.0.o"], Q4Weight) and isinstance(weights["layers.0.v"], torch.Tensor)
    lm = load_model(str(path), dtype="int4", use_cache=False, tokenizer=False)
    assert lm.model.layers[0].o.fmt == "int4" and lm.model.layers[0].qkv.fmt == "int8"
    close_to_transformers(lm, hf)


def test_tiny_qwen2_gguf_w4a8_plan(tiny_qwen2_gguf, tmp_path, monkeypatch):
    """Under w4a8: the all-Q4_K o in super-blocks (k4a8) from its codes, the layers with wider parts and
    the head in 8-bit groups (q8a8). Logits close to the fp32 model's; the built-model cache gives the
    same model back."""
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    path, hf = tiny_qwen2_gguf
    _, weights, formats = read_gguf(path, "w4a8")
    assert formats == {**{f"layers.{i}.{n}": "q8a8" for i in range(LAYERS) for n in ("qkv", "up", "down")},
                       **{f"layers.{i}.o": "k4a8" for i in range(LAYERS)}, "head": "q8a8"}
    o = weights["layers.0.o"]
    assert isinstance(o, Q4Weight) and o.sup is not None
    lm = load_model(str(path), dtype="w4a8", tokenizer=False)
    assert lm.model.layers[0].o.fmt == "k4a8" and torch.equal(lm.model.layers[0].o.float_weight(), o.dequantize())
    got = close_to_transformers(lm, hf)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    again = load_model(str(path), dtype="w4a8", tokenizer=False)  # from the built-model cache
    assert again.model.layers[1].o.fmt == "k4a8"
    assert torch.equal(again.model.extend(ids, again.model.new_cache(1, capacity=16)).logits[0], got)


def test_tiny_qwen2_int4_cached_load_keeps_the_plan(tiny_qwen2_gguf, tmp_path, monkeypatch):
    """The built-model cache stores each layer's format: the second load is the same model."""
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    path, _ = tiny_qwen2_gguf
    first = load_model(str(path), dtype="int4", tokenizer=False)
    second = load_model(str(path), dtype="int4", tokenizer=False)
    assert second.model.formats == first.model.formats and second.model.layers[1].down.fmt == "int8"
    ids = torch.arange(10).view(1, -1)
    a = first.model.extend(ids, first.model.new_cache(1, capacity=16)).logits
    b = second.model.extend(ids, second.model.new_cache(1, capacity=16)).logits
    assert torch.equal(a, b)
