"""The GGUF quant-type table (models/gguf_quants.py) and a tiny Qwen2 GGUF in the types of a real
Q4_K_M file: Q4_0, Q4_1 and Q4_K blocks pack exactly into the int4 layout, Q4_K and Q6_K keep their
codes and scales under w4a8 (k4a8, k6a8), every other type gets int8 layers under int4, and the whole
file loads with transformers' logits."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from tiny_gguf import HEADS, KV, LAYERS, VOCAB, D, blocks_of, dequantized, write_one, write_tiny_qwen2_gguf

from specstack.models import w4a8
from specstack.models.coded import Q5Weight
from specstack.models.gguf_quants import layer_format, read_tensor
from specstack.models.loading import load_model, read_gguf
from specstack.models.quant import Q4Weight, Q6Weight, QLinear


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


@pytest.mark.parametrize("qtype", [QT.Q5_1, QT.Q8_0])
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


def test_q6_k_keeps_its_codes_and_k6a8_holds_the_very_weights(tmp_path):
    """k6a8 stores Q6_K's 6-bit codes, int8 scales per 16 and d per 256: the weights gguf reads, bit for
    bit, in 6.625 bits a weight (q8a8's 8-bit groups: 9)."""
    rows, cols = 16, 512
    data = blocks_of(QT.Q6_K, rows, cols, seed=6)
    qw = read_tensor(write_one(tmp_path / "t.gguf", data, QT.Q6_K), want_codes=True)
    assert isinstance(qw, Q6Weight) and qw.q.shape == (rows, cols) and int(qw.q.max()) <= 63
    assert qw.s.shape == (rows, cols // 16) and qw.d.shape == (rows, cols // 256)
    ref = dequantized(data, QT.Q6_K, rows, cols)
    assert torch.equal(qw.dequantize(), ref)
    lin = QLinear(cols, rows, "k6a8").set_int6(qw.q, qw.s, qw.d)
    assert torch.equal(lin.float_weight(), ref)
    assert lin.step_bytes() * 8 / (rows * cols) == 6.625
    # every other format takes the dequantised weight
    assert torch.equal(QLinear(cols, rows, "fp32").set_int6(qw.q, qw.s, qw.d).weight, ref)
    assert isinstance(read_tensor(write_one(tmp_path / "u.gguf", data, QT.Q6_K), want_codes=False), torch.Tensor)


def test_q5_0_keeps_its_codes_and_q5a8_holds_the_very_weights(tmp_path):
    """q5a8 stores Q5_0's 5-bit codes and d per 32: the weights gguf reads, bit for bit, in 6 bits a weight
    (the fp32 d; q8a8's 8-bit groups: 9), 5.5 in the wide layout (the file's d are fp16, kept so). Odd group
    counts (a last chunk of 1 to 3 groups) included."""
    for rows, cols in ((16, 512), (8, 96), (8, 160)):
        data = blocks_of(QT.Q5_0, rows, cols, seed=7)
        qw = read_tensor(write_one(tmp_path / f"t{cols}.gguf", data, QT.Q5_0), want_codes=True)
        assert isinstance(qw, Q5Weight) and qw.q.shape == (rows, cols) and int(qw.q.max()) <= 31
        ref = dequantized(data, QT.Q5_0, rows, cols)
        assert torch.equal(qw.dequantize(), ref)
        lin = QLinear(cols, rows, "q5a8").set_codes(qw)
        assert torch.equal(lin.float_weight(), ref)
        if cols % 128 == 0:
            assert lin.scales.dtype == (torch.float16 if lin.wide_layout else torch.float32)
            assert lin.step_bytes() * 8 / (rows * cols) == (5.5 if lin.wide_layout else 6.0)
        # every other format takes the dequantised weight
        assert torch.equal(QLinear(cols, rows, "fp32").set_codes(qw).weight, ref)


def test_layer_formats():
    assert layer_format("w4a8", ["Q4_K", "Q4_K", "Q4_K"]) == "k4a8"  # Q4_K's super-blocks
    assert layer_format("w4a8", ["Q4_K", "Q4_1"]) == "w4a8"  # a part without them: per-group scales
    assert layer_format("w4a8", ["Q4_K", "Q4_K", "Q6_K"]) == "q8a8"  # Q4_K's parts are no Q6_K: q8a8
    assert layer_format("w4a8", ["Q6_K"]) == "k6a8" and layer_format("w4a8", ["Q6_K", "Q6_K"]) == "k6a8"
    assert layer_format("q8a8", ["Q6_K"]) == "k6a8" and layer_format("q8a8", ["Q8_0"]) == "q8a8"  # w4a8's heads
    assert layer_format("w4a8", ["Q6_K", "Q5_0"]) == "q8a8" and layer_format("int4", ["Q6_K"]) == "int8"
    assert layer_format("int4", ["Q5_0", "Q5_0"]) == "int8"
    assert layer_format("w4a8", ["Q6_K"], slow=frozenset({"k6a8"})) == "q8a8"  # a kernel path without k6a8
    assert layer_format("w4a8", ["Q5_0", "Q5_0"]) == "q5a8" and layer_format("w4a8", ["Q5_0", "Q4_K"]) == "q8a8"
    assert layer_format("w4a8", ["Q5_0"], slow=frozenset({"q5a8"})) == "q8a8"
    assert layer_format("int4", ["Q4_K", "Q4_K", "Q4_K"]) == "int4"
    assert layer_format("int4", ["Q4_K", "Q4_K", "Q6_K"]) == "int8"  # a fused qkv takes its widest part's
    assert layer_format("int4", ["Q5_0"]) == "int8" and layer_format("int4", ["Q8_0"]) == "int8"
    assert layer_format("int4", ["F32"]) == "int4"  # a float source is quantised as asked
    assert layer_format("int4", ["IQ2_XS"]) == "int8"  # any other type: never requantised into 4 bits
    for fmt in ("int8", "bf16", "fp32"):
        assert layer_format(fmt, ["Q4_K", "Q6_K"]) == fmt


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
    """Under int4: a qkv fused with a Q6_K v, the Q5_0 gate|up and a Q6_K down get int8; the all-Q4_K o stays
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
    """Under w4a8: the all-Q4_K o in super-blocks (k4a8) from its codes, the Q6_K down in 6-bit groups
    (k6a8) and the Q5_0 gate|up in 5-bit groups (q5a8) from theirs, the qkv with parts of two types and the
    Q8_0 head in 8-bit groups (q8a8). Logits close to the fp32 model's; the built-model cache gives the
    same model back."""
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    path, hf = tiny_qwen2_gguf
    _, weights, formats = read_gguf(path, "w4a8")
    assert formats == {**{f"layers.{i}.qkv": "q8a8" for i in range(LAYERS)},
                       **{f"layers.{i}.up": "q5a8" for i in range(LAYERS)},
                       **{f"layers.{i}.o": "k4a8" for i in range(LAYERS)},
                       **{f"layers.{i}.down": "k6a8" for i in range(LAYERS)}, "head": "q8a8"}
    o, down = weights["layers.0.o"], weights["layers.0.down"]
    assert isinstance(o, Q4Weight) and o.sup is not None and isinstance(down, Q6Weight)
    assert isinstance(weights["layers.0.v"], torch.Tensor)  # a Q6_K part of a q8a8 layer: floats
    lm = load_model(str(path), dtype="w4a8", tokenizer=False)
    assert lm.model.layers[0].o.fmt == "k4a8" and torch.equal(lm.model.layers[0].o.float_weight(), o.dequantize())
    assert lm.model.layers[0].down.fmt == "k6a8"
    assert torch.equal(lm.model.layers[0].down.float_weight(), down.dequantize())
    gate, up = weights["layers.0.gate"], weights["layers.0.up"]
    assert isinstance(gate, Q5Weight) and isinstance(up, Q5Weight) and lm.model.layers[0].up.fmt == "q5a8"
    assert torch.equal(lm.model.layers[0].up.float_weight(), torch.cat([gate.dequantize(), up.dequantize()]))
    got = close_to_transformers(lm, hf)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    again = load_model(str(path), dtype="w4a8", tokenizer=False)  # from the built-model cache
    assert again.model.layers[1].o.fmt == "k4a8" and again.model.layers[1].down.fmt == "k6a8"
    assert torch.equal(again.model.extend(ids, again.model.new_cache(1, capacity=16)).logits[0], got)


@pytest.mark.skipif(not w4a8.KERNELS[1].applies(torch.device("cpu")), reason="no avx2 path on this CPU")
def test_tiny_qwen2_gguf_w4a8_on_the_avx2_path_keeps_q6_k_in_8_bit_groups(tiny_qwen2_gguf, tmp_path, monkeypatch):
    """The avx2 path runs 6-bit and 5-bit groups slower than 8-bit ones: there the Q6_K down and the Q5_0
    gate|up are planned q8a8, and the built model is cached under its own name (a cache built on a VNNI
    path is not what this one loads)."""
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    path, _ = tiny_qwen2_gguf
    monkeypatch.setenv(w4a8.FORCE_ENV, "avx2")
    _, _, formats = read_gguf(path, "w4a8")
    assert formats["layers.0.down"] == formats["layers.0.up"] == "q8a8" and formats["layers.0.o"] == "k4a8"
    lm = load_model(str(path), dtype="w4a8", tokenizer=False)
    assert lm.model.layers[0].down.fmt == "q8a8"
    monkeypatch.setenv(w4a8.FORCE_ENV, "reference")
    assert load_model(str(path), dtype="w4a8", tokenizer=False).model.layers[0].down.fmt == "k6a8"
    built = sorted(p.name for p in tmp_path.rglob("w4a8*.safetensors"))
    assert len(built) == 2 and any("q8" in name for name in built), built


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
