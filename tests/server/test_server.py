"""`specstack serve` through the real `openai` client: the same greedy text as `specstack generate`,
streamed or whole, alone or among concurrent requests; n, stop strings, usage; a disconnect frees its
row; a full server answers 503; bad input gets OpenAI's error shape with the right status; /metrics
parses and moves; /health says loading, then ok."""
from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server.servers import TOKENS, Server, chat, complete, start_server, stop_server, wait_ready

from specstack.cli.entry import main
from specstack.server.metrics import MAX_POSITION

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n", "Once upon a time",
           "SELECT * FROM", "class Stack:"]


@pytest.fixture(scope="module")
def alone(server_model_dir: Path, server_tmp: Path) -> dict[tuple[str, bool], str]:
    """Each prompt's greedy text from `specstack generate` (one sequence, run in this process), raw and chat."""
    import contextlib
    import io
    import os

    os.environ.setdefault("SPECSTACK_CACHE", str(server_tmp / "cache"))
    out = {}
    for as_chat in (False, True):
        for prompt in PROMPTS:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
                code = main(["generate", "--model", str(server_model_dir), "--dtype", "fp32", "--prompt", prompt,
                             "--max-new-tokens", str(TOKENS), "--threads", "1", "--jsonl", *(["--chat"] if as_chat else [])])
            assert code == 0
            out[(prompt, as_chat)] = json.loads(buf.getvalue())["text"]
    return out


# ---------------------------------------------------------------------------------------------------
# Output: the same as one sequence decoded alone
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_give_generate_text(tiny_server: Server, alone: dict, stream: bool) -> None:
    for prompt in PROMPTS[:3]:
        text, reason, usage = complete(tiny_server, prompt, stream)
        assert text == alone[(prompt, False)]
        assert usage.completion_tokens <= TOKENS and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert reason == ("length" if usage.completion_tokens == TOKENS else "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_gives_generate_chat_text(tiny_server: Server, alone: dict, stream: bool) -> None:
    for prompt in PROMPTS[:2]:
        assert chat(tiny_server, prompt, stream) == alone[(prompt, True)]


def test_concurrent_requests_each_get_their_alone_output(tiny_server: Server, alone: dict) -> None:
    """Twelve requests at once on 4 rows (the rest queue and join as rows free), streamed and whole mixed,
    each speculating or not: every text is its prompt's text alone."""
    jobs = [(p, i % 2 == 0, {"extra_body": {"speculation": {"method": "ar"}}} if i % 3 == 0 else {})
            for i, p in enumerate(PROMPTS * 2)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda j: complete(tiny_server, j[0], j[1], **j[2])[0], jobs))
    assert texts == [alone[(p, False)] for p, _, _ in jobs]


def test_usage_counts_prompt_and_completion_tokens(tiny_server: Server) -> None:
    from specstack.models.loading import load_tokenizer
    from specstack.models.registry import resolve

    ids = load_tokenizer(resolve(tiny_server.model), None)(PROMPTS[0]).input_ids
    _, reason, usage = complete(tiny_server, PROMPTS[0], False, max_tokens=5, extra_body={"ignore_eos": True})
    assert (usage.prompt_tokens, usage.completion_tokens, reason) == (len(ids), 5, "length")


def test_n_choices_and_seeded_samples(tiny_server: Server) -> None:
    client = tiny_server.client()
    greedy = {"model": tiny_server.model, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    r = client.completions.create(n=3, **greedy)
    single = client.completions.create(**greedy)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [single.choices[0].text] * 3  # greedy: each choice is the text alone
    # usage: the prompt counted once, the tokens of all three choices (8 each: max_tokens, EOS ignored)
    assert single.usage.completion_tokens == 8
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (single.usage.prompt_tokens, 3 * 8)
    # sampled: choice j uses seed + j, so a request is reproducible and its choices differ
    kw = {"model": tiny_server.model, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 1.5, "seed": 7}
    a = client.completions.create(n=3, **kw)
    b = client.completions.create(n=3, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    one = client.completions.create(n=1, **{**kw, "seed": 8})
    assert one.choices[0].text == a.choices[1].text


def test_prompt_list_gives_one_choice_per_prompt(tiny_server: Server, alone: dict) -> None:
    r = tiny_server.client().completions.create(model=tiny_server.model, prompt=PROMPTS[:2], max_tokens=TOKENS,
                                                temperature=0)
    assert [c.text for c in r.choices] == [alone[(p, False)] for p in PROMPTS[:2]]


def test_stop_string_cuts_the_text(tiny_server: Server, alone: dict) -> None:
    full = alone[(PROMPTS[0], False)]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop, "the tiny model's text is too short for this test"
    for stream in (False, True):
        text, reason, _ = complete(tiny_server, PROMPTS[0], stream, stop=[stop])
        assert text == full[: full.index(stop)]
        assert reason == "stop"


def test_a_method_per_request_gives_the_same_text(tiny_server: Server, alone: dict) -> None:
    """Off, or a draft-model chain (the server's --draft self:1) instead of the server's auto: the same text."""
    for body in ({"speculation": {"enabled": False}}, {"speculation": {"method": "chain:k=3"}},
                 {"speculation": {"method": "tree:budget=8"}}):
        for stream in (False, True):
            assert complete(tiny_server, PROMPTS[3], stream, extra_body=body)[0] == alone[(PROMPTS[3], False)]
    # a method whose source this server lacks (the tiny model has no trigram) is the request's error
    r = httpx.post(tiny_server.url + "/completions", json={"prompt": "hi", "speculation": {"method": "staged"}})
    assert error_of(r, 400)["code"] == "method_unavailable"


# ---------------------------------------------------------------------------------------------------
# Rows: a disconnect frees its row; a full server says so
# ---------------------------------------------------------------------------------------------------
LONG = 4000  # tokens of a request that runs for seconds on the tiny model (a few thousand tokens/s)


@pytest.fixture(scope="module")
def two_row_server(server_tmp: Path):
    """Two rows and no queue: a third request while two run is refused. Its model has a long context, so
    that a request can run long enough to be interrupted."""
    from tiny_checkpoints import build_tiny_checkpoint

    model = build_tiny_checkpoint(server_tmp / "tiny-long", context=LONG + 96)
    server = start_server(model, server_tmp, "--max-batch", "2", "--max-queue", "0", "--max-context", str(LONG + 96))
    yield server
    stop_server(server)


def long_stream(server: Server):
    return httpx.stream("POST", server.url + "/completions", timeout=60,
                        json={"model": server.model, "prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0,
                              "stream": True, "ignore_eos": True})


def next_data(lines: Iterator[str]) -> str:
    """The next SSE data line. The caller keeps `lines` (a response's iter_lines()): a line iterator that is
    dropped closes the connection, which the server rightly takes as the client going away."""
    for line in lines:
        if line.startswith("data:"):
            return line
    raise AssertionError("the stream ended")


def aborted(server: Server) -> float:
    return server.metrics().get("specstack:request_aborted_total{}", 0)


def steps_by_rows(server: Server) -> tuple[float, float]:
    """(engine steps, of them the steps whose forward held two rows or more), from /metrics."""
    m = server.metrics()
    steps = m["specstack:step_rows_count{}"]
    return steps, steps - m['specstack:step_rows_bucket{le="1.0"}']


def wait_for(condition, timeout: float = 10) -> None:
    """Until `condition()` holds (the caller asserts what it needs afterwards)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_full_server_answers_503_and_a_disconnect_frees_the_row(two_row_server: Server) -> None:
    server = two_row_server
    before = aborted(server)
    with long_stream(server) as a, long_stream(server) as b:
        lines_a, lines_b = a.iter_lines(), b.iter_lines()
        assert next_data(lines_a) and next_data(lines_b)  # both rows are decoding
        refused = httpx.post(server.url + "/completions", json={"prompt": "hi", "max_tokens": 2})
        never = httpx.post(server.url + "/completions", json={"prompt": "hi", "max_tokens": 2, "n": 3})
        assert error_of(never, 400)["param"] == "n"  # more choices than the server ever holds: not a retry
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "queue_full"
        assert refused.headers["retry-after"] == "1"
        a.close()  # a client goes away mid-stream: its row is free at the next step
        wait_for(lambda: aborted(server) == before + 1)  # counted once its row is free
        steps_before = steps_by_rows(server)
        r = httpx.post(server.url + "/completions", timeout=60,
                       json={"prompt": "hi", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        # ... and it joined the batch beside b, which is still decoding: continuous batching. Only b and this
        # request were in flight meanwhile, so a step of two rows decoded both together
        steps, two_rows = (after - since for after, since in zip(steps_by_rows(server), steps_before, strict=True))
        assert two_rows >= 1, (steps, two_rows)
        assert next_data(lines_b) != "data: [DONE]"
    wait_for(lambda: aborted(server) >= before + 2 and not server.metrics()["specstack:num_requests_running{}"])
    assert aborted(server) == before + 2  # a, and b closed by the with block
    assert server.metrics()["specstack:num_requests_running{}"] == 0


def test_disconnect_while_waiting_for_a_whole_response_cancels_it(two_row_server: Server) -> None:
    server = two_row_server
    before = aborted(server)
    # a non-streaming request whose client gives up: the server notices the closed connection
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/completions", timeout=0.3,
                   json={"prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0, "ignore_eos": True})
    wait_for(lambda: aborted(server) > before)
    assert aborted(server) == before + 1


# ---------------------------------------------------------------------------------------------------
# Errors: OpenAI's shape, the right status, never a traceback
# ---------------------------------------------------------------------------------------------------
def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "n": 1000}, "n"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "logprobs": 9}, "logprobs"),
    ({"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format"),
    ({"prompt": "hi", "regex": "a(b"}, "regex"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "speculation": {"method": "warp-drive"}}, "speculation"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_fields_are_400_naming_the_field(tiny_server: Server, body: dict, param: str) -> None:
    assert error_of(httpx.post(tiny_server.url + "/completions", json=body), 400)["param"] == param


def test_bad_json_and_bad_chat_messages_are_400(tiny_server: Server) -> None:
    error_of(httpx.post(tiny_server.url + "/completions", content=b'{"prompt": "hi",'), 400)
    error_of(httpx.post(tiny_server.url + "/completions", content=b"[1, 2]"), 400)
    for messages in ([], [{"role": "wizard", "content": "x"}], "hello", [{"role": "user", "content": [{"type": "image"}]}]):
        assert error_of(httpx.post(tiny_server.url + "/chat/completions", json={"messages": messages}), 400)["param"] \
            == "messages"


def test_a_body_over_the_cap_is_413_before_it_is_read(tiny_server: Server) -> None:
    big = {"prompt": "word " * (1 << 20)}  # 5 MB
    body = error_of(httpx.post(tiny_server.url + "/completions", json=big, timeout=60), 413)
    assert "MB" in body["message"] and body["type"] == "invalid_request_error"
    chunks = (b"x" * (1 << 16) for _ in range(80))  # no Content-Length: counted as it arrives
    error_of(httpx.post(tiny_server.url + "/completions", content=chunks, timeout=60), 413)
    with pytest.raises(openai.APIStatusError) as e:
        tiny_server.client().completions.create(model=tiny_server.model, prompt="word " * (1 << 20))
    assert e.value.status_code == 413
    assert httpx.post(tiny_server.url + "/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_over_long_prompt_is_400_context_length_exceeded(tiny_server: Server) -> None:
    long = "word " * 400  # over the 256-token context
    assert error_of(httpx.post(tiny_server.url + "/completions", json={"prompt": long}), 400)["code"] \
        == "context_length_exceeded"
    # a prompt that fits, with max_tokens that does not
    body = error_of(httpx.post(tiny_server.url + "/completions", json={"prompt": "hi", "max_tokens": 300}), 400)
    assert body["code"] == "context_length_exceeded" and "256" in body["message"]
    with pytest.raises(openai.BadRequestError):
        tiny_server.client().completions.create(model=tiny_server.model, prompt=long)


def test_unknown_model_and_route_are_404(tiny_server: Server) -> None:
    assert error_of(httpx.post(tiny_server.url + "/completions", json={"model": "gpt-9", "prompt": "hi"}), 404)["code"] \
        == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        tiny_server.client().completions.create(model="gpt-9", prompt="hi")
    error_of(httpx.get(tiny_server.url + "/nothing-here"), 404)


def test_models_lists_the_served_model(tiny_server: Server) -> None:
    models = tiny_server.client().models.list().data
    assert [m.id for m in models] == [tiny_server.model]


def test_api_key_is_required_when_set(server_model_dir: Path, server_tmp: Path) -> None:
    server = start_server(server_model_dir, server_tmp, "--max-batch", "1", api_key="s3cret")
    try:
        assert error_of(httpx.get(server.url + "/models"), 401)["code"] == "invalid_api_key"
        bad = httpx.post(server.url + "/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer no"})
        error_of(bad, 401)
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").models.list()
        r = server.client().completions.create(model=server.model, prompt="hi", max_tokens=2)
        assert r.usage.completion_tokens <= 2
        assert httpx.get(server.root + "/health").status_code == 200  # health and metrics need no key
    finally:
        stop_server(server)


# ---------------------------------------------------------------------------------------------------
# /metrics and /health
# ---------------------------------------------------------------------------------------------------
def test_metrics_parse_and_move_with_requests(tiny_server: Server) -> None:
    before = tiny_server.metrics()
    _, _, usage = complete(tiny_server, PROMPTS[4], True)
    after = tiny_server.metrics()

    def moved(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert moved("specstack:generation_tokens_total{}") == usage.completion_tokens
    assert moved("specstack:prompt_tokens_total{}") == usage.prompt_tokens
    assert moved("specstack:time_to_first_token_seconds_count{}") == 1
    assert moved("specstack:e2e_request_latency_seconds_count{}") == 1
    assert moved("specstack:inter_token_latency_seconds_count{}") == usage.completion_tokens - 1
    reasons = [k for k in after if k.startswith("specstack:request_success_total{")]
    assert sum(moved(k) for k in reasons) == 1
    origins = [k for k in after if k.startswith("specstack:generation_tokens_by_origin_total{")]
    assert sum(moved(k) for k in origins) == usage.completion_tokens
    assert after["process_resident_memory_bytes{}"] > 0
    # the steps: each counted, each of one row (the request was alone on the server); what speculation did
    # in them (auto may draft nothing here: its lengths follow this machine's measured costs) adds up
    steps = sum(moved(k) for k in after if k.startswith("specstack:engine_steps_total{"))
    assert steps >= 1
    assert moved("specstack:step_rows_count{}") == moved("specstack:step_rows_sum{}") == steps
    spec = speculation_moved(moved)
    assert spec["accepted"] <= spec["drafted"]
    assert spec["drafting steps"] == moved('specstack:engine_steps_total{speculating="true"}')


def speculation_moved(moved) -> dict[str, float]:
    """What /metrics says speculation did between two scrapes (`moved`: a sample's change), its counts checked
    against each other: the per-step draft histogram against the draft token counter, the accepted tokens
    per draft position (counted from each request's own steps when it ends) against the accepted tokens
    counted at each step."""
    out = {"drafted": moved("specstack:spec_decode_num_draft_tokens_total{}"),
           "accepted": moved("specstack:spec_decode_num_accepted_tokens_total{}"),
           "drafting steps": moved("specstack:spec_decode_num_drafts_total{}")}
    assert moved("specstack:step_draft_tokens_sum{}") == out["drafted"]
    positions = sum(moved(f'specstack:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}')
                    for i in range(MAX_POSITION))
    assert positions == out["accepted"]
    return out


@pytest.fixture(scope="module")
def chain_server(server_model_dir: Path, server_tmp: Path):
    """Every request speculates alike: a chain of 3 draft tokens from the target's first layer at every step,
    verified whole (no cost rule: what is drafted does not depend on this machine's timings)."""
    server = start_server(server_model_dir, server_tmp, "--max-batch", "2", "--method", "chain:k=3",
                          "--draft", "self:1")
    yield server
    stop_server(server)


def test_speculation_metrics_count_the_drafts(chain_server: Server) -> None:
    before = chain_server.metrics()
    _, _, usage = complete(chain_server, PROMPTS[1], True, extra_body={"ignore_eos": True})
    after = chain_server.metrics()

    def moved(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert usage.completion_tokens == TOKENS
    spec = speculation_moved(moved)
    # one row, a chain of 3 at each of its decoding steps (the first token its prompt's forward gives):
    # verified, and on this prompt accepted in part
    assert spec["drafting steps"] == moved('specstack:engine_steps_total{speculating="true"}') >= 1
    assert spec["drafted"] == 3 * spec["drafting steps"]
    assert 0 < spec["accepted"] < spec["drafted"]
    # every accepted draft token was emitted, but for any cut by max_tokens
    from_draft = moved('specstack:generation_tokens_by_origin_total{origin="draft"}')
    assert 0 < from_draft <= spec["accepted"]
    assert from_draft + moved('specstack:generation_tokens_by_origin_total{origin="target"}') == TOKENS


def cached_config_as_pipe(model: Path, cache: Path) -> tuple[Path, bytes]:
    """Build `model` in fp32 into the weight cache `cache`, as a server's first load leaves it, then make
    the cached config a named pipe: a server loading `model` from `cache` waits, reading the pipe, until
    the test writes into it. Returns the pipe and what to write (the config)."""
    from specstack.models.loading import load_model, model_cache_dir
    from specstack.models.registry import resolve

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSTACK_CACHE", str(cache))
        load_model(str(model), dtype="fp32")
        config = model_cache_dir(resolve(str(model))) / "config.json"
    text = config.read_bytes()
    config.unlink()
    os.mkfifo(config)
    return config, text


def reader_of(pipe: Path, timeout: float = 60) -> int | None:
    """A write end of `pipe` once a reader has it open (the server blocked on reading it), else None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while nobody reads it
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
        time.sleep(0.02)
    return None


def release(pipe: Path, fd: int, text: bytes) -> None:
    """Put the real file in the pipe's place (for whoever reads it next), then give the waiting reader its
    bytes and the end of its file."""
    pipe.with_suffix(".json.real").write_bytes(text)
    pipe.with_suffix(".json.real").replace(pipe)
    try:
        os.write(fd, text)  # shorter than a pipe's buffer: written whole
    finally:
        os.close(fd)


def test_health_and_requests_are_503_while_loading_then_200(server_model_dir: Path, tmp_path: Path) -> None:
    """While the model loads, /health says so and a request gets 503 `loading` with Retry-After; once it has
    loaded, both answer. The load is held for certain: the server's loader thread reads the cached config
    from a pipe, which the test fills only after its checks."""
    pipe, text = cached_config_as_pipe(server_model_dir, tmp_path / "cache")  # the server's cache
    server = start_server(server_model_dir, tmp_path, "--max-batch", "8", wait=False)
    fd = reader_of(pipe)
    try:
        assert fd is not None, f"the server never read its cached config:\n{server.stderr()}"
        health = httpx.get(server.root + "/health")
        assert health.status_code == 503 and health.json()["status"] == "loading", health.text
        early = httpx.post(server.url + "/completions", json={"prompt": "hi", "max_tokens": 2})
        assert error_of(early, 503)["code"] == "loading"
        assert early.headers["retry-after"] == "1"
        with pytest.raises(openai.InternalServerError):  # the openai client's error for a 503
            server.client().completions.create(model=server.model, prompt="hi", max_tokens=2)
        release(pipe, fd, text)
        fd = None
        wait_ready(server)
        health = httpx.get(server.root + "/health").json()
        assert health["status"] == "ok" and health["prefix_cache"]["capacity_bytes"] == 1024 << 20
        r = httpx.post(server.url + "/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2, r.text
    finally:
        if fd is not None:  # a load left waiting would keep the server from stopping
            release(pipe, fd, text)
        stop_server(server)


def test_streams_end_with_done_and_chat_deltas_have_the_role(tiny_server: Server) -> None:
    with httpx.stream("POST", tiny_server.url + "/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
