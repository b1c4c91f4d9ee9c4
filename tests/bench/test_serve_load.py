"""`specstack bench-serve` without a model: the pure parts of the load generator and its report
(percentiles, a level's summary, the consistency check, the seeded disconnect choice and arrivals,
request bodies and SSE parsing, the table / JSON / plot), the command's argument errors (exit 2, one
line, nothing sent), and whole runs against a fake OpenAI-compatible server in a thread that streams
one word per chunk."""
from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from specstack.bench import serve_load as sl
from specstack.bench import serve_report, serve_settings, serve_stats, serve_wire
from specstack.bench.datasets import Prompt
from specstack.cli.entry import main

# ---------------------------------------------------------------------------------------------------
# A fake server: /v1/models, /metrics, streamed /v1/completions and /v1/chat/completions
# ---------------------------------------------------------------------------------------------------
FAKE_MODEL = "fake-model"


def fake_words(prompt: str, n: int) -> list[str]:
    """The fake model's greedy output: n words that depend on the prompt only."""
    return [f"{prompt[:3]}{i} " for i in range(n)]


class FakeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes: no chunked encoding to write

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, status: int, obj: object) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (the name BaseHTTPRequestHandler calls)
        self.server.seen.append(("GET", self.path, None))
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": FAKE_MODEL, "object": "model"}]})
        elif self.path == "/metrics":
            data = b"# HELP process_resident_memory_bytes x\nprocess_resident_memory_bytes 1.5e+08\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._json(404, {"error": {"message": "no such route"}})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(("POST", self.path, body))
        if body.get("model") != FAKE_MODEL:
            return self._json(404, {"error": {"message": f"model {body.get('model')!r} not found"}})
        chat = self.path == "/v1/chat/completions"
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            if chat:  # a role-only first delta, as OpenAI sends: not content
                self._event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for w in fake_words(prompt, body["max_tokens"]):
                time.sleep(0.001)
                self._event({"choices": [{"index": 0, "delta": {"content": w}} if chat else {"index": 0, "text": w}]})
            self._event({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # a client that disconnects

    def _event(self, obj: object) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()


@pytest.fixture
def fake_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHandler)
    server.daemon_threads = True
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def url_of(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/v1"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": f"p{i}x def f{i}():"}) + "\n" for i in range(3)))
    return path


# ---------------------------------------------------------------------------------------------------
# Pure parts
# ---------------------------------------------------------------------------------------------------
def test_percentile_interpolates_between_ranks():
    assert serve_stats.percentile([], 50) is None
    assert serve_stats.percentile([7.0], 99) == 7.0
    assert serve_stats.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert serve_stats.percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert serve_stats.percentile(list(range(101)), 99) == pytest.approx(99.0)


def row(prompt: int, status: str = "ok", text: str = "a", tokens: int = 4, chunks: int = 4, ttft: float = 0.1,
        e2e: float = 0.4, sent: float = 0.0) -> serve_settings.RequestRow:
    r = serve_settings.RequestRow("c2", 0, prompt, "completions", status=status, sent_s=sent, ttft_s=ttft, e2e_s=e2e,
                      chunks=chunks, output_tokens=tokens if status == "ok" else 0, text=text)
    r.itl_s = [0.1] * (chunks - 1)
    return r


def test_level_summary_counts_ok_requests_only():
    rows = [row(0, tokens=8, chunks=4), row(1, tokens=4, chunks=4, ttft=0.3, e2e=0.6),
            row(0, status="cancelled", chunks=2), row(1, status="error", chunks=0)]
    rows[3].http_status, rows[3].error = 503, "queue full"
    s = serve_stats.summarize_level(serve_settings.Level("concurrency", 2), rows, wall_s=2.0)
    assert (s["requests"], s["ok"], s["errors"], s["cancelled"]) == (4, 2, 1, 1)
    assert s["output_tokens"] == 12 and s["tokens_per_s"] == 6.0 and s["requests_per_s"] == 1.0
    assert s["ttft_ms_p50"] == pytest.approx(200.0) and s["e2e_ms_p50"] == pytest.approx(500.0)
    assert s["itl_ms_p50"] == pytest.approx(100.0) and s["itl_ms_p99"] == pytest.approx(100.0)
    assert s["tokens_per_chunk"] == 1.5  # 12 tokens in 8 chunks: a speculative server sends several per chunk
    # TPOT: (e2e - ttft) / (tokens - 1)
    assert s["tpot_ms_p50"] == pytest.approx(1e3 * (0.3 / 7 + 0.3 / 3) / 2)
    assert s["error_messages"] == {"503 queue full": 1}


def test_empty_level_has_no_rates():
    s = serve_stats.summarize_level(serve_settings.Level("rate", 0.5), [], 0.0)
    assert s["level"] == "r0.5" and s["tokens_per_s"] is None and s["ttft_ms_p50"] is None


def test_consistency_lists_prompts_whose_texts_differ():
    rows = [row(0, text="x"), row(0, text="x"), row(1, text="y"), row(1, text="z"), row(2, text="w"),
            row(2, status="cancelled", text="partial"), row(3, status="error", text="")]
    assert serve_stats.consistency(rows) == {"prompts_checked": 3, "mismatched": 1, "mismatched_prompts": [1]}


@pytest.mark.parametrize("n", [1, 7, 16, 100])
@pytest.mark.parametrize("share", [0.0, 0.1, 0.25, 0.5, 1.0])
def test_disconnect_choice_has_the_share_and_follows_the_seed(n, share):
    chosen = serve_settings.disconnect_set(n, share, seed=3, salt="c4")
    assert len(chosen) == round(share * n) and chosen <= set(range(n))
    assert chosen == serve_settings.disconnect_set(n, share, seed=3, salt="c4")


def test_disconnect_choice_changes_with_the_seed():
    picks = {serve_settings.disconnect_set(100, 0.2, seed, "c1") for seed in range(5)}
    assert len(picks) == 5


def test_arrivals_are_poisson_and_seeded():
    times = serve_settings.arrival_times(4000, rate=8.0, seed=1)
    assert times == serve_settings.arrival_times(4000, rate=8.0, seed=1) and times != serve_settings.arrival_times(4000, 8.0, seed=2)
    assert times[0] == 0 and all(b >= a for a, b in zip(times, times[1:], strict=False))
    assert times[-1] / (len(times) - 1) == pytest.approx(1 / 8.0, rel=0.06)  # mean gap 1/rate


def test_requests_per_level():
    assert serve_settings.requests_for(serve_settings.Level("concurrency", 2), 12, None) == 12
    assert serve_settings.requests_for(serve_settings.Level("concurrency", 16), 12, None) == 64
    assert serve_settings.requests_for(serve_settings.Level("rate", 2.5), 3, None) == 10
    assert serve_settings.requests_for(serve_settings.Level("concurrency", 16), 12, 5) == 5


def test_request_bodies():
    s = serve_settings.LoadSettings(max_tokens=32, ignore_eos=True, extra_body={"speculation": {"method": "ar"}, "top_k": 1})
    raw, chat = Prompt("a", "def f():"), Prompt("b", "hello", chat=True)
    assert serve_wire.endpoint_of(raw, None) == "completions" and serve_wire.endpoint_of(chat, None) == "chat"
    assert serve_wire.endpoint_of(raw, "chat") == "chat"
    body = serve_wire.request_body(raw, "completions", "m", s)
    assert body == {"model": "m", "prompt": "def f():", "max_tokens": 32, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True,
                    "speculation": {"method": "ar"}, "top_k": 1}
    body = serve_wire.request_body(chat, "chat", "m", serve_settings.LoadSettings(), max_tokens=8)
    assert body["messages"] == [{"role": "user", "content": "hello"}] and body["max_tokens"] == 8
    assert "ignore_eos" not in body and "prompt" not in body


def test_sse_and_chunk_parsing():
    assert serve_wire.sse_data("data: {\"a\": 1}") == '{"a": 1}' and serve_wire.sse_data("data:[DONE]") == "[DONE]"
    assert serve_wire.sse_data(": keep-alive") is None and serve_wire.sse_data("") is None and serve_wire.sse_data("event: x") is None
    assert serve_wire.chunk_text({"choices": [{"text": "ab"}]}) == "ab"
    assert serve_wire.chunk_text({"choices": [{"delta": {"content": "cd"}}]}) == "cd"
    assert serve_wire.chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert serve_wire.chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_error_messages_and_rss():
    assert serve_wire.error_message(b'{"error": {"message": "bad  model"}}') == "bad model"
    assert serve_wire.error_message('{"detail": "Not Found"}') == "Not Found"
    assert serve_wire.error_message("x" * 500).endswith("...")
    text = '# TYPE x gauge\nprocess_resident_memory_bytes 1.234e+08\nprocess_virtual_memory_bytes 9e9\n'
    assert serve_wire.parse_rss(text) == 123400000
    assert serve_wire.parse_rss("llamacpp:requests_processing 0\n") is None


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------
def hand_result() -> serve_stats.RunResult:
    s = serve_settings.LoadSettings(max_tokens=4, ignore_eos=True)
    levels = [serve_stats.LevelResult(serve_settings.Level("concurrency", c), [row(0), row(1, text="b")], 1.0 * c, 2 << 20) for c in (1, 4)]
    return serve_stats.RunResult(serve_settings.Target("http://h:1/v1", "m"), s, levels, rss_before=1 << 20, check={"endpoint": "completions"})


def test_report_table_and_json_shape(tmp_path: Path):
    doc = serve_report.run_document(hand_result(), "specstack bench-serve --url http://h:1/v1", "ours", "humaneval")
    assert [lv["level"] for lv in doc["levels"]] == ["c1", "c4"]
    assert set(doc) >= {"command", "label", "machine", "settings", "levels", "consistency", "rows", "server_rss_bytes"}
    assert doc["settings"]["ignore_eos"] is True and doc["settings"]["model"] == "m"
    assert doc["levels"][0]["consistency"]["mismatched"] == 0 and doc["levels"][0]["server_rss_bytes_after"] == 2 << 20
    assert doc["server_rss_bytes"] == {"before": 1 << 20, "after": 2 << 20}
    assert len(doc["rows"]) == 4 and doc["rows"][0]["itl_s"] == [0.1, 0.1, 0.1]
    json.dumps(doc)  # all plain data
    table = serve_report.level_table(doc["levels"]).splitlines()
    assert len(table) == 2 + 2 and len({line.count("|") for line in table}) == 1
    assert table[2].startswith("| c1 | 2 | 0 | 0 |")
    peers = serve_report.level_table(doc["levels"], label="ours").splitlines()
    assert peers[2].startswith("| ours | c1 |") and len({line.count("|") for line in peers}) == 1

    written = serve_report.write_run(tmp_path / "out", doc)
    assert [p.name for p in written] == ["serve.json", "serve.md", "serve.png"]
    assert json.loads((tmp_path / "out" / "serve.json").read_text())["label"] == "ours"
    assert (tmp_path / "out" / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| c4 |" in (tmp_path / "out" / "serve.md").read_text()


def test_sampling_skips_the_consistency_check():
    result = hand_result()
    result.settings = serve_settings.LoadSettings(temperature=0.7)
    doc = serve_report.run_document(result, "cmd", "ours", "humaneval")
    assert doc["consistency"] is None and doc["levels"][0]["consistency"] is None


# ---------------------------------------------------------------------------------------------------
# The command: errors before anything is sent, runs against the fake server
# ---------------------------------------------------------------------------------------------------
def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["bench-serve", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, phrase", [
    (("--concurrency", "0"), "--concurrency must be >= 1, got 0"),
    (("--concurrency", "1,,2"), "--concurrency must be comma-separated integers"),
    (("--concurrency", "2", "--rate", "1"), "not allowed with argument"),
    (("--rate", "0"), "--rate must be in (0, 10000], got 0"),
    (("--rate", "fast"), "--rate must be a number"),
    (("--max-tokens", "0"), "--max-tokens must be >= 1, got 0"),
    (("--temperature", "-1"), "--temperature must be >= 0"),
    (("--disconnect", "1.5"), "--disconnect must be in [0, 1], got 1.5"),
    (("--timeout", "0"), "--timeout must be > 0"),
    (("--limit", "0"), "--limit must be >= 1, got 0"),
    (("--requests", "x"), "--requests must be an integer"),
    (("--seed", "-1"), "--seed must be >= 0"),
    (("--extra-body", "{bad"), "--extra-body is not valid JSON"),
    (("--extra-body", "[1]"), "--extra-body must be a JSON object"),
    (("--prompts", "nosuchset"), "unknown prompt set 'nosuchset'"),
    (("--prompts", "missing.jsonl"), "prompt file not found: missing.jsonl"),
    (("--endpoint", "embeddings"), "invalid choice: 'embeddings'"),
])
def test_argument_errors_send_nothing(capsys, fake_server, tmp_path, argv, phrase):
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "--url", url_of(fake_server), "--out", str(out), *argv)
    assert code == 2 and stdout == "", err
    assert err.startswith("specstack: error: ") and err.count("\n") == 1 and phrase in err, err
    assert fake_server.seen == [] and not out.exists()


@pytest.mark.parametrize("url, phrase", [
    ("127.0.0.1:8000/v1", "--url must be http://HOST[:PORT]/v1"),
    ("ftp://127.0.0.1/v1", "--url must be http://HOST[:PORT]/v1"),
    ("http://127.0.0.1:99999/v1", "--url 'http://127.0.0.1:99999/v1': Port out of range"),
    ("http://127.0.0.1:8000/v1?x=1", "without a query"),
])
def test_bad_urls(capsys, tmp_path, url, phrase):
    code, stdout, err = run_cli(capsys, "--url", url, "--out", str(tmp_path / "o"))
    assert code == 2 and stdout == "" and err.count("\n") == 1 and phrase in err, err


def test_out_must_be_writable_before_anything_is_sent(capsys, fake_server, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run_cli(capsys, "--url", url_of(fake_server), "--out", str(blocker))
    assert code == 2 and "is a file, not a folder" in err and fake_server.seen == []


def test_refused_connection_is_a_clear_error(capsys, tmp_path, prompts_file):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    code, stdout, err = run_cli(capsys, "--url", url, "--prompts", str(prompts_file), "--out", str(tmp_path / "o"))
    assert code == 2 and stdout == "" and err.count("\n") == 1, err
    assert err.startswith(f"specstack: error: cannot reach {url}/models") and "is the server running" in err, err
    assert not (tmp_path / "o").exists()


def test_a_refused_check_request_is_one_error(capsys, fake_server, tmp_path, prompts_file):
    code, _, err = run_cli(capsys, "--url", url_of(fake_server), "--model", "other", "--prompts", str(prompts_file),
                           "--out", str(tmp_path / "o"))
    assert code == 2 and err.count("\n") == 1, err
    assert "the check request to" in err and "404: model 'other' not found" in err, err
    assert [m for m, *_ in fake_server.seen] == ["GET", "GET", "POST"]  # models, metrics, the check request


def test_a_run_against_the_fake_server(capsys, monkeypatch, fake_server, tmp_path, prompts_file):
    out = tmp_path / "run"
    argv = ("--url", url_of(fake_server) + "/", "--prompts", str(prompts_file), "--concurrency", "1,2", "--requests", "8",
            "--max-tokens", "5", "--ignore-eos", "--disconnect", "0.25", "--extra-body",
            '{"speculation": {"method": "ar"}}', "--api-key", "sekrit", "--out", str(out))
    monkeypatch.setattr(sys, "argv", ["specstack", "bench-serve", *argv])  # what serve.json records
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert [line.split(":")[0] for line in err.splitlines()[:2]] == ["concurrency 1", "concurrency 2"]
    assert stdout.splitlines()[2].startswith("| c1 | 6 | 0 | 2 |") and stdout.count("\n") == 4
    doc = json.loads((out / "serve.json").read_text())
    assert "sekrit" not in (out / "serve.json").read_text() and "--api-key '***'" in doc["command"]
    assert doc["settings"]["model"] == FAKE_MODEL and doc["label"] == FAKE_MODEL
    for lv in doc["levels"]:
        assert (lv["ok"], lv["errors"], lv["cancelled"], lv["output_tokens"]) == (6, 0, 2, 30)
        assert lv["tokens_per_chunk"] == 1.0 and lv["consistency"]["mismatched"] == 0
        assert lv["server_rss_bytes_after"] == 150_000_000
    rows = doc["rows"]
    assert [r["prompt"] for r in rows[:8]] == [0, 1, 2, 0, 1, 2, 0, 1]  # in order, cycling
    for r in rows:
        if r["status"] == "ok":
            assert len(r["itl_s"]) == 4 and r["ttft_s"] > 0 and r["text"].startswith(f"p{r['prompt']}x0 ")
        else:
            assert r["status"] == "cancelled" and r["chunks"] == sl.CANCEL_AFTER and r["output_tokens"] == 0
    posts = [body for method, _, body in fake_server.seen if method == "POST"]
    assert len(posts) == 1 + 16 and posts[0]["max_tokens"] == min(sl.CHECK_TOKENS, 5)
    assert all(b["stream"] and b["ignore_eos"] and b["speculation"] == {"method": "ar"} for b in posts)
    assert {p.name for p in out.iterdir()} == {"serve.json", "serve.md", "serve.png"}


def test_a_rate_run_with_chat_prompts(capsys, fake_server, tmp_path):
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(json.dumps({"task_id": "c", "prompt": "hello there", "chat": True}) + "\n")
    out = tmp_path / "rate"
    code, stdout, err = run_cli(capsys, "--url", url_of(fake_server), "--prompts", str(prompts), "--rate", "50",
                                "--requests", "6", "--max-tokens", "3", "--out", str(out))
    assert code == 0, err
    doc = json.loads((out / "serve.json").read_text())
    (lv,) = doc["levels"]
    assert (lv["level"], lv["ok"], lv["output_tokens"]) == ("r50", 6, 18)
    assert all(r["endpoint"] == "chat" and r["text"] == "hel0 hel1 hel2 " for r in doc["rows"])
    assert {path for _, path, _ in fake_server.seen if path.startswith("/v1/c")} == {"/v1/chat/completions"}
