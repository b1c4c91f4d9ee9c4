"""`specstack serve --replicas 2` on a local Ray instance, through Ray Serve's proxy and the real `openai`
client: the same greedy text as one server; requests spread over both replicas, each pinned to a core
of its own; /metrics summed over replicas and per replica; a replica killed mid-run leaves the endpoint
serving (requests it held are retried or end with a clear error) and is replaced; everything stops
cleanly, with no Ray process left behind.

The test starts Ray itself (`ray.init` with 2 CPUs, loopback only) and the server joins it with
`--ray-address`, so the test can kill a replica's actor. One module-scoped deployment serves every test;
the last one stops it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server.servers import TOKENS, Server, chat, complete, start_server, stop_server

from specstack.cluster.deploy import RAY_ENV

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n", "Once upon a time"]
LONG = 200  # tokens of the requests in flight when a replica is killed
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray binds 127.0.0.1, not the node's address


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A local Ray instance of 2 CPUs on loopback, its proxy with the failover middleware; its GCS address."""
    env = {LOOPBACK_ENV: "0", **RAY_ENV}  # as `specstack serve --replicas` sets them for its own Ray
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import ray

    ray.init(num_cpus=2, include_dashboard=False, namespace="specstack-test", log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def replicas(ray_cluster: str, server_model_dir: Path, server_tmp: Path) -> Iterator[Server]:
    """Two replicas of the tiny model, one thread and up to 2 rows each."""
    server = start_server(server_model_dir, server_tmp, "--replicas", "2", "--ray-address", ray_cluster,
                          "--max-batch", "2")
    yield server
    stop_server(server)


def health(server: Server) -> dict:
    r = httpx.get(server.root + "/health", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample called `name` in Prometheus text, by its labels (model_name left out)."""
    return {tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name}


def text(server: Server, prompt: str, stream: bool, tokens: int = TOKENS) -> str:
    return complete(server, prompt, stream, max_tokens=tokens)[0]


def test_replicas_give_one_servers_greedy_text(replicas: Server, tiny_server: Server) -> None:
    calls = [(f, p, s) for f in (text, chat) for p in PROMPTS for s in (False, True)]
    with ThreadPoolExecutor(8) as pool:  # concurrent, so both replicas answer some
        through_proxy = list(pool.map(lambda c: c[0](replicas, c[1], c[2]), calls))
    alone = [f(tiny_server, p, s) for f, p, s in calls]
    assert through_proxy == alone
    models = replicas.client().models.list().data
    assert [m.id for m in models] == [replicas.model]


def settled(server: Server, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The replicas' counters once they stop moving: another replica's numbers reach the proxy up to a
    second late, so a read right after earlier requests can miss some of them."""
    last = samples(httpx.get(server.root + "/metrics/replicas").text, name)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(1.5)
        now = samples(httpx.get(server.root + "/metrics/replicas").text, name)
        if now == last:
            break
        last = now
    return last


def test_requests_spread_over_both_pinned_replicas(replicas: Server) -> None:
    h = health(replicas)
    assert len(h["replicas"]) == 2 and {r["status"] for r in h["replicas"]} == {"ok"}
    assert len({r["pid"] for r in h["replicas"]}) == 2
    assert sorted(c for r in h["replicas"] for c in r["cores"]) == [0, 1]  # a core of its own each
    before = settled(replicas, "specstack:request_success_total")  # earlier tests' requests counted in full
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: text(replicas, PROMPTS[i % 4], False), range(16)))
    deadline = time.monotonic() + 10  # the other replica's numbers are up to a second old
    while True:
        per = samples(httpx.get(replicas.root + "/metrics/replicas").text, "specstack:request_success_total")
        done = {dict(k)["replica"]: v - before.get(k, 0) for k, v in per.items()}
        if sum(done.values()) == 16 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sum(done.values()) == 16 and len(done) == 2 and min(done.values()) >= 4, done  # P2C: both get work
    total = samples(httpx.get(replicas.root + "/metrics").text, "specstack:request_success_total")
    assert sum(total.values()) == sum(per.values())  # /metrics: one server's series, summed
    assert all("replica" not in dict(k) for k in total)


def replica_actor(replica_id: str):
    import ray

    return ray.get_actor(f"SERVE_REPLICA::specstack#specstack#{replica_id}", namespace="serve")


def ongoing(replica_id: str) -> int:
    """The requests a replica is handling now, as Ray Serve counts them (the count its router balances on)."""
    import ray

    return ray.get(replica_actor(replica_id).get_num_ongoing_requests.remote(), timeout=30)


def successes(server: Server, replica: str, until: float | None = None, timeout: float = 10) -> float:
    """Requests `replica` has finished, by its own count (up to a second old); with `until`, asked again
    until the count reaches it or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = httpx.get(server.root + "/metrics/replicas", timeout=5).text
        except httpx.TimeoutException:  # routed to a replica that cannot answer: ask again
            continue
        per = samples(text, "specstack:request_success_total")
        count = sum(v for k, v in per.items() if dict(k)["replica"] == replica)
        if until is None or count >= until or time.monotonic() > deadline:
            return count
        time.sleep(0.2)


def test_killing_a_replica_keeps_the_endpoint_serving(replicas: Server, tiny_server: Server) -> None:
    """The killed replica holds requests for certain: it is frozen (SIGSTOP) while it handles more requests
    than its two rows, then killed once the other has finished all it had. The requests it held then end as
    the failover promises: a whole one retried on the other replica, a stream that had begun with the
    error event; every other request is answered in full."""
    expected = {p: text(tiny_server, p, False, LONG) for p in PROMPTS}
    victim, survivor = (r["replica"] for r in health(replicas)["replicas"])
    pid = next(r["pid"] for r in health(replicas)["replicas"] if r["replica"] == victim)
    jobs = [(PROMPTS[i % 4], i % 3 == 0) for i in range(16)]  # whole requests, and every third a stream

    def run(job: tuple[str, bool]) -> str | Exception:
        try:  # autoregressive (the same text): 200 steps a request, so a queued one waits long
            return complete(replicas, job[0], job[1], max_tokens=LONG,
                            extra_body={"speculation": {"enabled": False}})[0]
        except openai.APIError as e:
            return e

    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(run, j) for j in jobs]
        killed = False
        try:
            while ongoing(victim) < 3:  # both rows decoding and one waiting
                assert not all(f.done() for f in futures), "the victim never had three requests at once"
            os.kill(pid, signal.SIGSTOP)  # what it holds now, it holds until it dies
            while ongoing(survivor) > 0:  # the survivor finishes what it had
                time.sleep(0.1)
            settled = None
            while settled != (done := sum(f.done() for f in futures)):  # the survivor's answers have arrived
                settled = done
                time.sleep(1)
            held = [i for i, f in enumerate(futures) if not f.done()]
            assert held, "the victim held no request when it was killed"
            before = successes(replicas, survivor)
            os.kill(pid, signal.SIGKILL)
            killed = True
            results = [f.result() for f in futures]
        finally:
            if not killed:
                os.kill(pid, signal.SIGKILL)
    failed = [i for i, r in enumerate(results) if isinstance(r, Exception)]
    for i in failed:  # only a stream that had begun on the killed replica may fail: a whole request it held
        # must have been retried (without the failover it would be a 500 here)
        assert i in held and jobs[i][1] and "replica serving this request stopped" in str(results[i]), results[i]
    for i, r in enumerate(results):
        if i not in failed:
            assert r == expected[jobs[i][0]], (jobs[i], r)
    # the held requests that were answered were answered by the survivor, after the kill: retried
    retried = len(held) - len(failed)
    assert successes(replicas, survivor, until=before + retried) - before == retried
    deadline = time.monotonic() + 45  # Ray replaces the replica
    while True:
        ids = {r["replica"] for r in health(replicas)["replicas"]}
        if len(ids) == 2 and victim not in ids or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(ids) == 2 and victim not in ids, ids
    assert text(replicas, PROMPTS[0], True, LONG) == expected[PROMPTS[0]]


def test_stopping_leaves_no_replica_running(replicas: Server, ray_cluster: str) -> None:
    import ray

    stop_server(replicas)  # SIGTERM: the deployment is deleted, the command exits 0
    assert replicas.process.returncode == 0, replicas.stderr()
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in names if n.startswith("SERVE_REPLICA::specstack") or n.endswith("-board")], names
    r = httpx.get(replicas.root + "/health", timeout=5)  # the proxy still runs (the test's Ray); the app is gone
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text  # OpenAI-shaped
    ps = subprocess.run(["pgrep", "-f", "ServeReplica:specstack"], capture_output=True, text=True)
    assert ps.stdout.strip() == "", ps.stdout
