"""Fill in the middle through a real server: llama.cpp's `/infill` with the body llama.vscode sends (plain
HTTP), OpenAI's `suffix` through the `openai` client, both equal to `specstack generate --suffix` on the same
checkpoint (greedy, fp32), streamed text cut at its tokens with their origins, the editor stops, and clean
400s: in llama.cpp's shape on /infill, OpenAI's on /v1/completions, for a model without FIM tokens too."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from server.servers import Server

PREFIX = "import math\n\n\ndef area(radius):\n    "
SUFFIX = "\n\n\ndef perimeter(radius):\n    return 2 * math.pi * radius\n"
EXTRA = [{"filename": "shapes/base.py", "text": "class Shape:\n    def area(self):\n        raise NotImplementedError\n"}]
NEW = 24
# what llama.vscode sends (its extension's request, fields in its order), n_predict small for a tiny model
VSCODE = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "return ",
          "n_predict": NEW, "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
          "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
          "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_second",
                              "timings/predicted_n", "timings/predicted_ms", "timings/predicted_per_second",
                              "truncated", "tokens_cached"]}


def infill(server: Server, **body: object) -> httpx.Response:
    return httpx.post(server.root + "/infill", json=body, timeout=60)


def greedy(**extra: object) -> dict[str, object]:
    return {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": NEW, "temperature": 0, **extra}


def generate_suffix(model: Path, tmp: Path, *flags: str) -> str:
    """`specstack generate --suffix` on the same checkpoint: the middle it prints."""
    out = subprocess.run([sys.executable, "-m", "specstack.cli", "generate", "--model", str(model), "--dtype", "fp32",
                          "--threads", "1", "--prompt", PREFIX, "--suffix", SUFFIX, "--max-new-tokens", str(NEW),
                          "--temperature", "0", "--jsonl", *flags],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "SPECSTACK_CACHE": str(tmp / "cache")})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["text"]


def test_the_body_llama_vscode_sends_is_answered_in_its_fields(fim_server: Server) -> None:
    r = infill(fim_server, **VSCODE)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == set(VSCODE["response_fields"])  # response_fields: those paths, as keys
    assert isinstance(body["content"], str) and body["truncated"] is False
    assert 1 <= body["timings/predicted_n"] <= NEW and body["timings/prompt_n"] >= 1
    assert body["tokens_cached"] >= body["timings/prompt_n"] + body["timings/predicted_n"] - 1


def test_infill_and_suffix_equal_generate_suffix(fim_server: Server, fim_model: Path, tmp_path: Path) -> None:
    cli = generate_suffix(fim_model, tmp_path)
    whole = infill(fim_server, **greedy()).json()
    assert whole["content"] == cli
    assert whole["stop_type"] in ("eos", "limit") and whole["tokens_predicted"] >= 1
    assert whole["tokens_evaluated"] == whole["timings"]["prompt_n"] + whole["timings"]["cache_n"]
    spec = whole["speculation"]
    assert sum(spec["origins"].values()) == whole["tokens_predicted"] and spec["tau"] >= 1
    client = fim_server.client()
    r = client.completions.create(model=fim_server.model, prompt=PREFIX, suffix=SUFFIX, max_tokens=NEW, temperature=0)
    assert r.choices[0].text == cli
    # autoregressive on the server: the same middle (speculation is lossless on FIM prompts too)
    ar = infill(fim_server, **greedy(speculation={"method": "ar"})).json()
    assert ar["content"] == cli and ar["speculation"]["origins"] == {"target": ar["tokens_predicted"]}


def test_extra_files_equal_generate_with_extra_file(fim_server: Server, fim_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "base.py"
    path.write_text(EXTRA[0]["text"], encoding="utf-8")
    cli = generate_suffix(fim_model, tmp_path, "--extra-file", str(path))
    body = infill(fim_server, **greedy(input_extra=[{"filename": "base.py", "text": EXTRA[0]["text"]}])).json()
    assert body["content"] == cli
    without = infill(fim_server, **greedy()).json()
    assert body["tokens_evaluated"] > without["tokens_evaluated"]  # the file is in the prompt


def test_streamed_infill_with_origins(fim_server: Server) -> None:
    whole = infill(fim_server, **greedy())
    events = []
    with httpx.stream("POST", fim_server.root + "/infill", json=greedy(stream=True, speculation={"origins": True}),
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    *pieces, last = events
    assert all(e["stop"] is False for e in pieces) and last["stop"] is True
    text = "".join(e["content"] for e in pieces)
    assert text == last["content"] == whole.json()["content"]
    spans = [s for e in pieces for s in e["origins"]]
    assert "".join(t for t, _ in spans) == text
    assert {o for _, o in spans} <= {"target", "draft", "draft2", "context"}


def test_completion_stream_carries_origins(fim_server: Server) -> None:
    client = fim_server.client()
    stream = client.completions.create(model=fim_server.model, prompt=PREFIX, suffix=SUFFIX, max_tokens=NEW,
                                       temperature=0, stream=True, extra_body={"speculation": {"origins": True}})
    text, spans = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.text
            spans += (c.model_extra or {}).get("origins") or []
    assert text and "".join(t for t, _ in spans) == text


def test_editor_stops_end_the_middle_at_a_line(fim_server: Server) -> None:
    """n_indent 100: every line after the first is indented less, so the middle ends at its first line
    break with that line's code cut (its text holds at most one line break, as the stop cut it)."""
    body = infill(fim_server, **greedy(n_predict=64, n_indent=100)).json()
    free = infill(fim_server, **greedy(n_predict=64)).json()
    first_break = free["content"].find("\n")
    if first_break >= 0 and free["content"][first_break + 1:].strip():
        assert body["stop_type"] == "limit" and body["content"].count("\n") == 1
        assert free["content"].startswith(body["content"])
    else:  # the model wrote no second line: nothing to cut
        assert body["content"] == free["content"]


@pytest.mark.parametrize("body, message", [
    ({"input_suffix": ""}, '"input_prefix" is required'),
    ({"input_prefix": ""}, '"input_suffix" is required'),
    ({"input_prefix": "", "input_suffix": "", "input_extra": "x"}, '"input_extra" must be an array'),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a"}]}, 'must contain a "text" field'),
    ({"input_prefix": 3, "input_suffix": ""}, '"input_prefix" must be a string'),
    ({"input_prefix": "", "input_suffix": "", "n_predict": "many"}, "n_predict"),
    ({"input_prefix": "", "input_suffix": "", "n_predict": 0}, "n_predict"),
    ({"input_prefix": "", "input_suffix": "", "grammar": "root ::= x"}, '"grammar" is not supported'),
    ({"input_prefix": "", "input_suffix": "", "samplers": ["mirostat"]}, "unknown sampler"),
    ({"input_prefix": "", "input_suffix": "", "stream": "yes"}, '"stream" must be true or false'),
    ([1, 2], "must be a JSON object"),
])
def test_bad_infill_bodies_get_llama_cpp_shaped_400s(fim_server: Server, body: object, message: str) -> None:
    r = httpx.post(fim_server.root + "/infill", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and message in error["message"] and error["type"]
    r = httpx.post(fim_server.root + "/infill", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400


def test_a_model_without_fim_tokens_is_refused(tiny_server: Server) -> None:
    r = infill(tiny_server, **greedy())
    assert r.status_code == 400
    assert "Infill is not supported by this model" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        tiny_server.client().completions.create(model=tiny_server.model, prompt=PREFIX, suffix=SUFFIX, max_tokens=4)
    assert e.value.status_code == 400 and e.value.code == "fim_unsupported"
    assert "fill-in-the-middle" in e.value.message


def test_suffix_with_token_ids_is_refused(fim_server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        fim_server.client().completions.create(model=fim_server.model, prompt=[1, 2, 3], suffix="x", max_tokens=4)
    assert e.value.param == "suffix"


def test_the_page_is_served(tiny_server: Server) -> None:
    r = httpx.get(tiny_server.root + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert 'id="generate"' in r.text and "://" not in r.text  # nothing fetched from outside this server
