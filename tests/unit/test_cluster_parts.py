"""The replica deployment's parts that need no Ray: `--replicas` parsing, core pinning, the metrics merge,
and the proxy's failover middleware, driven as ASGI with an inner app that fails the way Ray Serve's
proxy does when a replica dies (no answer at all, or a stream cut mid-body)."""
from __future__ import annotations

import asyncio
import json
import socket

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specstack.cluster import failover
from specstack.cluster.aggregate import label, merge
from specstack.cluster.deploy import ReplicaCount, check_cpus, parse_replicas
from specstack.cluster.failover import Failover
from specstack.cluster.replica import cores_for
from specstack.errors import SpecstackError
from specstack.server.listen import bind, url_of


# ---------------------------------------------------------------------------------------------------
# --replicas and CPUs
# ---------------------------------------------------------------------------------------------------
def test_replicas_is_n_or_min_max() -> None:
    assert parse_replicas("--replicas", "2") == ReplicaCount(2, 2)
    assert parse_replicas("--replicas", "0:4") == ReplicaCount(0, 4) and not ReplicaCount(0, 4).fixed
    for bad in ("0", "3:2", "x", "1:y", "2000", "-1", "0:0"):
        with pytest.raises(SpecstackError, match="--replicas"):
            parse_replicas("--replicas", bad)


def test_replicas_that_cannot_fit_the_cpus_are_refused() -> None:
    check_cpus(ReplicaCount(2, 2), 1, 2, "this machine")
    with pytest.raises(SpecstackError, match="needs 4 CPUs; this machine has 2"):
        check_cpus(ReplicaCount(2, 2), 2, 2, "this machine")
    check_cpus(ReplicaCount(0, 8), 2, 2, "this machine")  # autoscaling starts with one


def test_a_busy_port_fails_before_ray_starts() -> None:
    """deploy.py binds the port with the one server's `bind` before Ray starts, then hands it to Ray's proxy."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(SpecstackError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind("127.0.0.1", port)
    picked = bind("127.0.0.1", 0)  # --port 0: a free one
    try:
        assert url_of(picked) == f"http://127.0.0.1:{picked.getsockname()[1]}"
    finally:
        picked.close()


def test_each_replica_on_a_node_gets_cores_of_its_own() -> None:
    cores = [0, 1, 2, 3, 8, 9]  # an affinity mask need not be contiguous
    assert [cores_for(cores, 2, r) for r in range(3)] == [(0, 1), (2, 3), (8, 9)]
    assert cores_for(cores, 1, 4) == (8,)
    assert cores_for([0, 1], 1, 2) == (0,)  # more replicas than cores: shared round the ring
    assert cores_for([5], 4, 0) == (5,)


# ---------------------------------------------------------------------------------------------------
# /metrics over replicas
# ---------------------------------------------------------------------------------------------------
def replica_text(tokens: float, running: float, latencies: list[float]) -> str:
    r = CollectorRegistry()
    Counter("specstack:generation_tokens", "Tokens generated", ["model_name"], registry=r).labels("m").inc(tokens)
    Gauge("specstack:num_requests_running", "Running", ["model_name"], registry=r).labels("m").set(running)
    h = Histogram("specstack:e2e_seconds", "End to end", ["model_name"], buckets=(1.0, 5.0), registry=r)
    for x in latencies:
        h.labels("m").observe(x)
    return generate_latest(r).decode()


def values(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_merge_sums_every_series_and_keeps_the_earliest_time() -> None:
    a, b = replica_text(10, 2, [0.5, 3.0]), replica_text(32, 1, [7.0])
    merged = values(merge({"a": a, "b": b}).decode())
    m = (("model_name", "m"),)
    assert merged[("specstack:generation_tokens_total", m)] == 42
    assert merged[("specstack:num_requests_running", m)] == 3
    assert merged[("specstack:e2e_seconds_bucket", (("le", "1.0"), *m))] == 1
    assert merged[("specstack:e2e_seconds_bucket", (("le", "+Inf"), *m))] == 3
    assert merged[("specstack:e2e_seconds_sum", m)] == pytest.approx(10.5)
    created = [values(t)[("specstack:generation_tokens_created", m)] for t in (a, b)]
    assert merged[("specstack:generation_tokens_created", m)] == min(created)


def test_metrics_by_replica_keep_each_replicas_series_apart() -> None:
    per = values(label({"a": replica_text(10, 2, []), "b": replica_text(32, 1, [])}).decode())
    tokens = {dict(k)["replica"]: v for (name, k), v in per.items() if name == "specstack:generation_tokens_total"}
    assert tokens == {"a": 10, "b": 32}


# ---------------------------------------------------------------------------------------------------
# The proxy's failover
# ---------------------------------------------------------------------------------------------------
class FlakyProxy:
    """An inner ASGI app standing for Ray Serve's proxy: each call takes the next behaviour from `plan`
    and records the request body it read."""

    def __init__(self, *plan: str) -> None:
        self.plan, self.bodies = list(plan), []

    async def __call__(self, scope, receive, send) -> None:
        self.bodies.append((await receive())["body"])
        behaviour = self.plan.pop(0)
        if behaviour == "dies":  # the replica died before answering: the proxy sends nothing
            return
        if behaviour == "dies-after-headers":  # a stream whose replica died before its first token
            await send({"type": "http.response.start", "status": 200, "headers": []})
            return
        if behaviour == "text-503":  # the proxy's own plain-text answer
            await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"Deployment unavailable", "more_body": False})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: one\n\n", "more_body": True})
        if behaviour == "cut":  # died mid-stream
            return
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def drive(app, body: bytes = b'{"prompt": "x"}') -> tuple[int, bytes, dict]:
    """One HTTP request through `app`: its status, whole body and headers."""
    sent: list[dict] = []
    incoming = [{"type": "http.request", "body": body[:5], "more_body": True},
                {"type": "http.request", "body": body[5:], "more_body": False}]

    async def receive():
        if incoming:
            return incoming.pop(0)
        await asyncio.sleep(3600)  # the client stays

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive, send))
    start = [m for m in sent if m["type"] == "http.response.start"]
    assert len(start) == 1, sent
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert bodies and not bodies[-1].get("more_body", False), "the response must end"
    return start[0]["status"], b"".join(m.get("body", b"") for m in bodies), dict(start[0]["headers"])


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failover, "BACKOFF_S", (0.0,))


@pytest.mark.parametrize("death", ["dies", "dies-after-headers"])
def test_a_request_whose_replica_died_before_answering_is_sent_again(death: str) -> None:
    inner = FlakyProxy(death, "ok")
    status, body, _ = drive(Failover(inner))
    assert (status, body) == (200, b"data: one\n\ndata: [DONE]\n\n")
    assert inner.bodies == [b'{"prompt": "x"}'] * 2  # the same body, whole, each time


def test_out_of_retries_is_a_503_with_an_openai_error() -> None:
    status, body, headers = drive(Failover(FlakyProxy("dies", "dies", "dies"), retries=2))
    assert status == 503 and headers[b"retry-after"] == b"1"
    assert json.loads(body)["error"]["code"] == "replica_failed"


def test_a_stream_cut_mid_body_ends_with_an_error_event() -> None:
    inner = FlakyProxy("cut", "ok")
    status, body, _ = drive(Failover(inner))
    assert status == 200 and len(inner.bodies) == 1  # text was sent: not retried
    first, last = body.split(b"\n\n")[:2]
    assert first == b"data: one"
    assert json.loads(last.removeprefix(b"data: "))["error"]["code"] == "replica_failed"


def test_the_proxys_plain_text_errors_become_openai_errors() -> None:
    status, body, headers = drive(Failover(FlakyProxy("text-503")))
    assert status == 503 and headers[b"content-type"] == b"application/json"
    assert json.loads(body)["error"] == {"message": "Deployment unavailable", "type": "service_unavailable_error",
                                         "param": None, "code": None}
