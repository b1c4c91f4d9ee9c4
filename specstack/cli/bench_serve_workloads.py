"""`specstack bench-serve --workload chat | editor | prefix-probe | soak`: the prefix-cache workloads (issue 33)
and the memory soak (issue 54),
their flags and their run. What they do is told once, in bench_serve.py's docstring (the command's
--help); the workloads themselves are specstack/bench/serve_workloads.py (what is sent),
serve_sessions.py (sending it), serve_workload_stats.py and serve_workload_report.py (the numbers and
the files). Like every command module, this one imports its logic inside the function that runs it.
"""
from __future__ import annotations

import argparse
import itertools
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specstack.cli.common import add_checked
from specstack.errors import SpecstackError
from specstack.validate import MAX_COUNT, floats, ints

WORKLOADS = ("load", "chat", "editor", "prefix-probe", "soak")
MAX_TOKENS = {"load": 128, "chat": 32, "editor": 16, "prefix-probe": 8, "soak": 16}
MAX_CHARS = 10_000_000  # a sanity cap on every character count
MAX_TURNS = 1000
MAX_N = 128


@dataclass(frozen=True)
class Flag:
    """A flag that only some workloads read: given with another, it is an error (it would do nothing)."""
    dest: str
    workloads: tuple[str, ...]

    @property
    def name(self) -> str:
        return "--" + self.dest.replace("_", "-")


# every flag that is not for all workloads; each defaults to None, so "given" is "not None"
FLAGS = (Flag("prompts", ("load", "soak")), Flag("limit", ("load", "soak")), Flag("endpoint", ("load",)), Flag("rate", ("load",)),
         Flag("disconnect", ("load",)), Flag("seed", ("load", "soak")), Flag("concurrency", ("load", "chat", "soak")),
         Flag("requests", ("load", "editor", "soak")),
         Flag("conversations", ("chat",)), Flag("turns", ("chat",)), Flag("turn_chars", ("chat",)),
         Flag("system", ("chat",)),
         Flag("source", ("editor",)), Flag("window_chars", ("editor",)), Flag("step_chars", ("editor",)),
         Flag("anchor_chars", ("editor",)),
         Flag("repeats", ("prefix-probe",)), Flag("probe_chars", ("prefix-probe",)), Flag("tail_chars", ("prefix-probe",)),
         Flag("n", ("prefix-probe",)), Flag("n_chars", ("prefix-probe",)),
         Flag("sample_every", ("soak",)), Flag("long_share", ("soak",)), Flag("cancel_share", ("soak",)),
         Flag("bad_share", ("soak",)), Flag("whole_share", ("soak",)), Flag("long_chars", ("soak",)))


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=WORKLOADS, default="load",
                   help="load (default): levels of concurrency or rate over a prompt set; chat, editor, prefix-probe: "
                        "the prefix-cache workloads; soak: the server's memory over many mixed requests (see the "
                        "description above)")
    g = p.add_argument_group("--workload chat")
    add_checked(g, "--conversations", ints(1, MAX_COUNT), default=None, metavar="N", help="ShareGPT conversations (default 10)")
    add_checked(g, "--turns", ints(1, MAX_TURNS), default=None, metavar="T", help="user turns of each (default 5)")
    add_checked(g, "--turn-chars", ints(1, MAX_CHARS), default=None, metavar="N",
                help="skip conversations with a longer user turn among their first T (default 1000)")
    g.add_argument("--system", default=None, metavar="TEXT", help="a system message first in every conversation")
    g = p.add_argument_group("--workload editor")
    g.add_argument("--source", default=None, metavar="MODULE",
                   help="the standard-library module whose source is the file (default inspect)")
    add_checked(g, "--window-chars", ints(1, MAX_CHARS), default=None, metavar="N",
                help="characters before the cursor in each prompt (default 6000, ~1,500 tokens)")
    add_checked(g, "--step-chars", ints(1, MAX_CHARS), default=None, metavar="N",
                help="the cursor's move between requests (default 48)")
    add_checked(g, "--anchor-chars", ints(0, MAX_CHARS), default=None, metavar="N",
                help="the window's start moves in jumps of N characters, keeping the prefix of the last requests "
                     "(default 1024); 0: it moves with the cursor, no two prompts share a prefix")
    g = p.add_argument_group("--workload prefix-probe")
    add_checked(g, "--repeats", ints(1, 8), default=None, metavar="R", help="probes, each on files of its own (default 3)")
    add_checked(g, "--probe-chars", ints(1, MAX_CHARS), default=None, metavar="N",
                help="(a)'s prompt in characters (default 7400, ~1,900 tokens)")
    add_checked(g, "--tail-chars", ints(1, MAX_CHARS), default=None, metavar="N",
                help="(a)'s new tail (default 200, ~50 tokens)")
    add_checked(g, "--n", ints(2, MAX_N), default=None, metavar="N", help="(b)'s samples of one prompt (default 8)")
    add_checked(g, "--n-chars", ints(1, MAX_CHARS), default=None, metavar="N",
                help="(b)'s prompt in characters (default 3900, ~1,000 tokens)")
    g = p.add_argument_group("--workload soak")
    add_checked(g, "--sample-every", ints(1, MAX_COUNT), default=None, metavar="N",
                help="read the server's memory after every N requests ended (default requests / 50)")
    for name, default, what in (("--long-share", 0.2, "a long prompt"), ("--cancel-share", 0.1,
                                "closed by the client after 2 chunks"), ("--bad-share", 0.05, "a bad body (a 4xx)"),
                                ("--whole-share", 0.2, "not streamed")):
        add_checked(g, name, floats(0.0, 1.0), default=None, metavar="FRAC", help=f"share of requests: {what} (default {default})")
    add_checked(g, "--long-chars", ints(1, MAX_CHARS), default=None, metavar="N",
                help="a long prompt's characters (default 6000, ~1,500 tokens)")


def check_flags(args: argparse.Namespace) -> None:
    """Every flag given belongs to the workload chosen (before anything is read or sent)."""
    for f in FLAGS:
        if getattr(args, f.dest) is not None and args.workload not in f.workloads:
            raise SpecstackError(f"{f.name} does not apply to --workload {args.workload} "
                                 f"(it is for {' and '.join(f.workloads)})")
    if args.workload == "chat" and args.concurrency is not None and len(args.concurrency) != 1:
        raise SpecstackError("--workload chat takes one --concurrency (conversations in flight), "
                             f"got {','.join(map(str, args.concurrency))}")
    if args.system is not None and not args.system.strip():
        raise SpecstackError("--system is empty")
    if args.workload == "soak":
        if args.concurrency is not None and len(args.concurrency) != 1:
            raise SpecstackError("--workload soak takes one --concurrency (requests in flight), "
                                 f"got {','.join(map(str, args.concurrency))}")
        shares = sum(getattr(args, k) or 0.0 for k in ("cancel_share", "bad_share", "whole_share"))
        if shares > 1.0:
            raise SpecstackError(f"--cancel-share, --bad-share and --whole-share add up to {shares:g}, over 1")


def _given(args: argparse.Namespace, **defaults: Any) -> dict[str, Any]:
    """The workload settings' fields: each flag's value where given, else its default."""
    return {k: v if getattr(args, k) is None else getattr(args, k) for k, v in defaults.items()}


@dataclass
class Prepared:
    """A workload's settings, what it will send (conversations, windows or probe prompts), and what the
    report should record about how it was made."""
    settings: Any
    plan: list[Any]
    notes: dict[str, Any] = field(default_factory=dict)


def prepare(args: argparse.Namespace) -> Prepared:
    """Every source read and checked here, before any request."""
    from specstack.bench import serve_sources as src
    from specstack.bench import serve_workloads as wl

    if args.workload == "chat":
        cs = wl.ChatSettings(**_given(args, conversations=10, turns=5, turn_chars=1000, system=None),
                             concurrency=args.concurrency[0] if args.concurrency else 4)
        convs = list(itertools.islice(src.iter_conversations(cs.turns, cs.turn_chars), cs.conversations))
        if len(convs) < cs.conversations:
            raise SpecstackError(f"ShareGPT has only {len(convs)} conversations with {cs.turns} user turns of at most "
                                 f"{cs.turn_chars} characters; lower --conversations or --turns, or raise --turn-chars")
        return Prepared(cs, convs)
    if args.workload == "soak":
        from specstack.bench import serve_soak
        from specstack.bench.datasets import iter_prompts

        ss = serve_soak.SoakSettings(**_given(args, requests=2000, sample_every=None, long_share=0.2, cancel_share=0.1,
                                             bad_share=0.05, whole_share=0.2, long_chars=6000, seed=0),
                                     concurrency=args.concurrency[0] if args.concurrency else 8)
        shorts = [p.text for p in itertools.islice(iter_prompts(args.prompts or "humaneval"), args.limit)]
        if not shorts or not all(t.strip() for t in shorts):
            raise SpecstackError(f"the soak's short prompts ({args.prompts or 'humaneval'}) are missing or empty")
        longs = serve_soak.long_windows([(n, src.module_source(n)) for n in src.PROBE_MODULES], ss.long_chars)
        return Prepared(ss, serve_soak.soak_plan(ss, shorts, [t for _, t in longs]),
                        {"short_prompts": len(shorts), "long_windows": len(longs)})
    if args.workload == "editor":
        es = wl.EditorSettings(**_given(args, source=src.EDITOR_MODULE, requests=40, window_chars=6000, step_chars=48,
                                        anchor_chars=1024))
        return Prepared(es, wl.editor_windows(src.module_source(es.source), es))
    ps = wl.ProbeSettings(**_given(args, repeats=3, probe_chars=7400, tail_chars=200, n=8, n_chars=3900))
    names = src.PROBE_MODULES[:2 * ps.repeats]
    nonce = secrets.token_hex(8)  # a new one per run: its prompts are cold even on a server that saw the last run
    return Prepared(ps, wl.probe_prompts([(name, src.module_source(name)) for name in names], ps, nonce),
                    {"nonce": nonce})


def run_workload(args: argparse.Namespace, url: str, body: dict[str, Any], command: str) -> int:
    from specstack.files import check_writable_dir

    prep = prepare(args)
    out = args.out or Path("bench_out") / time.strftime(f"serve-{args.workload}-%Y%m%d-%H%M%S")
    check_writable_dir(out, "--out")

    from specstack.bench import serve_sessions, serve_workload_report  # httpx: only once the input is good
    from specstack.bench.serve_settings import LoadSettings

    s = LoadSettings(max_tokens=args.max_tokens or MAX_TOKENS[args.workload], temperature=args.temperature,
                     ignore_eos=args.ignore_eos, timeout=args.timeout, extra_body=body)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.workload == "soak":
        return _run_soak(args, url, prep, s, command, out, progress)
    if args.workload == "chat":
        result = serve_sessions.run_chat(url, args.model, args.api_key, s, prep.settings, prep.plan, progress)
    elif args.workload == "editor":
        result = serve_sessions.run_editor(url, args.model, args.api_key, s, prep.settings, prep.plan, progress)
    else:
        result = serve_sessions.run_probe(url, args.model, args.api_key, s, prep.settings, prep.plan, progress)
    result.notes.update(prep.notes)
    doc = serve_workload_report.workload_document(result, command, args.label or result.target.model)
    written = serve_workload_report.write_workload(out, doc)
    print(serve_workload_report.TABLES[args.workload](doc["summary"], None))
    print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 0


def _run_soak(args: argparse.Namespace, url: str, prep: Prepared, s: Any, command: str, out: Path,
              progress: Any) -> int:
    from specstack.bench import serve_soak, serve_soak_report

    def document(result: serve_soak.SoakResult) -> dict[str, Any]:
        result.notes.update(prep.notes)
        return serve_soak_report.soak_document(result, command, args.label or result.target.model)

    def on_sample(so_far: serve_soak.SoakResult) -> None:  # stopped early, the soak keeps its numbers
        serve_soak_report.write_soak(out, document(so_far), figure=False)

    doc = document(serve_soak.run(url, args.model, args.api_key, s, prep.settings, prep.plan, progress, on_sample))
    written = serve_soak_report.write_soak(out, doc)
    print(serve_soak_report.render_md(doc))
    print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 0
