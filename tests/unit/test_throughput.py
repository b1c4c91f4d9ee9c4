"""The throughput model (specstack/throughput/model.py, shapes.py, calibrate.py's fit): the SPIRe paper's
published values, parameter counts against models' known sizes, passes worked by hand, the critical
batch and context against the round model itself, edge cases and errors."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from specstack.errors import SpecstackError
from specstack.throughput import calibrate, hardware
from specstack.throughput.model import (
    ENGINE,
    PRESETS,
    PUBLISHED,
    Conventions,
    Hardware,
    b_crit,
    grid,
    l_crit,
    magicdec_draft,
    pass_cost,
    round_times,
    spire_draft,
    vanilla_draft,
)
from specstack.throughput.shapes import (
    NAMED,
    describe,
    draft_shape,
    from_config,
    model_shape,
    shape,
)

H100 = PRESETS["h100-fp8"]
TARGET = NAMED["spire-67m"]


def close(value: float, published: float, rel: float = 0.02) -> bool:
    return abs(value - published) <= rel * abs(published)


# ---------------------------------------------------------------------------------------------------
# The published values (DESIGN §7)
# ---------------------------------------------------------------------------------------------------
def test_published_shapes_have_the_papers_parameter_counts():
    # the paper gives them to a tenth of a million
    assert round(TARGET.params / 1e6, 1) == 67.1
    assert round(spire_draft(TARGET).shape.params / 1e6, 1) == 16.8


@pytest.mark.parametrize("batch,design,tau,published", [
    (64, "spire", 3.401, 2.78), (64, "magicdec", 3.891, 2.05),
    (8, "spire", 3.401, 2.17), (8, "magicdec", 3.891, 1.20),
])
def test_published_multipliers_at_context_512(batch, design, tau, published):
    draft = spire_draft(TARGET) if design == "spire" else magicdec_draft(TARGET)
    rnd = round_times(TARGET, draft, H100, batch, 512, 4, PUBLISHED)
    assert close(rnd.multiplier(tau), published), rnd.multiplier(tau)


@pytest.mark.parametrize("design", ["spire", "magicdec"])
def test_published_multipliers_do_not_depend_on_k_or_k_plus_1_verified(design):
    # at L = 512 > L_crit verification is memory-bound, so how many tokens it scores does not matter
    draft = spire_draft(TARGET) if design == "spire" else magicdec_draft(TARGET)
    for batch in (8, 64):
        k_only = round_times(TARGET, draft, H100, batch, 512, 4, PUBLISHED).delta_t
        k_plus_1 = round_times(TARGET, draft, H100, batch, 512, 4, replace(PUBLISHED, verify_extra=1)).delta_t
        assert k_only == pytest.approx(k_plus_1)


@pytest.mark.parametrize("name,published", [("spire-67m", 55), ("llama-3-70b", 5600)])
def test_published_l_crit(name, published):
    assert close(l_crit(NAMED[name], H100, 4, PUBLISHED), published)


def test_l_crit_with_k_plus_1_verified_tokens_is_a_quarter_higher():
    # what the stated verification width (k + 1) would give: 2N(k+1)/(HOI x), not the paper's 55
    conv = replace(PUBLISHED, verify_extra=1)
    assert l_crit(TARGET, H100, 4, conv) == pytest.approx(2 * 67_108_864 * 5 / (600 * 16_384))


# ---------------------------------------------------------------------------------------------------
# Shapes against known model sizes
# ---------------------------------------------------------------------------------------------------
def test_llama_3_70b_with_embeddings_is_70_6_billion():
    s = NAMED["llama-3-70b"]
    assert close(s.params + 2 * 128_256 * 8192, 70.6e9, 0.002)  # untied embedding and head


def test_gpt2_small_from_its_config_is_124_million():
    from specstack.config import ModelConfig
    from specstack.models.architectures import family

    cfg = ModelConfig(arch="gpt2", vocab_size=50257, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12,
                      d_ff=3072, max_seq_len=1024, tie_embeddings=True, block=family("gpt2").block)
    s = from_config(cfg, "gpt2")
    assert s.body_params == 12 * 12 * 768 * 768  # 4 d² attention + 8 d² MLP per block
    assert close(s.params + 1024 * 768, 124.4e6, 0.002)  # plus learned positions: GPT-2 small's 124 M


def test_default_model_counts_match_its_gguf_tensors():
    import gguf

    from specstack.models.registry import DEFAULT_MODEL, resolve

    s = model_shape(DEFAULT_MODEL, "int4")
    reader = gguf.GGUFReader(str(resolve(DEFAULT_MODEL).path))
    matrices = sum(int(t.n_elements) for t in reader.tensors if len(t.shape) == 2)  # tied: embedding only
    assert s.params == matrices
    assert (s.n_layers, s.d_model, s.n_kv_heads, s.head_dim, s.q_dim) == (30, 576, 3, 64, 576)


def test_self_draft_keeps_the_head_and_a_share_of_the_blocks():
    target = shape("t", layers=8, d_model=64, kv_heads=2, head_dim=16, d_ff=128, heads=4, vocab=100, fmt="int4")
    d = draft_shape("self:2", target, "int4")
    assert (d.n_layers, d.body_params, d.head_params) == (2, target.body_params // 4, 100 * 64)
    with pytest.raises(SpecstackError, match="9 layers"):
        draft_shape("self:9", target, "int4")


def test_bytes_follow_the_format():
    s = shape("t", layers=2, d_model=64, kv_heads=2, head_dim=16, d_ff=128, vocab=100, fmt="int4")
    assert s.weight_bytes == s.body_params * 0.625 + s.head_params * 1.0  # int4 body, int8 head
    assert s.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2  # bf16 cache
    fp8 = s.in_format("fp8")
    assert fp8.weight_bytes == fp8.params and fp8.kv_bytes_per_token == fp8.kv_values_per_token


def test_description_matches_the_named_shape():
    d = describe("layers=8,d_model=512,kv_heads=8,head_dim=128,d_ff=4096")
    assert (d.params, d.kv_values_per_token) == (TARGET.params, TARGET.kv_values_per_token)
    assert describe("layers=8,d_model=512,kv_heads=8,head_dim=128,params=67.1M").params == 67_100_000
    assert describe("layers=2,d_model=64,kv_heads=2,head_dim=32,d_ff=128,window=64").window == 64


@pytest.mark.parametrize("text,phrase", [
    ("layers=8,d_model=512", "missing kv_heads, head_dim"),
    ("layers=8,d_model=512,kv_heads=8,head_dim=128", "give d_ff"),
    ("layers=8,d_model=512,kv_heads=8,head_dim=128,d_ff=x", "is not a count"),
    ("layers=8,d_model=512,kv_heads=8,head_dim=128,d_ff=1.5", "must be an integer"),
    ("layers=8,d_model=512,kv_heads=8,head_dim=128,d_ff=64,experts=8", "bad item 'experts=8'"),
    ("layers=8,layers=4,d_model=512,kv_heads=8,head_dim=128,d_ff=64", "layers given twice"),
    ("layers=0,d_model=512,kv_heads=8,head_dim=128,d_ff=64", "layers=0"),
    ("layers=8,d_model=512,heads=6,kv_heads=4,head_dim=128,d_ff=64", "not a multiple"),
])
def test_bad_descriptions(text, phrase):
    with pytest.raises(SpecstackError, match=phrase):
        describe(text)


# ---------------------------------------------------------------------------------------------------
# Passes and rounds, by hand
# ---------------------------------------------------------------------------------------------------
def test_target_step_at_batch_64_by_hand():
    cost = pass_cost(TARGET, 64, 1, 512, PUBLISHED)
    assert cost.flops == 2 * 67_108_864 * 64
    assert cost.bytes == 67_108_864 + 64 * 512 * 2 * 8 * 8 * 128
    assert H100.seconds(cost) == pytest.approx(max(cost.flops, cost.bytes * 600) / H100.flops_per_s)


def test_sparse_drafts_keep_one_plus_an_eighth_of_the_context():
    for context, kept in ((512, 65), (4096, 513), (7, 1), (1, 1)):
        assert magicdec_draft(TARGET).kv_positions(context, ENGINE) == kept
    assert magicdec_draft(TARGET, window=100).kv_positions(4096, ENGINE) == 100
    assert vanilla_draft(TARGET).kv_positions(4096, ENGINE) == 4096


def test_spire_draft_pays_for_projecting_memories():
    d = spire_draft(TARGET)
    plain = pass_cost(d.shape, 8, 1, 65, PUBLISHED)
    with_memories = pass_cost(d.shape, 8, 1, 65, PUBLISHED, memory_projection=True)
    assert with_memories.flops - plain.flops == 2 * (2 * 2 * 8 * 512 * 128) * 8
    assert with_memories.bytes == plain.bytes


def test_attention_flops_are_counted_in_the_engine_conventions():
    a = pass_cost(TARGET, 2, 3, 100, ENGINE).flops - pass_cost(TARGET, 2, 3, 100, PUBLISHED).flops
    assert a == 4 * 2 * 3 * 100 * TARGET.q_dim * TARGET.n_layers


def test_additive_hardware_adds_times_and_fixed_costs():
    hw = Hardware("cpu", 1e9, 1e8, kv_bytes_per_s=5e7, overlap="sum", seconds_per_pass=0.002, seconds_per_layer=1e-4)
    cost = pass_cost(TARGET, 1, 1, 10, ENGINE)
    assert cost.layers == 8
    fixed = 0.002 + 8 * 1e-4
    assert hw.seconds(cost) == pytest.approx(fixed + cost.flops / 1e9 + cost.weight_bytes / 1e8 + cost.kv_bytes / 5e7)


def test_k_zero_is_plain_decoding():
    for conv in (ENGINE, PUBLISHED):
        rnd = round_times(TARGET, spire_draft(TARGET), H100, 8, 512, 0, conv)
        assert rnd.delta_t == 1.0 and rnd.t_draft == 0.0
        assert rnd.multiplier(1.0) == 1.0
        with pytest.raises(SpecstackError, match=r"\[1, 1\]"):
            rnd.multiplier(1.5)


def test_a_free_draft_and_verification_give_tau():
    # Δt -> 1 when drafting costs nothing and verifying k + 1 costs one step (memory-bound, tiny batch)
    free = replace(TARGET, name="free", body_params=1, n_layers=1, n_kv_heads=1, head_dim=1, q_dim=1)
    rnd = round_times(TARGET, vanilla_draft(free), H100, 1, 512, 4, PUBLISHED)
    assert rnd.multiplier(3.0) == pytest.approx(3.0, rel=1e-3)


# ---------------------------------------------------------------------------------------------------
# B_crit and L_crit agree with the round model
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("conv", [ENGINE, PUBLISHED], ids=["engine", "published"])
def test_b_crit_is_where_verification_turns_compute_bound(conv):
    for context in (8, 32):
        b = b_crit(TARGET, H100, context, 4, conv)
        assert b is not None and b > 1
        below = round_times(TARGET, magicdec_draft(TARGET), H100, math.floor(b * 0.95), context, 4, conv)
        above = round_times(TARGET, magicdec_draft(TARGET), H100, math.ceil(b * 1.05), context, 4, conv)
        assert not below.verify_compute_bound and above.verify_compute_bound


@pytest.mark.parametrize("conv", [ENGINE, PUBLISHED], ids=["engine", "published"])
def test_no_b_crit_past_l_crit(conv):
    lc = l_crit(TARGET, H100, 4, conv)
    assert b_crit(TARGET, H100, math.floor(lc) - 1, 4, conv) is not None
    assert b_crit(TARGET, H100, math.ceil(lc) + 1, 4, conv) is None
    huge = round_times(TARGET, magicdec_draft(TARGET), H100, 1_000_000, math.ceil(lc) + 1, 4, conv)
    assert not huge.verify_compute_bound


def test_l_crit_is_infinite_when_attention_alone_is_compute_bound():
    # many query heads per KV head on a low-HOI machine: attention's FLOPs outgrow its bytes
    s = shape("gqa", layers=2, d_model=4096, heads=64, kv_heads=1, head_dim=64, d_ff=64)
    assert l_crit(s, Hardware("slow", 1e12, 1e12), 4, ENGINE) == math.inf


# ---------------------------------------------------------------------------------------------------
# Grid, inputs
# ---------------------------------------------------------------------------------------------------
def test_grid_skips_designs_without_tau():
    drafts = [vanilla_draft(TARGET.first_layers(1)), spire_draft(TARGET), magicdec_draft(TARGET)]
    cells = grid(TARGET, drafts, {"spire": 3.4, "magicdec": 3.9}, [1, 8], [512, 4096, 65536], 4, H100)
    assert [c.design for c in cells] == ["spire"] * 6 + ["magicdec"] * 6
    assert all(c.multiplier > 0 for c in cells)


@pytest.mark.parametrize("kwargs,phrase", [
    ({"batch": 0}, "batch must be an integer >= 1"),
    ({"context": 0}, "context must be an integer >= 1"),
    ({"k": -1}, "k must be an integer >= 0"),
    ({"batch": 2.5}, "batch must be an integer"),
])
def test_bad_round_inputs(kwargs, phrase):
    args = {"batch": 1, "context": 512, "k": 4} | kwargs
    with pytest.raises(SpecstackError, match=phrase):
        round_times(TARGET, spire_draft(TARGET), H100, args["batch"], args["context"], args["k"])


@pytest.mark.parametrize("tau", [0.5, 5.01, float("nan"), float("inf")])
def test_tau_outside_one_to_k_plus_1(tau):
    rnd = round_times(TARGET, spire_draft(TARGET), H100, 8, 512, 4)
    with pytest.raises(SpecstackError, match="tau must be in"):
        rnd.multiplier(tau)


def test_bad_hardware_and_conventions():
    with pytest.raises(SpecstackError, match="positive"):
        Hardware("x", 0.0, 1e9)
    with pytest.raises(SpecstackError, match="overlap"):
        Hardware("x", 1e9, 1e9, overlap="min")
    with pytest.raises(SpecstackError, match="verify_extra"):
        Conventions(verify_extra=2)
    with pytest.raises(SpecstackError, match="not a hardware description"):
        Hardware.from_json({"name": "x"})


# ---------------------------------------------------------------------------------------------------
# Calibration fit (the measuring half needs the model: tests/cli/test_cli_throughput.py)
# ---------------------------------------------------------------------------------------------------
SMALL = shape("s", layers=2, d_model=64, kv_heads=2, head_dim=16, d_ff=128, vocab=1000, fmt="int4")
WIDE = shape("w", layers=3, d_model=128, kv_heads=2, head_dim=32, d_ff=512, vocab=300, fmt="int4")
THREE_SHAPES = (SMALL, SMALL.first_layers(1), WIDE)  # two widths: every term of the fit is identifiable


def _samples(hw: Hardware, shapes=THREE_SHAPES) -> list[calibrate.Sample]:
    out = []
    for s in shapes:
        for t in (1, 2, 4, 8):
            for ctx in (16, 256):
                cost = pass_cost(s, 1, t, ctx, ENGINE)
                out.append(calibrate.Sample(s.name, s.n_layers, t, ctx, hw.seconds(cost), cost))
    return out


TRUE = Hardware("made", 3e9, 2e9, kv_bytes_per_s=5e8, overlap="sum", seconds_per_pass=1e-3, seconds_per_layer=2e-4)


def test_fit_recovers_the_machine_that_made_the_times():
    got = calibrate.fit(_samples(TRUE), fmt="int4")
    assert got.overlap == "sum"
    for field in ("flops_per_s", "bytes_per_s", "kv_bytes_per_s", "seconds_per_pass", "seconds_per_layer"):
        assert getattr(got, field) == pytest.approx(getattr(TRUE, field), rel=1e-6), field
    assert max(calibrate.errors(got, _samples(TRUE))) < 1e-9


def test_fit_on_self_drafts_alone_still_predicts_every_depth():
    # layers and weight bytes move together: the split between them is not identifiable, the times are
    one_model = (SMALL, SMALL.first_layers(1))
    got = calibrate.fit(_samples(TRUE, one_model))
    deeper = replace(SMALL, n_layers=6, body_params=SMALL.body_params * 3)
    assert max(calibrate.errors(got, _samples(TRUE, (deeper,)))) < 1e-6


def test_fit_never_returns_a_negative_cost():
    # times that fall with the KV bytes cannot be fitted with a negative bandwidth: the KV term drops out
    true = Hardware("made", 3e9, 2e9, overlap="sum", seconds_per_pass=1e-3)
    samples = [replace(s, seconds=s.seconds * (1.05 if s.context == 16 else 0.95)) for s in _samples(true)]
    got = calibrate.fit(samples)
    assert got.seconds_per_pass >= 0 and got.kv_rate > 1e20  # 1 / 0: the term is free
    with pytest.raises(SpecstackError, match="at least 4"):
        calibrate.fit(samples[:3])


def test_calibration_files_round_trip(tmp_path):
    hw = Hardware("local", 3e9, 2e9, kv_bytes_per_s=5e8, overlap="sum", seconds_per_pass=1e-3, seconds_per_layer=1e-4,
                  fmt="int4")
    cal = calibrate.Calibration(hw, _samples(hw), 0.0, 0.0, {"cpu": "test"})
    path = tmp_path / "cal.json"
    calibrate.save(cal, path)
    assert hardware.load_hardware(str(path)) == hw
    assert hardware.load_hardware("a100-bf16") is PRESETS["a100-bf16"]
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(SpecstackError, match="not a calibration file"):
        hardware.load_hardware(str(tmp_path / "bad.json"))
    with pytest.raises(SpecstackError, match="unknown hardware"):
        hardware.load_hardware("tpu-v9")


def test_check_row_takes_per_prompt_ratios():
    from specstack.throughput.check import Run, check_row

    rnd = round_times(TARGET, spire_draft(TARGET), H100, 1, 512, 2)
    # ar: 10 ms per step on prompt a, 20 ms on b (the machine got busier); chain: 2 tokens per round
    base = [Run(64, 63, 1.0, {"decode": 0.63}), Run(64, 63, 2.0, {"decode": 1.26})]
    spec = [Run(64, 32, 1.0, {"decode": 0.96, "draft": 0.32, "target": 0.64}),
            Run(64, 32, 3.0, {"decode": 1.92, "draft": 0.64, "target": 1.28})]
    row = check_row("chain:k=2", 2, 2.0, 512, rnd, base, spec)
    assert row.measured == pytest.approx(10 / 15)  # 10 ms vs 0.96 s / 64 = 15 ms per token, on both prompts
    assert row.passes_multiplier == pytest.approx(2 * 10 / 30)  # τ t_target / (draft + verify per round)
    assert row.wall == pytest.approx((3.0 / 128) / (4.0 / 128))
    assert row.t_target == pytest.approx(0.015)  # median of 10 and 20 ms
