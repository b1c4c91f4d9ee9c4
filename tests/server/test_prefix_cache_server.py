"""The prefix cache through a real server and the `openai` client: a prompt sent again (or extended) reads
only what is new, OpenAI's `usage.prompt_tokens_details.cached_tokens` says how much was cached (whole
responses and streams), the text is the text of a server without the cache, n samples read their prompt
once, and /metrics and /health move as requests run; `--no-prefix-cache` turns it all off."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server.servers import Server, start_server, stop_server

# long enough for several 32-token blocks, and unlike any other test's prompt (the server is shared)
BASE = "".join(f"def step_{i}(state):\n    return state * {i} + {i * i}\n\n" for i in range(9))
TAIL = "def finish(state):\n    return"


@pytest.fixture(scope="module")
def cold_server(server_model_dir: Path, server_tmp: Path):
    server = start_server(server_model_dir, server_tmp, "--no-prefix-cache")
    yield server
    stop_server(server)


def ask(server: Server, prompt: str, stream: bool = False, **kw: object) -> tuple[list[str], object]:
    client = server.client()
    args = {"model": server.model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "extra_body": {"ignore_eos": True}, **kw}
    if not stream:
        r = client.completions.create(**args)
        return [c.text for c in r.choices], r.usage
    texts: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    return [texts[i] for i in sorted(texts)], usage


def prefix_metrics(server: Server) -> tuple[float, float, float, float]:
    m = server.metrics()
    return (m["specstack:prefix_cache_queries_total{}"], m["specstack:prefix_cache_hits_total{}"],
            m["specstack:prefix_cache_cached_tokens_total{}"], m["specstack:prefix_cache_bytes{}"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_prompt_sent_again_reads_only_its_new_tail(tiny_server: Server, cold_server: Server, stream: bool) -> None:
    base = f"{'streamed' if stream else 'whole'} = True\n" + BASE  # no first token in common with other prompts
    before = prefix_metrics(tiny_server)
    text, first = ask(tiny_server, base, stream)
    assert first.prompt_tokens_details.cached_tokens == 0
    again, second = ask(tiny_server, base + TAIL, stream)
    cached = second.prompt_tokens_details.cached_tokens
    assert 32 <= cached < second.prompt_tokens and cached >= first.prompt_tokens - 32
    assert (text, again) == (ask(cold_server, base)[0], ask(cold_server, base + TAIL)[0])
    queries, hits, tokens, size = prefix_metrics(tiny_server)
    assert (queries - before[0], hits - before[1], tokens - before[2]) == (2, 1, cached)
    assert size > 0
    health = httpx.get(tiny_server.root + "/health").json()["prefix_cache"]
    assert health["bytes"] == size and 0 < health["usage"] <= 1 and health["tokens"] >= cached
    pool = tiny_server.metrics()["specstack:prefix_cache_allocated_bytes{}"]  # the block pool's chunks so far
    assert size <= pool == health["allocated_bytes"] <= health["capacity_bytes"]


def test_n_samples_read_their_prompt_once(tiny_server: Server, cold_server: Server) -> None:
    prompt = "samples = 4\n" + BASE
    before = prefix_metrics(tiny_server)
    texts, usage = ask(tiny_server, prompt, n=4, temperature=1.0, seed=11)
    assert usage.prompt_tokens_details.cached_tokens == 0  # read once, cold; the three others copied it
    queries, hits, tokens, _ = prefix_metrics(tiny_server)
    assert (queries - before[0], hits - before[1]) == (4, 3)
    assert tokens - before[2] >= 3 * (usage.prompt_tokens - 32)
    assert texts == ask(cold_server, prompt, n=4, temperature=1.0, seed=11)[0]  # seeded: as without the cache


def test_without_the_cache_nothing_is_cached(cold_server: Server) -> None:
    ask(cold_server, "cold = 1\n" + BASE)
    _, usage = ask(cold_server, "cold = 1\n" + BASE + TAIL)
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert httpx.get(cold_server.root + "/health").json() == {"status": "ok", "prefix_cache": None}
    assert "specstack:prefix_cache_queries_total{}" not in cold_server.metrics()
