"""`specstack generate` with several rows (issue 19): --n samples of a prompt and prompt files of many
prompts (`.jsonl`, --per-line) decode together in the batched engine, and every row is what that
prompt decodes to alone: greedy rows equal the single-row run, seeded sample i equals the single run
with --seed S + i. Rows print in input order (a header or one JSON line each). Bad input (a count of
0, a broken JSONL line, an empty prompt among many) is one error line, exit 2, nothing on stdout."""
from __future__ import annotations

import json
import re

import pytest
from cli.test_cli_errors import assert_error

import specstack.cli.generate

FP32 = ("--dtype", "fp32", "--max-new-tokens", "6")
HEADER = re.compile(r"^### prompt (\d+), sample (\d+) \(finish: (\w+), (\d+) tokens\)$", re.M)
TOTAL = re.compile(r"^(\d+) rows: (\d+) tokens in \d+\.\d+ s \(\d+\.\d+ tokens/s; batch size (\d+); "
                   r"draft \d+\.\d+ s, target \d+\.\d+ s, verify \d+\.\d+ s, overhead \d+\.\d+ s\); method (\S.*?); weights \S.*$")
PROMPTS = ["hello", "def add(a, b):\n    return", "The quick brown fox jumps over the lazy dog because"]
FIELDS = {"prompt_index", "sample", "seed", "text", "finish_reason", "new_tokens", "prompt_tokens", "seconds",
          "tokens_per_s"}


def single(run_cli, model: str, prompt: str, *flags: str) -> str:
    """stdout of the one-row run (the streaming single-sequence engine, as before batching)."""
    r = run_cli("generate", "--model", model, "--prompt", prompt, *FP32, *flags)
    assert r.code == 0 and "### " not in r.out, r.err
    return r.out


def as_printed(text: str) -> str:
    """A row's text as the one-row run prints it (a newline added when it has none)."""
    return text if not text or text.endswith("\n") else text + "\n"


def plain_rows(out: str) -> list[tuple[int, int, str]]:
    """(prompt, sample, text) of each `### prompt P, sample S (...)` block, in order."""
    heads = list(HEADER.finditer(out))
    assert heads and out.startswith("### "), out
    ends = [h.start() for h in heads[1:]] + [len(out)]
    return [(int(h[1]), int(h[2]), out[h.end() + 1 : end]) for h, end in zip(heads, ends, strict=True)]


def jsonl_rows(out: str) -> list[dict]:
    rows = [json.loads(line) for line in out.splitlines()]
    for row in rows:
        assert set(row) == FIELDS, row
    return rows


def total(err: str) -> re.Match[str]:
    assert "Traceback" not in err
    m = TOTAL.match(err.rstrip("\n").splitlines()[-1])
    assert m, err
    return m


@pytest.fixture
def batched_only(monkeypatch):
    """From the call on, a row decoded by the single-sequence engine fails the test: several rows must
    go through the batched engine (the one-row references are taken before)."""
    def fail(*_a, **_k):
        raise AssertionError("a row was decoded by the single-sequence engine")

    return lambda: monkeypatch.setattr(specstack.cli.generate, "run_generation", fail)


def test_greedy_samples_are_the_single_run(run_cli, tiny_model, stats_line, batched_only):
    alone = single(run_cli, tiny_model, "hello")
    batched_only()
    r = run_cli("generate", "--model", tiny_model, "--prompt", "hello", *FP32, "--n", "3")
    assert r.code == 0, r.err
    assert plain_rows(r.out) == [(1, s, alone) for s in (1, 2, 3)]
    assert r.err.count("specstack: warning: --n 3 with greedy decoding") == 1
    tokens = sum(int(h[3]) for h in HEADER.findall(r.out))
    assert total(r.err).groups() == ("3", str(tokens), "3", "auto (ngram:max=8,cost=1,match=6)")
    per_row = [line for line in r.err.splitlines() if line.startswith("prompt 1, sample ")]
    assert len(per_row) == 3 and all(stats_line.match(line.split(": ", 1)[1]) for line in per_row), r.err


def test_seeded_sample_i_is_the_single_run_with_seed_plus_i(run_cli, tiny_model, batched_only):
    sampling = ("--temperature", "1", "--top-k", "50")
    alone = [single(run_cli, tiny_model, "hello", *sampling, "--seed", str(5 + i)) for i in range(3)]
    batched_only()
    r = run_cli("generate", "--model", tiny_model, "--prompt", "hello", *FP32, *sampling, "--seed", "5", "--n", "3",
                "--jsonl", "--batch-size", "2")  # the third sample waits for a free row
    assert r.code == 0, r.err
    assert "warning" not in r.err
    rows = jsonl_rows(r.out)
    assert [(x["prompt_index"], x["sample"], x["seed"]) for x in rows] == [(0, 0, 5), (0, 1, 6), (0, 2, 7)]
    assert [as_printed(x["text"]) for x in rows] == alone
    assert len({x["text"] for x in rows}) == 3  # distinct samples (top-k 50 of random weights: a repeat is ~never)
    assert total(r.err).group(3) == "2"


def test_unseeded_samples_differ(run_cli, tiny_model, batched_only):
    batched_only()
    r = run_cli("generate", "--model", tiny_model, "--prompt", "hello", *FP32, "--temperature", "1", "--n", "3",
                "--jsonl")
    assert r.code == 0, r.err
    rows = jsonl_rows(r.out)
    assert [x["seed"] for x in rows] == [None] * 3 and len({x["text"] for x in rows}) == 3


@pytest.fixture
def references(run_cli, tiny_model):
    return [single(run_cli, tiny_model, p) for p in PROMPTS]


def test_jsonl_prompt_file_gives_each_prompt_its_single_output(run_cli, tiny_model, references, tmp_path,
                                                              batched_only):
    batched_only()
    f = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": PROMPTS[0], "id": 7}), "", json.dumps(PROMPTS[1]), json.dumps({"prompt": PROMPTS[2]})]
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")  # a blank line between prompts is skipped
    r = run_cli("generate", "--model", tiny_model, "--prompt-file", str(f), *FP32, "--batch-size", "2")
    assert r.code == 0, r.err
    assert plain_rows(r.out) == [(i + 1, 1, ref) for i, ref in enumerate(references)]
    assert total(r.err).groups()[0::2] == ("3", "2")


def test_per_line_prompt_file_gives_each_prompt_its_single_output(run_cli, tiny_model, references, tmp_path,
                                                                 batched_only):
    # PROMPTS[1] spans two lines: --per-line reads its first line as a prompt of its own
    prompts = [PROMPTS[0], PROMPTS[2], "def add(a, b):"]
    refs = [references[0], references[2], single(run_cli, tiny_model, prompts[2])]
    batched_only()
    f = tmp_path / "prompts.txt"
    f.write_text(f"{prompts[0]}\n\n{prompts[1]}\r\n   \n{prompts[2]}", encoding="utf-8")
    r = run_cli("generate", "--model", tiny_model, "--prompt-file", str(f), "--per-line", *FP32, "--jsonl")
    assert r.code == 0, r.err
    rows = jsonl_rows(r.out)
    assert [as_printed(x["text"]) for x in rows] == refs
    assert [(x["prompt_index"], x["sample"], x["seed"]) for x in rows] == [(0, 0, None), (1, 0, None), (2, 0, None)]
    for x in rows:
        assert x["finish_reason"] in ("length", "eos", "stop") and 0 <= x["new_tokens"] <= 6
        assert x["prompt_tokens"] > 0 and x["seconds"] >= 0 and x["tokens_per_s"] >= 0


def test_samples_of_several_prompts_are_prompt_by_prompt(run_cli, tiny_model, tmp_path, batched_only):
    batched_only()
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in PROMPTS[:2]), encoding="utf-8")
    r = run_cli("generate", "--model", tiny_model, "--prompt-file", str(f), *FP32, "--n", "2", "--temperature", "1",
                "--seed", "9", "--jsonl")
    assert r.code == 0, r.err
    keys = [(x["prompt_index"], x["sample"], x["seed"]) for x in jsonl_rows(r.out)]
    assert keys == [(0, 0, 9), (0, 1, 10), (1, 0, 9), (1, 1, 10)]


def test_one_row_keeps_the_streaming_path(run_cli, tiny_model, tmp_path, stats_line):
    """A prompt file of one line (--per-line, or a .jsonl of one prompt) is one row: the one-row engine,
    its plain output and stats line, as with --prompt."""
    alone = single(run_cli, tiny_model, "hello")
    for name, body, flags in (("one.txt", "\nhello\n\n", ("--per-line",)), ("one.jsonl", '{"prompt": "hello"}\n', ())):
        f = tmp_path / name
        f.write_text(body, encoding="utf-8")
        r = run_cli("generate", "--model", tiny_model, "--prompt-file", str(f), *flags, *FP32)
        assert r.code == 0, r.err
        assert r.out == alone
        assert stats_line.match(r.err.rstrip("\n").splitlines()[-1]), r.err
    r = run_cli("generate", "--model", tiny_model, "--prompt", "hello", *FP32, "--jsonl")
    (row,) = jsonl_rows(r.out)
    assert as_printed(row["text"]) == alone and (row["prompt_index"], row["sample"]) == (0, 0)


# ---------------------------------------------------------------------------------------------------
# Refused runs: one error line, exit 2, nothing on stdout
# ---------------------------------------------------------------------------------------------------
def jsonl_file(tmp_path, *lines: str):
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return f


@pytest.mark.parametrize("flags, phrase", [
    (("--n", "0"), "--n must be >= 1, got 0"),
    (("--n", "-2"), "--n must be >= 1, got -2"),
    (("--n", "x"), "--n must be an integer"),
    (("--batch-size", "0"), "--batch-size must be >= 1, got 0"),
    (("--batch-size", "99999"), "--batch-size must be <= 1024, got 99999"),
    (("--n", "2", "--method", "chain:k=8,max=4"), "BASS's length starts at k and grows to max: need k <= max"),
    (("--n", "2", "--show-origins"), "--show-origins and --html show one generation, not 2 rows"),
    (("--n", "3", "--temperature", "1", "--seed", str(2**64 - 2)), "the samples would take seeds up to"),
    (("--per-line",), "--per-line splits a --prompt-file into prompts; --prompt is one prompt"),
], ids=["n0", "n-negative", "n-text", "batch0", "batch-huge", "bass-bounds", "origins", "seed-overflow",
        "per-line-prompt"])
def test_bad_counts_fail_before_loading(run_cli, no_model, flags, phrase):
    assert_error(run_cli("generate", "--prompt", "hi", *flags), phrase)


@pytest.mark.parametrize("lines, phrase", [
    (('{"prompt": "a"}', '{"prompt": "b"', '"c"'), "bad.jsonl line 2: not valid JSON"),
    (('{"prompt": "a"}', '{"text": "b"}'), 'bad.jsonl line 2: the object has no "prompt"'),
    (('{"prompt": 3}',), 'bad.jsonl line 1: expected a JSON string or an object with a "prompt" string, got int'),
    (("[1, 2]",), "bad.jsonl line 1: expected a JSON string"),
    (('"a"', "", '{"prompt": ""}'), "bad.jsonl line 3: the prompt is empty"),
    (('"a"', '"  \\n "'), "bad.jsonl line 2: the prompt is empty"),
    (('"\\udcff"',), "bad.jsonl line 1: the prompt is not valid text"),
    (("", "  "), "holds no prompts"),
], ids=["invalid-json", "no-prompt-key", "number", "array", "empty", "blank", "surrogate", "no-prompts"])
def test_bad_jsonl_fails_before_loading(run_cli, no_model, tmp_path, lines, phrase):
    f = jsonl_file(tmp_path, *lines)
    assert_error(run_cli("generate", "--prompt-file", str(f), "--n", "2", "--temperature", "1"), phrase)


def test_empty_per_line_file_fails_before_loading(run_cli, no_model, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("\n  \n\n", encoding="utf-8")
    assert_error(run_cli("generate", "--prompt-file", str(f), "--per-line"), "holds no prompts")


def test_an_over_long_prompt_among_many_is_named_before_any_row_decodes(run_cli, tiny_model, tiny_context, tmp_path,
                                                                       monkeypatch):
    """The context is known once the model is: every prompt is encoded and checked before the batch."""
    import specstack.engine.batched

    def fail(*_a, **_k):
        raise AssertionError("a batch started although a prompt is over the context")

    monkeypatch.setattr(specstack.engine.batched, "BatchEngine", fail)
    f = tmp_path / "p.txt"
    f.write_text("hello\n" + "word " * (2 * tiny_context) + "\nbye\n", encoding="utf-8")
    r = run_cli("generate", "--model", tiny_model, "--prompt-file", str(f), "--per-line", *FP32)
    assert_error(r, "p.txt line 2: the prompt has ")
    assert f"over the model's context limit of {tiny_context}" in r.err


def test_stop_strings_end_each_row_as_alone(run_cli, tiny_model, tmp_path, batched_only):
    """A stop string ends the rows that produce it, each at the same point as its one-row run; the
    other rows go on to their length."""
    full = single(run_cli, tiny_model, PROMPTS[2])
    stop = full[1:3]  # two characters from inside one row's output: that row stops early
    if not stop.strip():
        pytest.skip("the tiny model's output has no usable stop string here")
    refs = [single(run_cli, tiny_model, p, "--stop", stop) for p in PROMPTS]
    assert refs[2] != full  # the premise: the stop string ends that row early when alone
    batched_only()
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n", encoding="utf-8")
    r = run_cli("generate", "--model", tiny_model, "--prompt-file", str(f), *FP32, "--stop", stop, "--jsonl")
    assert r.code == 0, r.err
    rows = jsonl_rows(r.out)
    assert [as_printed(x["text"]) for x in rows] == refs
    assert rows[2]["finish_reason"] == "stop"
