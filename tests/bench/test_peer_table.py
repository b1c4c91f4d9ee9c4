"""The table of peers (bench/peer_table.py) against what runs them (bench/peer_runners.py): every row's kind
has a runner (or is the batch-only llama-batched-bench, bench/batched.py's), a prompt-lookup row takes its
draft length, and every row that speculates with --draft says so when there is none."""
from __future__ import annotations

from specstack.bench.peer_runners import Peers
from specstack.bench.peer_table import PEERS
from specstack.bench.plan import parse_methods
from specstack.config import SamplingParams
from specstack.engine.methods import DraftSources


def _peers() -> Peers:
    return Peers("smollm2-135m", DraftSources(None), SamplingParams(), "cpu", 1, None)


def test_every_row_has_a_runner_and_its_parameters():
    kinds = set(_peers()._kinds())
    for name, kind in PEERS.items():
        assert kind.runs in kinds or (kind.batch_only and kind.runs == "llama-batched-bench"), name
        assert not kind.lookup or "tokens" in kind.params, f"{name}: a prompt lookup drafts `tokens` a step"
        assert not kind.ir or kind.runs == "openvino-genai", name


def test_a_peer_that_speculates_with_a_draft_model_says_it_has_none(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    peers = _peers()
    drafted = [name for name, kind in PEERS.items() if kind.draft]
    assert sorted(drafted) == ["hf-assisted", "llamacpp-spec", "openvino-spec"]
    for m in parse_methods([";".join(drafted)], "w4a8"):
        why = peers.unavailable(m)
        assert why is not None and "draft" in why, (m.name, why)
