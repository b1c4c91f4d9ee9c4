"""Numbers and sizes (issue 18, kinds 1, 2, 5 and 8): every size has an upper bound, checked before
any model is loaded; sizes the model bounds (its context, its blocks) are checked as soon as it is,
before any long work; numbers that pass validation no longer crash later; flags that do nothing say so.

Each error is exit 2 and one line `specstack: error: ...` naming the flag, without a traceback; a
warning is one line `specstack: warning: ...` and the run goes on."""
from __future__ import annotations

import pytest
from cli.test_cli_errors import CliResult, assert_error

import specstack
import specstack.bench.forward
import specstack.engine.methods
import specstack.models.loading
import specstack.training.data
import specstack.validate
from specstack.validate import MAX_CONTEXT, MAX_COUNT, MAX_REPEATS, MAX_THREADS, MAX_TREE, SEED_MAX

GEN = ("generate", "--prompt", "hi")
LIMIT = f"the target verifies at most {MAX_TREE} draft tokens per step"


def fail(*_a, **_k):
    raise AssertionError("reached although the arguments are invalid")




# ---------------------------------------------------------------------------------------------------
# Kind 1: every size is bounded before the model loads (the bound and its reason in the message)
# ---------------------------------------------------------------------------------------------------
METHOD_CASES = {
    "chain k": ("chain:k=10000", f"method 'chain': k must be <= {MAX_TREE}, got 10000 ({LIMIT})"),
    "tree budget": ("tree:budget=100000", f"method 'tree': budget must be <= {MAX_TREE}, got 100000 ({LIMIT})"),
    "tree depth": ("tree:depth=65", f"depth must be <= {MAX_TREE}, got 65"),
    "tree width": ("tree:width=1000", f"width must be <= {MAX_TREE}, got 1000"),
    "tree expand": ("tree:expand=99", f"expand must be <= {MAX_TREE}, got 99"),
    "ngram max": ("ngram:max=10000,cost=1", f"method 'ngram': max must be <= {MAX_TREE}, got 10000"),
    "ngram depth": ("ngram:depth=500", f"depth must be <= {MAX_TREE}, got 500"),
    "ngram width": ("ngram:width=65", f"width must be <= {MAX_TREE}, got 65"),
    "ngram match": ("ngram:match=1000", "method 'ngram': match must be <= 16, got 1000"),
    "staged budget": ("staged:budget=65", f"method 'staged': budget must be <= {MAX_TREE}, got 65"),
    "staged d2": ("staged:d2=1000", f"d2 must be <= {MAX_TREE}, got 1000"),
    "a thousand digits": ("chain:k=" + "9" * 5000, "method 'chain': k is far too large (5000 digits)"),
}


@pytest.mark.parametrize("method, phrase", METHOD_CASES.values(), ids=METHOD_CASES.keys())
def test_method_sizes_are_bounded_before_loading(run_cli, no_model, method, phrase):
    assert_error(run_cli(*GEN, "--method", method), phrase)


def test_bench_method_sizes_are_bounded_too(run_cli, no_model, tmp_path):
    r = run_cli("bench", "--prompts", "humaneval", "--methods", "ar;chain:k=10000", "--out", str(tmp_path / "o"))
    assert_error(r, f"method 'chain': k must be <= {MAX_TREE}, got 10000")
    assert not (tmp_path / "o").exists()


FLAG_CASES = {
    "max-new-tokens": ((*GEN, "--max-new-tokens", str(MAX_CONTEXT + 1)),
                       f"--max-new-tokens must be <= {MAX_CONTEXT}, got {MAX_CONTEXT + 1}"),
    "threads 0": ((*GEN, "--threads", "0"), "--threads must be >= 1, got 0"),
    "threads huge": ((*GEN, "--threads", "100000"), f"--threads must be <= {MAX_THREADS}, got 100000"),
    "top-k": ((*GEN, "--top-k", "99999999999"), "--top-k must be <= 2147483647"),
    "bench limit 0": (("bench", "--limit", "0"), "--limit must be >= 1, got 0"),
    "bench limit": (("bench", "--limit", str(MAX_COUNT + 1)), f"--limit must be <= {MAX_COUNT}"),
    "bench repeats": (("bench", "--repeats", "1000000"), f"--repeats must be <= {MAX_REPEATS}, got 1000000"),
    "bench threads": (("bench", "--threads", "-2"), "--threads must be >= 1, got -2"),
    "bench-forward context 0": (("bench-forward", "--context", "0"), "--context must be >= 1, got 0"),
    "bench-forward context": (("bench-forward", "--context", "10" * 5), f"--context must be <= {MAX_CONTEXT}"),
    "bench-forward tokens": (("bench-forward", "--tokens", f"1,{MAX_CONTEXT + 1}"),
                             f"argument --tokens: expected positive integers up to {MAX_CONTEXT}"),
    "bench-forward repeats": (("bench-forward", "--repeats", "100000"), f"--repeats must be <= {MAX_REPEATS}"),
    "bench-forward warmup": (("bench-forward", "--warmup", "-1"), "--warmup must be >= 0, got -1"),
    "bench-forward prompts": (("bench-forward", "--prompts", "-1"), "--prompts must be >= 0, got -1"),
    "bench-forward new-tokens": (("bench-forward", "--new-tokens", "0"), "--new-tokens must be >= 1, got 0"),
    "bench-forward threads": (("bench-forward", "--threads", "0"), "--threads must be >= 1, got 0"),
    "train steps": (("train-draft", "--steps", str(MAX_COUNT + 1)), f"--steps must be <= {MAX_COUNT}"),
    "train sequences": (("train-draft", "--train-sequences", "0"), "--train-sequences must be >= 1, got 0"),
    "train seq-len": (("train-draft", "--seq-len", str(MAX_CONTEXT + 1)), f"--seq-len must be <= {MAX_CONTEXT}"),
    "train draft-steps": (("train-draft", "--draft-steps", "65"), f"--draft-steps must be <= {MAX_TREE}, got 65"),
    "train window": (("train-draft", "--window", "-1"), "--window must be >= 0, got -1"),
    "train vocab": (("train-draft", "--vocab", "-1"), "--vocab must be >= 0, got -1"),
    "train batch over sequences": (("train-draft", "--batch-size", "64", "--train-sequences", "8"),
                                   "--batch-size must be <= 8, got 64 (a batch is drawn from --train-sequences)"),
    "train threads": (("train-draft", "--threads", "0"), "--threads must be >= 1, got 0"),
    "calibrate warmup": (("throughput-calibrate", "--warmup", "10000"), f"--warmup must be <= {MAX_REPEATS}, got 10000"),
    "calibrate repeats": (("throughput-calibrate", "--repeats", "2147483648"), f"--repeats must be <= {MAX_REPEATS}"),
    "calibrate threads": (("throughput-calibrate", "--threads", "100000"), f"--threads must be <= {MAX_THREADS}"),
    "check context": (("throughput-check", "d", "--context", "99999999999"), f"--context must be <= {MAX_CONTEXT}"),
    "bench-ties threads": (("bench-ties", "d", "--threads", "10000"), f"--threads must be <= {MAX_THREADS}"),
    "ngram k": (("ngram", "train", "--k", "2147483648"), "--k must be <= 100, got 2147483648"),
    "magicdec window": (("draft-acceptance", "magicdec:1180591620717411303424", "--sequences", "s"),
                        f"magicdec:1180591620717411303424: the window must be <= {MAX_CONTEXT}"),
}


@pytest.mark.parametrize("argv, phrase", FLAG_CASES.values(), ids=FLAG_CASES.keys())
def test_sizes_are_bounded_before_loading(run_cli, no_model, tmp_path, argv, phrase):
    out = tmp_path / "o"
    if argv[0] in ("train-draft", "bench", "bench-forward"):
        argv = (*argv, "--out", str(out))
    assert_error(run_cli(*argv), phrase)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------
# Kind 2: widths and contexts against the model's context, once it is known, before any long work
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram:max=63,cost=1", "tree:budget=63,cost=1", "staged:budget=63,cost=1"])
def test_a_cost_curve_wider_than_the_context_fails_before_measuring(run_cli, tiny_model, tiny_context, monkeypatch,
                                                                    method):
    """cost=1 measures forwards of widths up to budget + 1 (max + 1): 64 of them after one token does
    not fit the tiny model's 64 positions. Nothing is measured and no draft or trigram is loaded."""
    for name in ("width_costs", "resolve_draft", "load_ngram"):
        monkeypatch.setattr(specstack.engine.methods, name, fail)
    r = run_cli("generate", "--model", tiny_model, "--prompt", "hi", "--dtype", "fp32", "--method", method)
    assert_error(r, f"cost=1 measures target forwards of up to 64 tokens after one token of context: 65 positions, "
                    f"over the model's context of {tiny_context} tokens")


def test_the_widest_cost_curve_that_fits_is_measured(tiny_model, monkeypatch):
    from specstack.engine.methods import check_fits, parse_method

    check_fits(parse_method("ngram:max=62,cost=1"), 64)  # 63 wide after one token: fits exactly
    check_fits(parse_method("ngram:max=64"), 64)  # no cost curve: nothing measured


def test_bench_forward_context_beyond_the_model_fails_before_timing(run_cli, tiny_model, tiny_context, monkeypatch,
                                                                    tmp_path):
    monkeypatch.setattr(specstack.bench.forward, "time_forwards", fail)
    monkeypatch.setattr(specstack.bench.forward, "forward_steps", fail)
    out = tmp_path / "forward.json"
    r = run_cli("bench-forward", "--model", tiny_model, "--formats", "fp32", "--skip-hf", "--prompts", "0",
                "--context", "60", "--tokens", "1,8", "--threads", "1", "--out", str(out))
    assert_error(r, f"--context 60 + the widest --tokens 8: 68 positions, over the model's context of {tiny_context}")
    assert not out.exists()


@pytest.mark.parametrize("extra, phrase", [
    (("--seq-len", "100"), "--seq-len: 100 positions, over the model's context of 64 tokens"),
    (("--layers", "3"), "--layers is 1 or 2, got 3 (the target's blocks)"),  # the tiny target has 2
    (("--batch-size", "65", "--no-online-teacher"), "--batch-size must be <= 64, got 65 (a cached teacher draws each "
                                                    "batch within one shard"),
], ids=["seq-len", "layers", "batch-over-shard"])
def test_train_draft_sizes_the_target_bounds_fail_before_reading_text(run_cli, tiny_model, monkeypatch, tmp_path,
                                                                      extra, phrase):
    """Checked once the target is loaded, before any text is read (a batch larger than a cached
    teacher's shard was never drawn: training waited for ever)."""
    monkeypatch.setattr(specstack.training.data, "build_sequences", fail)
    short = () if "--seq-len" in extra else ("--seq-len", "32")  # the default 512 is over the tiny context
    r = run_cli("train-draft", "--target", tiny_model, "--out", str(tmp_path / "o"), "--device", "cpu", *short, *extra)
    log, error = r.err.splitlines()  # the run's log opens with its command line, then the one error
    assert log.startswith("# ") and " specstack train-draft " in log
    assert_error(CliResult(r.code, r.out, error + "\n"), phrase)
    assert not (tmp_path / "o" / "teacher").exists()


def test_prepared_sequences_of_another_vocabulary_fail_before_the_teacher(run_cli, tiny_model, monkeypatch, tmp_path):
    """Token ids beyond the target's vocabulary (sequences prepared for another tokenizer) failed with
    an IndexError in the embedding, after the teacher cache was started."""
    import torch

    import specstack.training.teacher
    from specstack.training.data import save_sequences

    monkeypatch.setattr(specstack.training.teacher, "build_cache", fail)
    seqs = tmp_path / "seq.safetensors"
    ids = torch.full((2, 16), 60000, dtype=torch.int32)  # the tiny target has 49152 tokens
    save_sequences(seqs, ids, ids[:1], {"data": "test"})
    r = run_cli("train-draft", "--target", tiny_model, "--out", str(tmp_path / "o"), "--device", "cpu",
                "--sequences", str(seqs), "--seq-len", "16", "--train-sequences", "2", "--heldout-sequences", "1",
                "--batch-size", "1")
    *log, error = r.err.splitlines()
    assert all(line.startswith(("# ", "2 training and 1 held-out")) for line in log), log
    assert_error(CliResult(r.code, r.out, error + "\n"),
                 f"{seqs}: token id 60000 is outside the target's vocabulary of 49152 tokens")


# ---------------------------------------------------------------------------------------------------
# Kind 5: numbers that passed validation and crashed later
# ---------------------------------------------------------------------------------------------------
NUMBER_CASES = {
    "seed beyond 64 bits": ((*GEN, "--seed", "99999999999999999999999"),
                            f"--seed must be <= {SEED_MAX}, got 99999999999999999999999 (seeds are 64-bit)"),
    "negative seed": ((*GEN, "--seed", "-1"), "--seed must be >= 0, got -1"),
    "temperature underflow": ((*GEN, "--temperature", "1e-40"), "--temperature must be 0 (greedy) or >= 1e-30"),
    "top-p inf": ((*GEN, "--top-p", "inf"), "--top-p must be a finite number"),
    "bench seed": (("bench", "--seed", str(2**64)), f"--seed must be <= {SEED_MAX}"),
}


@pytest.mark.parametrize("argv, phrase", NUMBER_CASES.values(), ids=NUMBER_CASES.keys())
def test_numbers_that_used_to_crash_are_rejected(run_cli, no_model, argv, phrase):
    assert_error(run_cli(*argv), phrase)


TRAIN_NUMBERS = {
    "lr nan": (("--lr", "nan"), "--lr must be a finite number, got 'nan'"),
    "lr inf": (("--lr", "inf"), "--lr must be a finite number, got 'inf'"),
    "lr 0": (("--lr", "0"), "--lr must be in (0, 1], got 0"),
    "lr negative": (("--lr=-1e-3",), "--lr must be in (0, 1], got -0.001"),
    "omega nan": (("--omega", "nan"), "--omega must be a finite number"),
    "data nan": (("--data", "code:nan"), "--data: weight of code must be a finite number, got 'nan'"),
    "data inf": (("--data", "code:0.5,sharegpt:inf"), "--data: weight of sharegpt must be a finite number"),
    "data overflow": (("--data", "code:1e308,sharegpt:1e308"), "--data: the weights' sum overflows"),
}


@pytest.mark.parametrize("extra, phrase", TRAIN_NUMBERS.values(), ids=TRAIN_NUMBERS.keys())
def test_train_draft_rejects_non_finite_numbers_before_the_teacher(run_cli, no_model, tmp_path, extra, phrase):
    assert_error(run_cli("train-draft", "--out", str(tmp_path / "o"), *extra), phrase)
    assert not (tmp_path / "o").exists()


def test_a_top_p_below_float32_keeps_the_top_token(run_cli, tiny_model, stats_line):
    """1e-46 rounds to 0 in float32: the nucleus dropped every token (NaN probabilities)."""
    r = run_cli("generate", "--model", tiny_model, "--prompt", "hello", "--dtype", "fp32", "--max-new-tokens", "4",
                "--temperature", "1", "--top-p", "1e-46", "--seed", str(SEED_MAX))
    assert r.code == 0, r.err
    assert stats_line.match(r.err.splitlines()[-1]) and "Traceback" not in r.err


# ---------------------------------------------------------------------------------------------------
# Kind 8: flags that were silent
# ---------------------------------------------------------------------------------------------------
def test_an_empty_stop_string_is_an_error(run_cli, no_model):
    assert_error(run_cli(*GEN, "--stop", "x", "--stop", ""), "--stop: an empty stop string would stop at once")


@pytest.mark.parametrize("method, flags, ignored", [
    ("ar", ("--draft", "d.safetensors", "--draft-dtype", "int8", "--ngram", "t.npz"), ["--draft", "--draft-dtype",
                                                                                      "--ngram"]),
    ("chain:k=2", ("--draft", "self:1", "--draft-dtype", "fp32", "--ngram", "t.npz"), ["--ngram"]),
    ("ngram", ("--draft", "self:1", "--draft-dtype", "fp32", "--ngram", "t.npz"), ["--draft", "--draft-dtype"]),
], ids=["ar", "chain", "ngram"])
def test_sources_a_method_does_not_read_are_warned_of(run_cli, tiny_model, monkeypatch, method, flags, ignored):
    """A warning per ignored flag, before the model loads; the run goes on (here: stopped at the load,
    the point being what was said before it)."""
    import specstack.cli.generate

    def stop(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(specstack.cli.generate, "load", stop)
    r = run_cli("generate", "--model", tiny_model, "--prompt", "hi", "--method", method, *flags)
    name = method.partition(":")[0]
    assert r.code == 130 and "Traceback" not in r.err
    assert r.err.splitlines() == [f"specstack: warning: {f} is ignored: method {name!r} does not use it" for f in ignored]


def test_the_warning_comes_with_a_finished_run(run_cli, tiny_model, stats_line):
    r = run_cli("generate", "--model", tiny_model, "--prompt", "hello", "--dtype", "fp32", "--max-new-tokens", "3",
                "--draft", "self:1")
    assert r.code == 0, r.err
    first, *_, last = r.err.splitlines()
    assert first == "specstack: warning: --draft is ignored: method 'auto' does not use it"
    assert stats_line.match(last)


def test_more_threads_than_cores_is_a_warning(run_cli, tiny_model, monkeypatch, stats_line):
    import torch

    monkeypatch.setattr(specstack.validate, "available_cores", lambda: 1)
    threads = torch.get_num_threads()
    try:
        r = run_cli("generate", "--model", tiny_model, "--prompt", "hello", "--dtype", "fp32", "--max-new-tokens", "2",
                    "--threads", "2")
    finally:
        torch.set_num_threads(threads)
    assert r.code == 0, r.err
    lines = r.err.splitlines()
    assert lines[0] == ("specstack: warning: --threads 2 is more than the 1 CPU cores available: the threads "
                        "contend and the run can be many times slower")
    assert stats_line.match(lines[-1]) and len([x for x in lines if "warning" in x]) == 1
