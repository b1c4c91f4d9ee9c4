"""`specstack generate` end to end: streamed text on stdout, the stats line last on stderr, exit 0."""
from __future__ import annotations

import pytest

import specstack.cli.generate
from specstack.models.registry import DEFAULT_MODEL


def stderr_stats(err: str, stats_line) -> str:
    last = err.rstrip("\n").splitlines()[-1]
    assert stats_line.match(last), err
    assert "Traceback" not in err
    return last


def test_tiny_model_generates(run_cli, tiny_model, stats_line):
    r = run_cli("generate", "--model", tiny_model, "--prompt", "hello", "--max-new-tokens", "5", "--dtype", "fp32")
    assert r.code == 0, r.err
    assert stderr_stats(r.err, stats_line).startswith("5 tokens in ")  # random weights: EOS is unlikely
    assert r.err.rstrip("\n").endswith("; weights fp32")


def test_the_stats_line_names_the_kernel_path_of_a_batch_invariant_format(run_cli, tiny_model, stats_line,
                                                                           monkeypatch):
    """...and whether the blocks ran as one native call (where the layer library builds, unless forced off)."""
    import torch

    from specstack.models import native, native_decoder, w4a8

    monkeypatch.delenv(native_decoder.FORCE_ENV, raising=False)
    r = run_cli("generate", "--model", tiny_model, "--prompt", "hello", "--max-new-tokens", "3", "--dtype", "w4a8")
    path = w4a8.kernel_for(torch.device("cpu")).name
    blocks = ", native blocks" if path != "reference" and native.supported("layer") else ""
    assert stderr_stats(r.err, stats_line).endswith(f"; weights w4a8 ({path} kernels{blocks})")
    monkeypatch.setenv(native_decoder.FORCE_ENV, "eager")
    r = run_cli("generate", "--model", tiny_model, "--prompt", "hello", "--max-new-tokens", "3", "--dtype", "w4a8")
    assert stderr_stats(r.err, stats_line).endswith(f"; weights w4a8 ({path} kernels)")


def test_output_is_streamed_and_matches_result(run_cli, tiny_model, monkeypatch):
    pieces: list[str] = []
    results = []
    run = specstack.cli.generate.run_generation

    def spy(lm, ids, gen, on_text, **kw):
        def tee(text: str) -> None:
            pieces.append(text)
            on_text(text)

        res = run(lm, ids, gen, on_text=tee, **kw)
        results.append(res)
        return res

    monkeypatch.setattr(specstack.cli.generate, "run_generation", spy)
    r = run_cli("generate", "--model", tiny_model, "--prompt", "hello", "--max-new-tokens", "6", "--dtype", "fp32",
                "--temperature", "0.8", "--top-k", "50", "--top-p", "0.9", "--seed", "1")
    assert r.code == 0, r.err
    (res,) = results
    assert "".join(pieces) == res.text
    assert r.out == res.text + ("\n" if res.text and not res.text.endswith("\n") else "")


def test_prompt_file_chat_threads(run_cli, tiny_model, tmp_path, stats_line):
    import torch

    p = tmp_path / "prompt.txt"
    p.write_bytes("\ufeffcaf\u00e9 \u2014 na\u00efve?\n".encode("utf-8"))  # UTF-8 with a BOM
    threads = torch.get_num_threads()
    try:
        r = run_cli("generate", "--model", tiny_model, "--prompt-file", str(p), "--chat", "--threads", "1",
                    "--max-new-tokens", "3", "--dtype", "fp32", "--stop", "zz", "--stop", "yy")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert r.code == 0, r.err
    stderr_stats(r.err, stats_line)


def test_default_model_greedy_default_format(run_cli, stats_line):
    """The README's main command on the embedded default model (greedy, the CPU's default format: w4a8
    where its kernels build, int4 elsewhere)."""
    r = run_cli("generate", "--model", DEFAULT_MODEL, "--prompt", "def add(a, b):", "--max-new-tokens", "8")
    assert r.code == 0, r.err
    assert r.out.strip()
    stderr_stats(r.err, stats_line)


@pytest.mark.parametrize("argv", [("--help",), ("generate", "--help")])
def test_help_exits_0(run_cli, argv):
    r = run_cli(*argv)
    assert r.code == 0 and "usage: specstack" in r.out
