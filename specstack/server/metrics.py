"""`GET /metrics`: the server's state and history in Prometheus text, names in vLLM's style.

Everything is recorded by the engine thread (prometheus_client's metrics are thread-safe) at the
moment it happens: a request queued, its first token, each step's tokens, its end. Speculation is
counted per step (what the draft-length rule let through: drafted and accepted tokens, rows that
drafted) and per request at its end (accepted tokens by draft position, tokens by origin), so a
scrape shows both what the cost-aware rule is choosing now and how well drafts did.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.process_collector import ProcessCollector

from specstack.engine.stats import GenerationResult
from specstack.prefix_cache import PrefixCache, PrefixCacheStats

PREFIX = "specstack:"
# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DRAFT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MAX_POSITION = 64  # accepted-per-position labels stop here (the most draft tokens verified per step)


class ServerMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes: memory across a load run
        r, m = self.registry, ("model_name",)
        self.model = model

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, m + labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, m, buckets=buckets, registry=r)

        self.running = Gauge(PREFIX + "num_requests_running", "Requests decoding in the batch", m, registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests queued for a row", m, registry=r)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.requests = counter("request_success", "Requests finished, by finish reason", ("finished_reason",))
        self.aborted = counter("request_aborted", "Requests cancelled before they finished (client gone)")
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between a request's tokens (a step that emits k tokens counts k gaps of 1/k)",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token", E2E_BUCKETS)
        self.steps = counter("engine_steps", "Engine steps (one target forward each), by whether any row drafted",
                             ("speculating",))
        self.step_rows = histogram("step_rows", "Rows in each step's forward", ROW_BUCKETS)
        self.step_draft_tokens = histogram("step_draft_tokens",
                                           "Draft tokens verified per step over all rows: what the draft-length "
                                           "rule chose for this load (0: speculation off)", DRAFT_BUCKETS)
        self.drafts = counter("spec_decode_num_drafts", "Row steps that verified a draft")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Row steps whose accepted path reached this draft position (from 0)",
                                        ("position",))
        self.origin_tokens = counter("generation_tokens_by_origin",
                                     "Generated tokens by where they came from (target, draft, draft2, context)",
                                     ("origin",))

        self.prefix_queries = counter("prefix_cache_queries", "Requests that looked for their prompt's prefix in "
                                      "the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Requests that found at least one token of it")
        self.prefix_cached_tokens = counter("prefix_cache_cached_tokens",
                                            "Prompt tokens taken from the prefix cache instead of read")
        self.prefix_bytes = Gauge(PREFIX + "prefix_cache_bytes", "Bytes of the prefix cache's block pool its "
                                  "blocks hold (slots in use x slot bytes)", m, registry=r)
        self.prefix_allocated = Gauge(PREFIX + "prefix_cache_allocated_bytes", "Bytes of the prefix cache's block "
                                      "pool allocated so far (its chunks: at most the budget, kept)", m, registry=r)
        self.prefix_capacity = Gauge(PREFIX + "prefix_cache_capacity_bytes", "The prefix cache's budget", m,
                                     registry=r)
        self.prefix_tokens = Gauge(PREFIX + "prefix_cache_tokens", "Tokens whose keys/values the prefix cache holds",
                                   m, registry=r)
        self._prefix_seen = PrefixCacheStats()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- recorded by the engine thread ---------------------------------------------------------------
    def queue(self, running: int, waiting: int) -> None:
        self.running.labels(self.model).set(running)
        self.waiting.labels(self.model).set(waiting)

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model).observe(seconds)

    def tokens(self, count: int, gap: float | None) -> None:
        """`count` new tokens of one request in one step, `gap` seconds after its previous ones."""
        self.generation_tokens.labels(self.model).inc(count)
        if gap is not None and count:
            for _ in range(count):
                self.itl.labels(self.model).observe(gap / count)

    def step(self, rows: int, drafted: int, accepted: int, drafting_rows: int) -> None:
        self.steps.labels(self.model, "true" if drafted else "false").inc()
        self.step_rows.labels(self.model).observe(rows)
        self.step_draft_tokens.labels(self.model).observe(drafted)
        self.draft_tokens.labels(self.model).inc(drafted)
        self.accepted_tokens.labels(self.model).inc(accepted)
        self.drafts.labels(self.model).inc(drafting_rows)

    def finished(self, result: GenerationResult, finish_reason: str, seconds: float) -> None:
        self.requests.labels(self.model, finish_reason).inc()
        self.e2e.labels(self.model).observe(seconds)
        for s in result.stats.steps:
            for position in range(min(s.accepted, MAX_POSITION)):
                self.accepted_per_pos.labels(self.model, str(position)).inc()
        origins = result.stats.origins
        origins["target"] += len(result.tokens) - sum(origins.values())  # rows without a drafter
        for origin, count in origins.items():
            if count > 0:
                self.origin_tokens.labels(self.model, origin).inc(count)

    def prefix_cache(self, cache: PrefixCache) -> None:
        """The prefix cache's counters since the last call, and its size now."""
        st, seen = cache.stats, self._prefix_seen
        self.prefix_queries.labels(self.model).inc(st.queries - seen.queries)
        self.prefix_hits.labels(self.model).inc(st.hits - seen.hits)
        self.prefix_cached_tokens.labels(self.model).inc(st.cached_tokens - seen.cached_tokens)
        self._prefix_seen = PrefixCacheStats(st.queries, st.hits, st.cached_tokens)
        self.prefix_bytes.labels(self.model).set(cache.nbytes)
        self.prefix_allocated.labels(self.model).set(cache.allocated_bytes)
        self.prefix_capacity.labels(self.model).set(cache.max_bytes)
        self.prefix_tokens.labels(self.model).set(cache.tokens)

    def cancelled(self) -> None:
        self.aborted.labels(self.model).inc()
