"""What `specstack bench-serve` sends, as data: where the requests go (`Target`), at which loads
(`Level`), what every request asks (`LoadSettings`), and the plan of a level: how many requests, which
of them close their stream early, when they arrive (seeded: the same on every run and machine).
`RequestRow` is one request's record, filled by serve_load.py as its stream arrives.

Terms:
- a *level* is one setting of the load: `concurrency C` (closed loop: C clients, each sending its next
  request when its last one ends) or `rate R` (open loop: requests arrive at R per second, Poisson, seeded,
  however many are in flight);
- a request ends `ok`, `error` (an HTTP status, a network failure, an error event, a timeout, a stream
  cut before `data: [DONE]`) or `cancelled`: closed by the client after its first few content chunks
  (--disconnect: a client going away mid-stream; neither an error nor counted in the tokens).
"""
from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Target:
    """Where the requests go: `url` is the API base (`http://host:port/v1`)."""
    url: str
    model: str
    api_key: str | None = None

    @property
    def root(self) -> str:
        """The server's root (the url without a trailing /v1): where /metrics and /health live."""
        return self.url[: -len("/v1")] if self.url.endswith("/v1") else self.url

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class Level:
    """One load setting: `concurrency` clients in a closed loop, or `rate` requests/s (Poisson)."""
    kind: Literal["concurrency", "rate"]
    value: float

    @property
    def name(self) -> str:
        return f"c{self.value:g}" if self.kind == "concurrency" else f"r{self.value:g}"

    def describe(self) -> str:
        return f"concurrency {self.value:g}" if self.kind == "concurrency" else f"rate {self.value:g}/s"


@dataclass(frozen=True)
class LoadSettings:
    """What every request asks, and how many are sent per level."""
    endpoint: str | None = None  # completions | chat | None: per prompt (a chat prompt goes to chat)
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    disconnect: float = 0.0  # share of each level's requests that close their stream early
    seed: int = 0
    timeout: float = 600.0  # seconds per request, from sending it to the end of its stream
    requests: int | None = None  # per level; None: requests_for's default
    extra_body: Mapping[str, Any] = field(default_factory=dict)  # merged into every body


@dataclass
class RequestRow:
    """One request of a level. Times are seconds; sent_s counts from the level's start."""
    level: str
    index: int  # within the level, in sending order
    prompt: int  # index into the prompt list
    endpoint: str
    status: str = "error"  # ok | error | cancelled
    http_status: int | None = None
    error: str | None = None
    sent_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between successive content chunks
    e2e_s: float | None = None
    chunks: int = 0  # content chunks
    usage_tokens: int | None = None  # the final usage.completion_tokens, if sent
    output_tokens: int = 0
    text: str = ""
    prompt_tokens: int | None = None  # the final usage.prompt_tokens, if sent
    cached_tokens: int | None = None  # prompt tokens the server reused from its cache, if it says (serve_wire.usage_counts)
    choices: int = 0  # distinct choice indices that carried content (n > 1 streams them interleaved, so text mixes them)


def requests_for(level: Level, prompts: int, requests: int | None) -> int:
    """Requests sent at a level: `requests` if given, else every prompt once and at least 4 per client
    (4 x C; 4 x R for a rate: about 4 s of arrivals), so each client's start and end are a small part."""
    if requests is not None:
        return requests
    return max(prompts, math.ceil(4 * level.value))


def _rng(seed: int, salt: str) -> random.Random:
    # a string seed is hashed with SHA-512 (random.seed version 2): the same on every run and machine
    return random.Random(f"{seed}/{salt}")


def disconnect_set(n: int, share: float, seed: int, salt: str = "") -> frozenset[int]:
    """Which of n requests close their stream early: round(share x n) of them, chosen by the seed."""
    k = min(n, round(share * n))
    return frozenset(_rng(seed, "disconnect/" + salt).sample(range(n), k))


def arrival_times(n: int, rate: float, seed: int, salt: str = "") -> list[float]:
    """Seconds from a level's start at which its n requests are sent: a Poisson process of `rate`
    per second (exponential gaps), the first at 0 so a level starts with work."""
    rng = _rng(seed, "arrivals/" + salt)
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times
