"""OpenVINO GenAI as a peer (bench/openvino_peer.py through bench/peer_child.py), run for real on the
default model's GGUF: exactly n tokens whatever EOS does, greedy and seeded sampling repeatable, prompt
lookup, what ran said in the report; the IR and draft-model variants say what they lack."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specstack.bench import openvino_peer
from specstack.config import SamplingParams
from specstack.machine import package_version

pytestmark = pytest.mark.skipif(package_version(openvino_peer.DIST) is None,
                                reason="openvino-genai is not installed (the `openvino` extra)")
IDS = [504, 3458, 282, 4649, 314, 28, 2]  # ends in EOS: generation must go on past it


@pytest.fixture(scope="module")
def gguf() -> str:
    from specstack.models.registry import resolve

    return str(resolve("smollm2-135m").path)


def test_exactly_n_tokens_greedy_and_seeded_sampling_repeat(gguf):
    from specstack.bench.peer_child import PeerChild

    child = PeerChild("openvino-genai", model=gguf, threads=1)
    try:
        assert child.about.startswith(f"openvino-genai {package_version('openvino-genai')}") and "the GGUF" in child.about
        greedy = SamplingParams()
        first = child.generate(IDS, 12, greedy)
        assert len(first) == 12 and child.generate(IDS, 12, greedy) == first
        assert child.generate(IDS, 5, greedy) == first[:5], "a shorter greedy run is the same prefix"
        hot = [SamplingParams(temperature=1.5, top_k=0, top_p=1.0, seed=s) for s in (3, 3, 4)]
        a, b, c = (child.generate(IDS, 12, s) for s in hot)
        assert len(a) == 12 and a == b, "one seed, one sample"
        assert a != c, "another seed, another sample (at temperature 1.5 over 12 tokens)"
    finally:
        child.close()


def test_prompt_lookup_generates_n_tokens(gguf):
    from specstack.bench.peer_child import PeerChild

    child = PeerChild("openvino-genai", model=gguf, threads=1, prompt_lookup=4, ngram=2)
    try:
        assert len(child.generate(IDS * 3, 16, SamplingParams())) == 16
    finally:
        child.close()


def test_ir_and_draft_variants_say_what_they_lack(tmp_path, monkeypatch):
    from specstack.bench.peer_runners import Peers
    from specstack.bench.plan import parse_methods
    from specstack.engine.methods import DraftSources

    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    methods = {m.name: m for m in parse_methods(["openvino;openvino-ir;openvino-spec;openvino-pld:tokens=4"], "w4a8")}
    peers = Peers("smollm2-135m", DraftSources(None), SamplingParams(), "cpu", 1, None)
    assert peers.unavailable(methods["openvino"]) is None and peers.unavailable(methods["openvino-pld"]) is None
    why = peers.unavailable(methods["openvino-ir"])
    assert why is not None and str(tmp_path / "openvino" / "smollm2-135m-int4-g32") in why and "export_openvino.sh" in why
    assert "needs a draft model" in (peers.unavailable(methods["openvino-spec"]) or "")
    ir = openvino_peer.ir_dir("smollm2-135m")
    ir.mkdir(parents=True)
    (ir / "openvino_model.xml").write_text("<net/>")
    assert peers.unavailable(methods["openvino-ir"]) is None


def test_the_report_says_what_ran(bench, tmp_path: Path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"task_id": "t0", "prompt": "def f(x):"}) + "\n")
    out = tmp_path / "run"
    code, _, err = bench("--model", "smollm2-135m", "--prompts", str(prompts), "--max-new-tokens", "6",
                         "--threads", "1", "--out", str(out), "--methods", "ar;openvino")
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["method"] for r in rows) == ["ar", "openvino"] and all(r["new_tokens"] == 6 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["peers"]["openvino"].startswith("openvino-genai ")
    assert any(line.startswith("- peer openvino: openvino-genai ") for line in (out / "summary.md").read_text().splitlines())
