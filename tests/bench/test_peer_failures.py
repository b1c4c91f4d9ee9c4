"""A peer that fails never takes the bench down (issue 49): a fake `llama-server` (a real process, a tiny
script in a --llama-bin-dir of its own) that exits at start, that is killed by SIGSEGV on its first
request, or that hangs past the request timeout; each time the run finishes, writes its summary with
the engine's rows, says in one line how the peer failed, and leaves no process of it behind."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_children import linux_guard, pids_running

from specstack.bench.llama_server import TIMEOUT_ENV

FAKE = '''#!{python}
import os, signal, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
mode = os.environ["FAKE_LLAMA_MODE"]
if mode == "exit":
    print("fake llama-server: no model here", flush=True)
    sys.exit(3)
port = int(sys.argv[sys.argv.index("--port") + 1])

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{{}}")

    def do_POST(self):
        if mode == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(3600)

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "llama-server"
    script.write_text(FAKE.format(python=sys.executable))
    script.chmod(0o755)
    return folder


@linux_guard
@pytest.mark.parametrize("mode,says", [("exit", "exited with 3 at start: fake llama-server: no model here"),
                                       ("crash", "was killed by SIGSEGV"),
                                       ("hang", "did not answer within 2 s")])
def test_a_failing_peer_is_one_line_and_the_run_finishes(bench, fake_bin, tmp_path, monkeypatch, mode, says):
    monkeypatch.setenv("FAKE_LLAMA_MODE", mode)
    monkeypatch.setenv(TIMEOUT_ENV, "2")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": f"def f{i}(x):"}) + "\n" for i in range(2)))
    out = tmp_path / "run"
    code, stdout, err = bench("--model", "smollm2-135m", "--prompts", str(prompts), "--max-new-tokens", "8",
                              "--threads", "1", "--out", str(out), "--llama-bin-dir", str(fake_bin),
                              "--methods", "ar;llamacpp-ngram")
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == {"ar"} and len(rows) == 2, "the engine's rows, none of the peer's"
    summary = (out / "summary.md").read_text()
    lines = [x for x in summary.splitlines() if x.startswith("- llamacpp-ngram: ") and "failed" in x]
    assert len(lines) == 1 and says in lines[0], summary
    assert "| ar |" in summary
    assert pids_running(str(fake_bin)) == [], "the fake server outlived the run"


# a peer library in a child process (bench/peer_child.py): the bench method, what the crash line adds
CHILD_PEERS = {"llama-cpp-python": ("llamacpp", "rebuild llama-cpp-python"), "openvino-genai": ("openvino", "")}


@linux_guard
@pytest.mark.parametrize("library", list(CHILD_PEERS))
def test_a_peer_library_crashing_in_its_process_is_one_line(bench, tmp_path, monkeypatch, library):
    """`llamacpp` and `openvino` run their library in a process of their own (bench/peer_child.py): that
    process killed by SIGSEGV after its warm-up (as a crashing native build would be) fails the peer, and
    the bench finishes with the engine's rows (and, for llama.cpp, the command that rebuilds it)."""
    import os
    import signal

    from specstack.bench.peer_child import PeerChild
    from specstack.machine import package_version

    if package_version(library) is None:
        pytest.skip(f"{library} is not installed")
    method, hint = CHILD_PEERS[library]
    real = PeerChild.generate
    calls = []

    def crash_on_the_second(self, ids, n, sampling):
        calls.append(self.proc.pid)
        if len(calls) == 2:
            os.kill(self.proc.pid, signal.SIGSEGV)
        return real(self, ids, n, sampling)

    monkeypatch.setattr(PeerChild, "generate", crash_on_the_second)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": f"def f{i}(x):"}) + "\n" for i in range(2)))
    out = tmp_path / "run"
    code, _, err = bench("--model", "smollm2-135m", "--prompts", str(prompts), "--max-new-tokens", "8",
                         "--threads", "1", "--out", str(out), "--methods", f"ar;{method}")
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["method"] for r in rows) == ["ar", "ar"], "the peer lost its rows from the crash on"
    summary = (out / "summary.md").read_text()
    assert any(x.startswith(f"- {method}: failed") and "killed by SIGSEGV" in x and hint in x
               for x in summary.splitlines()), summary
    assert pids_running("specstack.bench.peer_child") == [], "the peer's process outlived the run"
