"""The physical limit of a step (bench/bandwidth.py): the bytes a one-token forward reads, counted by hand
from the tiny Llama's shapes in two formats, and the table that sets a measured forward beside its floor."""
from __future__ import annotations

import pytest

from specstack.bench.bandwidth import StepLimit, limit_table, resident_bytes, step_bytes
from specstack.models.loading import load_model


def linear_shapes(cfg) -> list[tuple[int, int]]:
    """(out, in) of every linear layer a one-token step multiplies by: q, k, v, o, gate, up, down, head."""
    hd = cfg.head_dim or cfg.d_model // cfg.n_heads
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    layer = [(q, cfg.d_model), (kv, cfg.d_model), (kv, cfg.d_model), (cfg.d_model, q),
             (cfg.d_ff, cfg.d_model), (cfg.d_ff, cfg.d_model), (cfg.d_model, cfg.d_ff)]
    return layer * cfg.n_layers + [(cfg.vocab_size, cfg.d_model)]


@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_step_bytes_count_each_weight_once_in_its_format(tiny_models, fmt, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    lm = load_model(str(tiny_models["llama"].path), dtype=fmt, use_cache=False, tokenizer=False)
    cfg = lm.config
    shapes = linear_shapes(cfg)
    if fmt == "fp32":
        expected = sum(4 * n * k for n, k in shapes)
    else:  # int8 codes, one bf16 scale per output row; the dense copy for wide inputs is not read
        expected = sum(n * k + 2 * n for n, k in shapes)
    embed_row = cfg.d_model * (4 if fmt == "fp32" else 2)
    assert step_bytes(lm) == expected + embed_row
    # what it holds: every tensor once (int8: its codes, scales, and the bf16 copy for wide inputs)
    held = sum(4 * n * k for n, k in shapes) if fmt == "fp32" else sum(n * k + 2 * n + 2 * n * k for n, k in shapes)
    norms_and_embed = resident_bytes(lm) - held
    assert 0 < norms_and_embed <= (cfg.vocab_size + (2 * cfg.n_layers + 1) * 4) * cfg.d_model * 4 + 2 * 10**5


def test_limit_table_sets_the_measured_step_beside_its_floor():
    limits = [StepLimit("int4", 1_050_000_000, 1e3 * 1.05 / 46), StepLimit("int8", 1_600_000_000, 1e3 * 1.6 / 46)]
    md = limit_table(limits, {"int4": 94.7}, 46e9)
    assert "floor at 46.0 GB/s" in md
    assert "| int4 | 1050.0 MB | 22.83 | 94.7 | 4.15 |" in md
    assert "| int8 | 1600.0 MB | 34.78 | – | – |" in md
    held = [StepLimit("int4", 1_050_000_000, 1e3 * 1.05 / 46, resident=3_600_000_000)]
    assert "| int4 | 1050.0 MB | 22.83 | 94.7 | 4.15 | 3600.0 |" in limit_table(held, {"int4": 94.7}, 46e9)
