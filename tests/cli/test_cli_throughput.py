"""`specstack throughput`, `throughput-calibrate` and `throughput-check`: the published check values
through the CLI (table, heat-map, JSON), --tau auto / calibration / the bench comparison end to end on
the tiny random Llama, and one-line errors (exit 2) for bad input."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_cli_errors import assert_error

from specstack.throughput.model import PRESETS, PUBLISHED, magicdec_draft, round_times
from specstack.throughput.shapes import NAMED

PUBLISHED_ARGS = ("throughput", "--target", "spire-67m", "--k", "4", "--conventions", "published",
                  "--designs", "spire,magicdec", "--tau", "spire=3.401,magicdec=3.891", "--batch", "8,64",
                  "--context", "512")


def test_published_values_through_the_cli(run_cli, tmp_path):
    plot, data = tmp_path / "heat.png", tmp_path / "cells.json"
    r = run_cli(*PUBLISHED_ARGS, "--plot", str(plot), "--json", str(data))
    assert r.code == 0, r.err
    assert "L_crit = 55 tokens" in r.out
    assert "L = 512: none" in r.out  # past L_crit: no B_crit
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| (\d+) \| ([\d.]+) \(", r.out, re.MULTILINE)}
    assert rows == {"8": "1.20", "64": "2.05"}  # the last table printed is MagicDec's
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cells = json.loads(data.read_text())["cells"]
    got = {(c["design"], c["batch"]): round(c["multiplier"], 2) for c in cells}
    assert got == {("spire", 8): 2.18, ("spire", 64): 2.78, ("magicdec", 8): 1.20, ("magicdec", 64): 2.05}
    t = NAMED["spire-67m"]
    expect = round_times(t, magicdec_draft(t), PRESETS["h100-fp8"], 64, 512, 4, PUBLISHED).delta_t
    assert next(c["delta_t"] for c in cells if (c["design"], c["batch"]) == ("magicdec", 64)) == pytest.approx(expect)


def test_spire_is_left_out_without_a_tau(run_cli, tmp_path):
    r = run_cli("throughput", "--target", "spire-67m", "--tau", "vanilla=2.6,magicdec=3.9",
                "--plot", str(tmp_path / "p.png"))
    assert r.code == 0, r.err
    assert "spire: left out" in r.err
    assert "## vanilla" in r.out and "## magicdec" in r.out and "## spire" not in r.out


def _jsonl(tmp_path: Path) -> str:
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"task_id": t, "prompt": s}) + "\n"
                         for t, s in (("a", "def add(a, b):"), ("b", "The sky is blue and"))))
    return str(p)


def test_tau_auto_calibrate_and_check_on_a_tiny_model(run_cli, tiny_model, tmp_path):
    prompts = _jsonl(tmp_path)
    # 1. τ measured with the engine (vanilla and MagicDec); SPIRe's given
    r = run_cli("throughput", "--target", tiny_model, "--draft", "self:1", "--dtype", "fp32", "--tau",
                "auto,spire=1.5", "--k", "2", "--prompts", prompts, "--max-new-tokens", "6",
                "--engine-dtype", "fp32", "--batch", "1", "--context", "32", "--plot", str(tmp_path / "p.png"))
    assert r.code == 0, r.err
    lines = re.split(r"[\r\n]", r.err)  # progress bars redraw with carriage returns
    taus = {m.group(1): float(m.group(2)) for line in lines if (m := re.match(r"tau (\w+): ([\d.]+) \(", line))}
    assert set(taus) == {"vanilla", "magicdec"} and all(1 <= t <= 3 for t in taus.values())
    assert "τ = 1.500" in r.out
    # 2. this machine's preset, from the tiny model's forwards
    cal = tmp_path / "cal.json"
    r = run_cli("throughput-calibrate", "--model", tiny_model, "--dtype", "fp32", "--draft", "self:1",
                "--draft-dtype", "fp32", "--contexts", "8,24", "--tokens", "1,2,4", "--repeats", "2", "--warmup", "1",
                "--out", str(cal))
    assert r.code == 0, r.err
    saved = json.loads(cal.read_text())
    assert saved["hardware"]["overlap"] == "sum" and len(saved["samples"]) == 2 * 2 * 3
    r = run_cli("throughput", "--target", tiny_model, "--hardware", str(cal), "--tau", "1.5", "--k", "2",
                "--plot", str(tmp_path / "local.png"))
    assert r.code == 0, r.err
    assert "additive" in r.out and "none on an additive machine" in r.out and "fp32" in r.out  # the preset's format
    # 3. a bench run checked against it
    bench = tmp_path / "bench"
    r = run_cli("bench", "--model", tiny_model, "--prompts", prompts, "--methods", "ar;chain:k=2", "--dtype", "fp32",
                "--draft", "self:1", "--draft-dtype", "fp32", "--max-new-tokens", "6", "--out", str(bench))
    assert r.code == 0, r.err
    r = run_cli("throughput-check", str(bench), "--hardware", str(cal))
    assert r.code == 0, r.err
    row = next(line for line in r.out.splitlines() if line.startswith("| chain:k=2"))
    tau = float(row.split("|")[2])
    results = [json.loads(line) for line in (bench / "results.jsonl").read_text().splitlines()]
    chain = [x for x in results if x["method"] == "chain:k=2"]
    assert tau == pytest.approx(sum(x["new_tokens"] for x in chain) / sum(x["target_forwards"] for x in chain),
                                abs=5e-4)


ERRORS = {
    "k < 0": (("--k", "-1"), "--k must be >= 0"),
    "tau < 1": (("--tau", "0.5"), "tau must be in [1, k + 1]"),
    "tau > k+1": (("--tau", "5.5"), "tau must be in [1, k + 1] = [1, 5]"),
    "tau word": (("--tau", "fast"), "'fast' is not a number"),
    "tau design": (("--tau", "medusa=2"), "unknown design 'medusa'"),
    "spire auto": (("--tau", "spire=auto"), "cannot run a spire draft"),
    "batch 0": (("--batch", "0"), "expected positive integers"),
    "context word": (("--context", "long"), "expected comma-separated integers"),
    "designs": (("--designs", "eagle"), "designs must be among"),
    "hardware": (("--hardware", "tpu-v9"), "unknown hardware 'tpu-v9'"),
    "description": (("--target", "layers=8,d_model=512"), "missing kv_heads, head_dim"),
    "self draft": (("--draft", "self:99"), "99 layers of 'spire-67m'"),
    "spire layers": (("--spire-layers", "9"), "the target has 8 layers"),
    "auto on a shape": (("--tau", "auto"), "--target must be a model it can load"),
    "plot folder": (("--plot", "/nonexistent/dir/p.png"), "folder /nonexistent/dir does not exist"),
}


@pytest.mark.parametrize("extra,phrase", ERRORS.values(), ids=ERRORS.keys())
def test_throughput_errors(run_cli, extra, phrase):
    base = {"--target": "spire-67m", "--tau": "2"}
    argv = ["throughput"]
    for flag, value in base.items():
        if flag not in extra:
            argv += [flag, value]
    assert_error(run_cli(*argv, *extra), phrase)


def test_local_hardware_without_calibration(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    assert_error(run_cli("throughput", "--target", "spire-67m", "--tau", "2", "--hardware", "local"),
                 "run `specstack throughput-calibrate`")


def test_check_needs_a_bench_run(run_cli, tmp_path):
    assert_error(run_cli("throughput-check", str(tmp_path), "--hardware", "h100-fp8"), "no run.json")
