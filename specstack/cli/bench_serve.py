"""`specstack bench-serve`: load an OpenAI-compatible server (ours, vLLM, llama.cpp's llama-server) with
streamed requests, level after level, and report throughput and latency per level.

    specstack bench-serve --url http://127.0.0.1:8000/v1 [--model NAME] [--api-key KEY]
        [--prompts humaneval|sharegpt|FILE.jsonl] [--limit N] [--endpoint completions|chat]
        [--concurrency 1,2,4,8,16 | --rate R1,R2] [--requests N] [--max-tokens 128] [--temperature 0]
        [--ignore-eos] [--disconnect FRAC] [--seed S] [--timeout S] [--label NAME] [--out DIR]
        [--extra-body JSON]

Protocol: the model is --model, else the first id of GET URL/models; one short check request (not
measured) makes sure the server answers the endpoint; then each level in turn. A concurrency level C
keeps C requests in flight (each client sends its next request when its last one ends); a rate level R
sends requests at Poisson arrival times of R per second (seeded), however many are in flight. A level
sends --requests requests (default: the prompts once, and at least 4 per client: max(prompts, 4 x C)),
taking the prompts in order and cycling. Every request streams (with usage), greedy unless
--temperature, --max-tokens tokens at most (exactly, with --ignore-eos, for servers that read it: vLLM,
llama-server, ours). Prompts are sent as text: a chat prompt (sharegpt) to /chat/completions as one
user message, any other to /completions, unless --endpoint sends all to one.

Per level: requests ok / errors / cancelled, wall time, total output tokens/s (ok requests' tokens over
the level's wall time), requests/s, TTFT, inter-token latency (per streamed chunk: a speculative server
may send several tokens in one), end-to-end latency and time per output token (p50/p99, ms), tokens per
chunk; at temperature 0 the prompts whose ok requests got different texts (each should get one). The
server's resident memory before and after, where URL/../metrics serves process_resident_memory_bytes.
--disconnect FRAC: that share of each level's requests (chosen by --seed) closes its stream after 2
chunks, a client going away; they count as cancelled, not errors, and their tokens are not counted.

Output (--out DIR, default bench_out/serve-TIME): serve.json (command, machine, settings, per-level
summary, every request), serve.md (the table, also printed), serve.png (tokens/s and ITL against the
load); a progress line per level on stderr.

That is the default workload, `--workload load`. The prefix-cache workloads (issue 33) send what a prefix
cache saves work on and report time to first token and the cached tokens the server says it reused:

    --workload chat [--conversations 10] [--turns 5] [--concurrency 4] [--turn-chars 1000] [--system TEXT]
    --workload editor [--source inspect] [--requests 40] [--window-chars 6000] [--step-chars 48] [--anchor-chars 1024]
    --workload prefix-probe [--repeats 3] [--probe-chars 7400] [--tail-chars 200] [--n 8] [--n-chars 3900]

chat: ShareGPT conversations, turn t sending the whole history (the server's own earlier answers in it)
to /chat/completions, C conversations in flight; TTFT p50/p90 per turn number and over all, the wall
time. editor: one standard-library file (inspect.getsource), short completions at a cursor moving
forward, each prompt ~--window-chars before the cursor; TTFT and latency p50/p90. prefix-probe: (a) a
~1,900-token prompt cold, then it plus a ~50-token tail; (b) n=N samples of a ~1,000-token prompt against
n=1 of the same text on a fresh prefix; the TTFTs and their ratios. --max-tokens defaults to 32, 16 and 8;
a flag of another workload is an error. Output: WORKLOAD.json (every request's row) and WORKLOAD.md (the
table, also printed) in --out (default bench_out/serve-WORKLOAD-TIME); progress lines on stderr.

The soak (issue 54) asks whether the server's memory stays flat over many requests:

    --workload soak [--requests 2000] [--concurrency 8] [--sample-every N] [--long-share 0.2]
        [--cancel-share 0.1] [--bad-share 0.05] [--whole-share 0.2] [--long-chars 6000] [--seed S]

to /completions, C in flight: short prompts (HumanEval's, or --prompts [--limit], cycling) and long ones (--long-chars windows of
standard-library files, drawn at random), streamed, whole, closed by the client after 2 chunks, or a bad
body the server must refuse with a 4xx (not JSON, max_tokens -1, an unknown model, no prompt, a
temperature that is not a number); --max-tokens defaults to 16. The server's resident memory and its
prefix cache's bytes, pool and budget are read from URL/../metrics at the start and after every N
requests. Output: soak.json (samples, every request's outcome, the verdict), soak.md (printed) and
soak.png (memory against requests); the verdict is the RSS slope in bytes a request over the last half
and past the first 2,000 requests (goal: at most 5 KB), the cache's pool against its budget, and any
request that ended otherwise than expected.
"""
from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from specstack.cli.bench_serve_workloads import MAX_TOKENS, add_workload_args, check_flags, run_workload
from specstack.cli.common import add_checked, command_line, sizes
from specstack.errors import SpecstackError
from specstack.validate import MAX_BATCH_SIZE, MAX_COUNT, bounded_float, fail, floats, ints, new_tokens, seed, shown
from specstack.validate import temperature as temperature_rule

DEFAULT_LIMIT = 12
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16)
MAX_RATE = 10_000.0  # requests/s: a sanity cap, far above what one client process can send


def rates(name: str, value: object) -> list[float]:
    """--rate: comma-separated positive requests/s, each once, in order."""
    text = str(value)
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        fail(name, f"must be comma-separated requests/s, got {shown(text)}")
    return list(dict.fromkeys(bounded_float(name, x, 0.0, MAX_RATE, low_open=True) for x in items))


def base_url(text: str) -> str:
    """--url: http(s)://host[:port][/path], no query; returned without a trailing slash."""
    try:
        parts = urlsplit(text.strip())
        parts.port  # noqa: B018 (a bad port raises here)
    except ValueError as e:
        raise SpecstackError(f"--url {shown(text)}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SpecstackError(f"--url must be http://HOST[:PORT]/v1 (the API base), got {shown(text)}")
    if parts.query or parts.fragment:
        raise SpecstackError(f"--url must be the API base without a query, got {shown(text)}")
    return text.strip().rstrip("/")


def extra_body(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise SpecstackError(f"--extra-body is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise SpecstackError(f"--extra-body must be a JSON object, got {shown(text)}")
    return obj


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("bench-serve", help="load an OpenAI-compatible server and report throughput and latency",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--url", required=True, help="the API base, e.g. http://127.0.0.1:8000/v1")
    g.add_argument("--model", default=None, help="model name to request (default: the first of GET URL/models)")
    g.add_argument("--api-key", default=None, metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--label", default=None, metavar="NAME", help="the server's name in the report (default: the model)")
    g = p.add_argument_group("load")
    g.add_argument("--prompts", default=None, metavar="SET",
                   help="humaneval (default), sharegpt, or a JSONL file (task_id, prompt[, chat])")
    add_checked(g, "--limit", ints(1, MAX_COUNT), default=None, metavar="N",
                help=f"the first N prompts (default {DEFAULT_LIMIT})")
    g.add_argument("--endpoint", choices=("completions", "chat"), default=None,
                   help="send every prompt to this endpoint (default: chat prompts to chat, others to completions)")
    levels = g.add_mutually_exclusive_group()
    add_checked(levels, "--concurrency", sizes(MAX_BATCH_SIZE, "1,2,4,8,16"), default=None, metavar="C1,C2,...",
                help="closed-loop levels: requests in flight (default 1,2,4,8,16); --workload chat: conversations "
                     "in flight (default 4)")
    add_checked(levels, "--rate", rates, default=None, metavar="R1,R2,...",
                help="open-loop levels: requests/s, Poisson arrivals (seeded)")
    add_checked(g, "--requests", ints(1, MAX_COUNT), default=None, metavar="N",
                help="requests per level (default: max(prompts, 4 x C), 4 x R for a rate); --workload editor: "
                     "completions (default 40)")
    add_checked(g, "--disconnect", floats(0.0, 1.0), default=None, metavar="FRAC",
                help="share of each level's requests that close their stream after 2 chunks (default 0)")
    add_checked(g, "--timeout", floats(0.0, low_open=True), default=600.0, metavar="S",
                help="seconds per request, to the end of its stream (default 600)")
    g = p.add_argument_group("generation")
    add_checked(g, "--max-tokens", new_tokens, default=None, metavar="N",
                help="max_tokens of each request (default 128; chat 32, editor 16, prefix-probe 8)")
    add_checked(g, "--temperature", temperature_rule, default=0.0, help="0 (default) = greedy")
    g.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos: every request makes exactly --max-tokens tokens (equal work across servers)")
    add_checked(g, "--seed", seed, default=None, help="seed of the disconnect choice and the arrival times (default 0)")
    g.add_argument("--extra-body", default=None, metavar="JSON",
                   help='a JSON object merged into every request body, e.g. \'{"speculation": {"method": "ar"}}\'')
    p.add_argument("--out", type=Path, default=None, metavar="DIR", help="output folder (default bench_out/serve-TIME)")
    add_workload_args(p)
    p.set_defaults(func=cmd_bench_serve)


def redacted_command(api_key: str | None) -> str:
    """This run's command line without the API key (serve.json is meant to be shared)."""
    text = command_line("bench-serve")
    return text.replace(shlex.quote(api_key), "'***'") if api_key else text


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from specstack.bench.datasets import iter_prompts
    from specstack.files import check_writable_dir

    # 1. Every check of the input, before any request is sent.
    check_flags(args)
    url = base_url(args.url)
    body = extra_body(args.extra_body)
    if args.workload != "load":
        return run_workload(args, url, body, redacted_command(args.api_key))
    args.prompts = args.prompts or "humaneval"
    prompts = list(itertools.islice(iter_prompts(args.prompts), args.limit or DEFAULT_LIMIT))
    empty = next((p.task_id for p in prompts if not p.text.strip()), None)
    if empty is not None:
        raise SpecstackError(f"task {empty}: the prompt is empty")
    if not prompts:
        raise SpecstackError(f"no prompts in {args.prompts}")
    out = args.out or Path("bench_out") / time.strftime("serve-%Y%m%d-%H%M%S")
    check_writable_dir(out, "--out")

    from specstack.bench import serve_load, serve_report  # httpx, matplotlib: only once the input is good
    from specstack.bench.serve_settings import Level, LoadSettings

    if args.rate:
        levels = [Level("rate", r) for r in args.rate]
    else:
        levels = [Level("concurrency", c) for c in (args.concurrency or DEFAULT_CONCURRENCY)]
    settings = LoadSettings(
        endpoint=args.endpoint, max_tokens=args.max_tokens or MAX_TOKENS["load"], temperature=args.temperature,
        ignore_eos=args.ignore_eos, disconnect=args.disconnect or 0.0, seed=args.seed or 0, timeout=args.timeout,
        requests=args.requests, extra_body=body)

    # 2. The run: a progress line per level on stderr.
    def progress(lr: Any) -> None:
        print(serve_load.progress_line(lr), file=sys.stderr, flush=True)

    result = serve_load.run(url, args.model, args.api_key, settings, levels, prompts, progress)
    label = args.label or result.target.model
    doc = serve_report.run_document(result, redacted_command(args.api_key), label, args.prompts)

    # 3. The report: the files, and the table on stdout.
    written = serve_report.write_run(out, doc)
    print(serve_report.level_table(doc["levels"]))
    print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 0
