"""Weight formats (QLinear fp32 / bf16 / int8 / int4), exact packing of Q4_1 codes, and GGUF reading:
Q4_1 block parsing and the un-permutation of llama.cpp's rotary row order, checked end to end on a
tiny GGUF written here from a tiny transformers llama."""
from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from specstack.errors import SpecstackError
from specstack.models.gguf_quants import read_tensor
from specstack.models.loading import load_model
from specstack.models.quant import Q4Weight, QLinear

QT = gguf.GGMLQuantizationType
U = 2.0**-8  # unit roundoff of bf16 (8 significant bits): |bf16(x) - x| <= U * |x|


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# -- QLinear formats ---------------------------------------------------------------------------------
def test_fp32_is_exactly_linear():
    w, b, x = rand(48, 64, seed=1), rand(48, seed=2), rand(5, 64, seed=3)
    lin = QLinear(64, 48, "fp32", bias=True).set_float(w, b)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, w, b))
    assert torch.equal(lin.dequantized(), w)
    assert lin.bias is not None and torch.equal(lin.bias, b)  # dequantized() restores the bias


@pytest.mark.parametrize("fmt,max_rel", [("bf16", 6e-3), ("int8", 1.5e-2), ("int4", 0.12)])
def test_quantized_formats_track_fp32(fmt, max_rel):
    """Output error within what the format can represent: bf16 ~2^-9 per weight, int8 per-channel
    step amax/127, int4 per-32 step range/15 (relative RMS ~8% on Gaussian weights)."""
    w, b, x = rand(96, 128, seed=4), rand(96, seed=5), rand(2, 7, 128, seed=6)
    ref = torch.nn.functional.linear(x, w, b)
    lin = QLinear(128, 96, fmt, bias=True).set_float(w, b)
    y = lin(x.bfloat16())
    assert y.shape == (2, 7, 96) and y.dtype == torch.bfloat16
    assert rel(y, ref) < max_rel
    assert rel(lin.dequantized(), w) < max_rel
    # the output is the (rounded) product with the weights the layer reports
    y_dq = torch.nn.functional.linear(x.bfloat16().float(), lin.dequantized(), lin.bias.float())
    assert rel(y, y_dq) < 6e-3


@pytest.mark.parametrize("fmt,out", [("int8", 48), ("int4", 48), ("int4", 40)])  # 40: int4 pads rows to 16s
def test_wide_inputs_use_a_dense_copy_of_the_same_weights(fmt, out):
    """From `wide_rows` rows on, int8/int4 multiply by a bf16 copy of exactly the weights the small
    kernel dequantises (rounded to bf16): a row's output does not depend on how many rows came with it
    beyond that rounding, and wide_rows=None keeps the small kernel for every width."""
    w, b = rand(out, 64, seed=20), rand(out, seed=21)
    lin = QLinear(64, out, fmt, bias=True).set_float(w, b)
    assert lin.dense is not None and torch.equal(lin.dense, lin.dequantized().bfloat16())
    x = rand(lin.wide_rows + 3, 64, seed=22).bfloat16()
    wide = lin(x)
    narrow = torch.cat([lin(x[i : i + 1]) for i in range(len(x))])
    assert wide.shape == narrow.shape == (len(x), out)
    assert rel(wide, narrow) < 6e-3  # bf16 rounding of the weights and of the products
    assert torch.equal(wide, torch.nn.functional.linear(x, lin.dense, lin.bias))
    lin.wide_rows = None
    assert torch.equal(lin(x), torch.cat([lin(x[i : i + 1]) for i in range(len(x))]))
    assert QLinear(64, out, "bf16").dense is None


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_a_layer_computes_with_its_current_weights(fmt):
    """Layers call a closure bound to their tensors (models/bound.py): a copy computes with its own
    weights, and load_state_dict takes effect even after the layer has run."""
    w1, w2, x = rand(32, 64, seed=30), rand(32, 64, seed=31), rand(3, 64, seed=32).bfloat16()
    a = QLinear(64, 32, fmt).set_float(w1)
    b = QLinear(64, 32, fmt).set_float(w2)
    ya, yb = a(x), b(x)
    assert not torch.equal(ya, yb)
    c = copy.deepcopy(a)
    c.set_float(w2)
    assert torch.equal(c(x), yb) and torch.equal(a(x), ya)
    a.load_state_dict(b.state_dict())
    assert torch.equal(a(x), yb)


def test_int8_weights_within_half_a_step():
    w = rand(32, 64, seed=7)
    lin = QLinear(64, 32, "int8").set_float(w)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    err = (lin.dequantized() - w).abs()
    # half a step of rounding, plus the bf16 rounding of the stored scale (|q| <= 127) and of the output
    assert (err <= 0.5 * step + 127 * step * U + (w.abs() + step) * U + 1e-7).all()


def test_int4_from_float_within_half_a_step():
    w = rand(32, 128, seed=8)
    lin = QLinear(128, 32, "int4").set_float(w)
    g = w.view(32, 4, 32)
    step = ((g.amax(2) - g.amin(2)) / 15).repeat_interleave(32, dim=1)
    zero = (g.amin(2) + 8 * (g.amax(2) - g.amin(2)) / 15).repeat_interleave(32, dim=1)
    err = (lin.dequantized() - w).abs()
    # half a step, plus bf16 rounding of the stored scale (|q - 8| <= 8) and zero, and of the output
    assert (err <= 0.5 * step + U * (8 * step + zero.abs() + w.abs() + step) + 1e-7).all()


def test_set_int4_reproduces_q4_1_exactly_when_representable():
    """Codes q with scale d and min m (w = d*q + m per 32 inputs): with d, m, m + 8d exact in bf16 and
    w exact in bf16, the int4 kernel must compute with exactly those weights (checks nibble order,
    group layout and the scale/zero convention)."""
    n, k = 24, 96
    g = torch.Generator().manual_seed(9)
    q = torch.randint(0, 16, (n, k), generator=g)
    d = torch.randint(1, 8, (n, k // 32), generator=g).float() / 64
    m = -torch.randint(0, 32, (n, k // 32), generator=g).float() / 64
    ref = Q4Weight(q.to(torch.uint8), d, m).dequantize()
    assert torch.equal(ref.bfloat16().float(), ref)
    lin = QLinear(k, n, "int4").set_int4(q, d, m)
    assert torch.equal(lin.dequantized(), ref)
    x = rand(3, k, seed=10).bfloat16()
    assert rel(lin(x), x.float() @ ref.t()) < 5e-3
    # the float formats receive the dequantised weight
    assert torch.equal(QLinear(k, n, "fp32").set_int4(q, d, m).weight, ref)


def test_set_int4_with_gguf_q4_1_blocks():
    """Real Q4_1 blocks (fp16 d and m from gguf's quantizer): the int4 layer computes with d*q + m up to
    bf16 rounding of its scale d and zero m + 8d (bf16 is what the CPU kernel takes with bf16 activations)
    and of its bf16 output."""
    w = rand(16, 128, seed=11).numpy()
    blocks = gguf.quants.quantize(w, QT.Q4_1)
    t = _write_and_read(blocks, QT.Q4_1)
    qw = read_tensor(t, want_codes=True)
    ref = qw.dequantize()
    lin = QLinear(128, 16, "int4").set_int4(qw.q, qw.d, qw.m)
    d = qw.d.repeat_interleave(32, dim=1)
    zero = (qw.m + 8 * qw.d).repeat_interleave(32, dim=1)
    bound = U * ((qw.q.float() - 8).abs() * d + zero.abs()) + U * 1.01 * (ref.abs() + d) + 1e-7
    err = (lin.dequantized() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"
    assert rel(lin.dequantized(), ref) < 4e-3


def test_invalid_formats():
    with pytest.raises(SpecstackError):
        QLinear(48, 16, "int4")  # in_features not a multiple of the group size 32
    with pytest.raises(SpecstackError):
        QLinear(64, 16, "fp8")


# -- GGUF tensors ------------------------------------------------------------------------------------
def _write_and_read(data: np.ndarray, qtype: QT | None, tmp: Path | None = None):
    import tempfile

    path = Path(tmp or tempfile.mkdtemp()) / "one.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    if qtype is None:
        w.add_tensor("t", data)
    else:
        w.add_tensor("t", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path)).tensors[0]


def test_gguf_q4_1_tensor_stays_4_bit_and_matches_gguf_dequantize(tmp_path):
    w = rand(6, 96, seed=12).numpy()
    blocks = gguf.quants.quantize(w, QT.Q4_1)
    qw = read_tensor(_write_and_read(blocks, QT.Q4_1, tmp_path), want_codes=True)
    assert isinstance(qw, Q4Weight)
    assert qw.q.shape == (6, 96) and qw.d.shape == (6, 3) and qw.m.shape == (6, 3)
    assert int(qw.q.min()) >= 0 and int(qw.q.max()) <= 15
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, QT.Q4_1)).reshape(6, 96)
    assert torch.equal(qw.dequantize(), expected)
    assert (qw.dequantize() - torch.from_numpy(w)).abs().max() < 0.6  # and it is a quantisation of w


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.F16, None])
def test_gguf_other_tensors_are_dequantised_in_row_major_shape(tmp_path, qtype):
    w = rand(5, 64, seed=13).numpy()
    if qtype == QT.Q8_0:
        data, expected = gguf.quants.quantize(w, qtype), gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
    elif qtype == QT.F16:
        data, expected, qtype = w.astype(np.float16), w.astype(np.float16).astype(np.float32), None
    else:
        data, expected = w, w
    t = read_tensor(_write_and_read(data, qtype, tmp_path), want_codes=True)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == (5, 64)
    assert torch.equal(t, torch.from_numpy(np.asarray(expected, dtype=np.float32)).reshape(5, 64))


def test_gguf_1d_tensor(tmp_path):
    w = rand(64, seed=14).numpy()
    t = read_tensor(_write_and_read(w, None, tmp_path), want_codes=True)
    assert t.shape == (64,) and torch.equal(t, torch.from_numpy(w))


# -- a tiny llama GGUF, written the way llama.cpp's converter does -----------------------------------
def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: interleave the two rotary halves of every head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_llama_gguf(hf: torch.nn.Module, path: Path, tied: bool) -> torch.nn.Module:
    """Write `hf` as a GGUF (linear weights Q4_1, embedding F16, output Q8_0, norms F32) and return a copy
    of `hf` whose weights are exactly the values the GGUF stores."""
    ref = copy.deepcopy(hf)
    cfg = ref.config
    sd = ref.state_dict()
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    tensors: list[tuple[str, np.ndarray, QT | None]] = []

    def q4_1(name: str, key: str, n_head: int | None = None) -> None:
        w = sd[key].numpy()
        blocks = gguf.quants.quantize(w, QT.Q4_1)  # one row of blocks per output row
        sd[key].copy_(torch.from_numpy(gguf.quants.dequantize(blocks, QT.Q4_1)).reshape(w.shape))
        if n_head is not None:  # permuting rows moves whole rows of blocks
            blocks = _llamacpp_permute(blocks, n_head)
        tensors.append((name, blocks, QT.Q4_1))

    emb = sd["model.embed_tokens.weight"]
    emb.copy_(emb.half().float())
    tensors.append(("token_embd.weight", emb.numpy().astype(np.float16), None))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors.append((f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"].numpy(), None))
        tensors.append((f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"].numpy(), None))
        q4_1(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", nh)
        q4_1(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", nkv)
        q4_1(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight")
        q4_1(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight")
        q4_1(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight")
        q4_1(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight")
        q4_1(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight")
    tensors.append(("output_norm.weight", sd["model.norm.weight"].numpy(), None))
    if tied:
        sd["lm_head.weight"].copy_(emb)
    else:
        out = sd["lm_head.weight"].numpy()
        blocks = gguf.quants.quantize(out, QT.Q8_0)
        sd["lm_head.weight"].copy_(torch.from_numpy(gguf.quants.dequantize(blocks, QT.Q8_0)).reshape(out.shape))
        tensors.append(("output.weight", blocks, QT.Q8_0))

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(cfg.hidden_size // nh)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, data, qtype in tensors:
        if qtype is None:
            w.add_tensor(name, np.ascontiguousarray(data))
        else:
            w.add_tensor(name, np.ascontiguousarray(data), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref.eval()


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny_gguf(request, tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    ref = _write_tiny_llama_gguf(tiny_llama.hf, path, tied=request.param)
    return path, ref, request.param


def test_tiny_gguf_llama_matches_transformers(tiny_gguf):
    path, ref, tied = tiny_gguf
    lm = load_model(str(path), dtype="fp32", use_cache=False, tokenizer=False)
    cfg = lm.config
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (3, 64, 4, 2, 16)
    assert cfg.tie_embeddings == tied and cfg.max_seq_len == 256 and cfg.eos_token_ids == (2,)
    ids = torch.randint(0, 257, (1, 19), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        expected = ref(ids).logits[0]
    model = lm.model
    cache = model.new_cache(1, capacity=32)
    got = model.extend(ids[:, :15], cache).logits[0]
    for i in range(15, 19):  # and decoding over the prefilled cache
        got = torch.cat([got, model.extend(ids[:, i : i + 1], cache).logits[0]])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_tiny_gguf_int4_packs_the_q4_1_blocks(tiny_gguf):
    path = tiny_gguf[0]
    f32 = load_model(str(path), dtype="fp32", use_cache=False, tokenizer=False).model
    i4 = load_model(str(path), dtype="int4", use_cache=False, tokenizer=False).model
    for a, b in zip(f32.layers, i4.layers, strict=True):
        for name in ("qkv", "o", "up", "down"):  # every one built from Q4_1 blocks (q, k un-permuted)
            w32, w4 = getattr(a, name).weight, getattr(b, name).dequantized()
            assert rel(w4, w32) < 4e-3, name
            assert ((w4 - w32).abs() <= 2 * U * (w32.abs() + w32.abs().amax(dim=1, keepdim=True))).all(), name
