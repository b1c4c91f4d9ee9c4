"""The memory soak of `specstack bench-serve --workload soak` (issue 54) without a server: the plan it
sends (seeded, the shares it is given, every bad body in turn, long windows on a grid of the sources),
the verdict's slope and its flat / grows call, and the report (its argument errors are with the other
workloads' in test_serve_workloads.py).
tests/server/test_bench_serve_workloads.py runs it against a real server."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from specstack.bench import serve_soak, serve_soak_report
from specstack.bench.serve_settings import LoadSettings, Target
from specstack.bench.serve_soak import BAD_BODIES, Sample, SoakResult, SoakRow, SoakSettings
from specstack.errors import SpecstackError

SHORTS = [f"def f{i}(x):\n    " for i in range(5)]
LONGS = ["# long one\n" * 40, "# long two\n" * 40]


def test_the_plan_follows_its_shares_and_seed():
    s = SoakSettings(requests=4000, long_share=0.25, cancel_share=0.1, bad_share=0.05, whole_share=0.3, seed=3)
    plan = serve_soak.soak_plan(s, SHORTS, LONGS)
    assert [r.index for r in plan] == list(range(4000)) and plan == serve_soak.soak_plan(s, SHORTS, LONGS)
    assert plan != serve_soak.soak_plan(SoakSettings(requests=4000, seed=4), SHORTS, LONGS)
    modes = Counter(r.mode for r in plan)
    for mode, share in (("bad", 0.05), ("cancel", 0.1), ("whole", 0.3), ("stream", 0.55)):
        assert abs(modes[mode] / 4000 - share) < 0.03, (mode, modes)
    assert abs(sum(r.kind == "long" for r in plan) / 4000 - 0.25) < 0.03
    assert all((r.text in LONGS) == (r.kind == "long") for r in plan)
    assert [r.text for r in plan if r.kind == "short"][:7] == [*SHORTS, *SHORTS[:2]]  # in order, cycling
    assert {r.bad for r in plan if r.mode == "bad"} == set(BAD_BODIES) and all(
        (r.bad is None) == (r.mode != "bad") for r in plan)


def test_every_bad_body_is_one_a_server_must_refuse():
    bodies = {name: make("m", "text") for name, make in BAD_BODIES.items()}
    with pytest.raises(ValueError):
        json.loads(bodies.pop("not-json"))
    assert bodies == {"negative-max-tokens": {"model": "m", "prompt": "text", "max_tokens": -1},
                      "unknown-model": {"model": "m-no-such-model", "prompt": "text", "max_tokens": 4},
                      "no-prompt": {"model": "m", "max_tokens": 4},
                      "bad-temperature": {"model": "m", "prompt": "text", "temperature": "hot"}}


def test_long_windows_start_on_line_starts_of_the_grid():
    text = "".join(f"line {i:05d}\n" for i in range(3000))  # 11 characters a line
    windows = serve_soak.long_windows([("src", text)], 500)
    assert len(windows) == (len(text) - 500) // serve_soak.OFFSET_GRID + 1
    for name, w in windows:
        start = int(name.split("@")[1])
        assert len(w) == 500 and w == text[start : start + 500] and (start == 0 or text[start - 1] == "\n")
    with pytest.raises(SpecstackError, match="lower --long-chars"):
        serve_soak.long_windows([("src", "short")], 500)


def test_the_slope_is_least_squares_bytes_per_request():
    assert serve_soak_report.slope([(0, 100), (10, 100 + 10 * 4096), (20, 100 + 20 * 4096)]) == pytest.approx(4096)
    assert serve_soak_report.slope([(0, 5), (1, 6)]) is None  # under three points
    noisy = [(x, 1000 + 2 * x + (50 if x % 2 else -50)) for x in range(0, 2000, 100)]
    assert serve_soak_report.slope(noisy) == pytest.approx(2, abs=0.2)


def _samples(per_request: int, requests: int = 6000, every: int = 500) -> list[Sample]:
    # a first fill (the cache, the allocator) of 300 MB over the first 1,000 requests, then per_request bytes each
    return [Sample(n, n / 10, 2**31 + min(n, 1000) * 300 * 1024 + per_request * n, 64 << 20, 64 << 20, 64 << 20)
            for n in range(0, requests + 1, every)]


@pytest.mark.parametrize("per_request, flat", [(0, True), (4 * 1024, True), (16 * 1024, False)])
def test_the_verdict_calls_growth_past_the_settled_point(per_request, flat):
    rows = [SoakRow(i, "short", "stream", "ok", 200, prompt_tokens=10, cached_tokens=4) for i in range(6000)]
    v = serve_soak_report.verdict(_samples(per_request), rows, 6000)
    assert v["settle_requests"] == 2000 and v["flat"] is flat
    assert v["growth_after_settle_bytes_per_request"] == pytest.approx(per_request, abs=1)
    assert v["growth_last_half_bytes_per_request"] == pytest.approx(per_request, abs=1)
    assert v["cache_within_budget"] is True and (v["prompt_tokens"], v["cached_tokens"]) == (60000, 24000)


def test_the_report_files_and_the_verdict_line(tmp_path: Path):
    rows = [SoakRow(0, "short", "stream", "ok", 200), SoakRow(1, "long", "bad", "refused", 422),
            SoakRow(2, "short", "whole", "error", 500, "boom"), SoakRow(3, "short", "cancel", "cancelled", 200)]
    result = SoakResult(Target("http://127.0.0.1:1/v1", "m"), LoadSettings(max_tokens=16), SoakSettings(requests=4),
                        rows, [Sample(n, n, 1 << 30, None, None, None) for n in range(5)], 2.0)
    doc = serve_soak_report.soak_document(result, "specstack bench-serve --workload soak", "ours")
    json.dumps(doc)
    v = doc["verdict"]
    assert v["outcomes"] == {"ok": 1, "refused": 1, "error": 1, "cancelled": 1} and v["cache_budget"] is None
    assert v["errors"] == [{"index": 2, "mode": "whole", "http_status": 500, "error": "boom"}]
    written = serve_soak_report.write_soak(tmp_path / "o", doc)
    assert [p.name for p in written][:2] == ["soak.json", "soak.md"]
    md = (tmp_path / "o" / "soak.md").read_text()
    assert "Verdict: memory flat" in md and "#2 whole: HTTP 500: boom" in md and "| no cache |" in md
    assert "Partial" not in md
    so_far = serve_soak.partial(result.target, result.settings, result.soak, rows[:2], result.samples[:3], 1.0)
    written = serve_soak_report.write_soak(tmp_path / "p", serve_soak_report.soak_document(so_far, "c", "ours"),
                                           figure=False)
    assert [p.name for p in written] == ["soak.json", "soak.md"]
    assert "**Partial**: the run so far (2 of 4 requests ended)" in (tmp_path / "p" / "soak.md").read_text()
