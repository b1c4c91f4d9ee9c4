"""Replicas side by side (issue 22): `specstack serve --replicas` through Ray Serve's proxy on this machine,
against one replica and against one server without Ray; and what the proxy costs a request.

The configurations, each started as a process on 127.0.0.1 and driven by bench-serve's load (the same
prompts and levels for all; greedy, ignore_eos: exactly --max-tokens tokens a request):
- `serve --threads 1` (no Ray): one engine, the baseline of the proxy's cost;
- `serve --replicas 1 --threads 1`: the same engine behind Ray Serve's proxy;
- `serve --replicas 2 --threads 1`: two engines, each pinned to a core of its own;
- `serve --replicas 1 --threads 2`: one engine on both cores (what the cores give without replicas).
Every server gets --max-batch the largest level, as serve_peers.py gives ours.

The proxy's cost: after the load, --probes requests one after another (max_tokens 1, whole responses)
to each server; the median time of one through `--replicas 1 --threads 1` minus the median of the same
engine without Ray is the proxy's overhead per request.

Output (--out DIR, default bench_out/serve_replicas-TIME): serve_replicas.json (settings, machine, per
configuration its command, level summaries, probe latencies; ratios to one replica with one thread),
serve_replicas.md (the table, the ratios, the proxy's cost), serve_replicas.png, each server's log.

    python benchmarks/serve_replicas.py --concurrency 1,4,8,16 --limit 12 --max-tokens 128 [--probes 50]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_peers, a script beside this one
from serve_peers import (  # noqa: E402
    ServerConfig,
    add_load_args,
    header,
    level_tables,
    load_plan,
    measure,
    ratio_table,
    ratios,
)

from specstack.bench import serve_report  # noqa: E402
from specstack.errors import SpecstackError  # noqa: E402
from specstack.files import atomic_write_text  # noqa: E402

BASELINE = "1 replica x 1 thread"  # the row every ratio divides by
DIRECT = "no Ray, 1 thread"  # the same engine without the proxy: the proxy's cost is the difference


def configs(args: argparse.Namespace, top: int) -> list[ServerConfig]:
    ours = [sys.executable, "-m", "specstack.cli", "serve", "--model", args.model, "--host", "127.0.0.1",
            "--max-batch", str(top), "--max-queue", str(args.max_queue), "--method", args.method]

    def server(*flags: str):
        return lambda port, _slots: [*ours, *flags, "--port", str(port)]

    return [ServerConfig(DIRECT, server("--threads", "1")),
            ServerConfig(BASELINE, server("--replicas", "1", "--threads", "1")),
            ServerConfig("2 replicas x 1 thread", server("--replicas", "2", "--threads", "1")),
            ServerConfig("1 replica x 2 threads", server("--replicas", "1", "--threads", "2"))]


def server_e2e(root: str) -> tuple[float, float]:
    """The server's own e2e latency histogram: (sum of seconds, count), from /metrics."""
    total = count = 0.0
    for fam in text_string_to_metric_families(httpx.get(root + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "specstack:e2e_request_latency_seconds_sum":
                total += s.value
            elif s.name == "specstack:e2e_request_latency_seconds_count":
                count += s.value
    return total, count


def probe(count: int):
    """`after` for measure: `count` one-token requests in a row; their latencies in ms, and the mean the
    server itself measured for them (arrival to last token), so that the client's time splits into the
    engine's and the way there and back."""
    def run(root: str) -> dict[str, Any]:
        model = httpx.get(root + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": "def add(a, b):", "max_tokens": 1, "temperature": 0}
        ms = []
        with httpx.Client(timeout=60) as http:
            for _ in range(3):  # warm the connection and the path
                http.post(root + "/v1/completions", json=body).raise_for_status()
            time.sleep(1.5)  # replicas publish their metrics every second
            before = server_e2e(root)
            for _ in range(count):
                t0 = time.perf_counter()
                http.post(root + "/v1/completions", json=body).raise_for_status()
                ms.append((time.perf_counter() - t0) * 1e3)
            time.sleep(1.5)
            after = server_e2e(root)
        served = (after[0] - before[0]) / max(after[1] - before[1], 1) * 1e3
        return {"probe_ms": ms, "probe_p50_ms": statistics.median(ms), "probe_mean_ms": statistics.mean(ms),
                "probe_server_mean_ms": served}
    return run


def render_md(doc: dict[str, Any]) -> str:
    lines = header(doc, "Replicas side by side", f"method {doc['settings']['method']}") + level_tables(doc["servers"])
    if any(v["levels"] for v in doc["servers"].values()):  # not with --probe-only
        levels = [lv["level"] for lv in doc["servers"][BASELINE]["levels"]]
        lines += ratio_table(doc["ratios"], levels, BASELINE)
    s = doc["settings"]
    p = doc["proxy"]
    lines += ["", f"One-token requests one after another ({s['probes']} each), ms:", "",
              "| server | client p50 | client mean | server's own mean | the way there and back |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {k} | {v['probe_p50_ms']:.1f} | {v['probe_mean_ms']:.1f} | {v['probe_server_mean_ms']:.1f} | "
              f"{v['probe_mean_ms'] - v['probe_server_mean_ms']:.1f} |" for k, v in doc["servers"].items()]
    lines += ["", f"The proxy's cost per request ({BASELINE} minus {DIRECT}, client p50): {p['overhead_ms']:.1f} ms; "
              f"of it the way there and back: {p['transport_ms']:.1f} ms", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_args(ap, "1,4,8,16")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--probes", type=int, default=50, help="one-token requests per server for the proxy's cost")
    ap.add_argument("--probe-only", action="store_true", help="no load levels: the proxy's cost alone")
    args = ap.parse_args(argv)
    try:
        return run(args)
    except SpecstackError as e:
        print(f"serve_replicas: error: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    out, prompts, levels, settings = load_plan(args, "serve_replicas")
    if args.probe_only:
        levels = []
    servers = configs(args, max(args.concurrency))
    out.mkdir(parents=True, exist_ok=True)
    for config in servers:
        measure(config, levels, prompts, settings, max(args.concurrency), out, args.startup_timeout,
                after=probe(args.probes))
    by = {s.label: s for s in servers}
    overhead = by[BASELINE].probes["probe_p50_ms"] - by[DIRECT].probes["probe_p50_ms"]
    transport = [by[k].probes["probe_mean_ms"] - by[k].probes["probe_server_mean_ms"] for k in (BASELINE, DIRECT)]
    doc = {"command": " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]), "machine": serve_report.machine(),
           "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                        "out": str(out)},
           "servers": {s.label: {"commands": s.commands, "levels": s.levels, "rows": s.rows, **s.probes}
                       for s in servers},
           "ratios": ratios(servers, BASELINE), "proxy": {"overhead_ms": overhead, "transport_ms": transport[0] - transport[1]}}
    atomic_write_text(out / "serve_replicas.json", json.dumps(doc, indent=1) + "\n")
    md = render_md(doc)
    atomic_write_text(out / "serve_replicas.md", md)
    if levels:
        serve_report.plot_levels({s.label: s.levels for s in servers}, out / "serve_replicas.png",
                                 "Replicas behind Ray Serve's proxy, one machine")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
