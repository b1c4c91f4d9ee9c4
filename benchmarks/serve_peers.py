"""Serving side by side (issue 21): `specstack serve` against llama.cpp's `llama-server` on this machine,
the same GGUF, the same prompts, the same load, one server at a time.

For each server configuration the server is started as a subprocess on 127.0.0.1 (a free port), the
script waits for its /health to answer 200, runs bench-serve's load (specstack.bench.serve_load, in this
process) at each concurrency level, and stops it. The configurations:
- `specstack serve --method ar`, `--method auto`, and each --methods entry, with --max-batch the largest
  level (one process for all levels: its batch grows and shrinks with the load);
- `llama-server -t T --parallel P -c P*CTX --cont-batching --metrics --no-cache-prompt`, restarted for each
  level P (its slots are fixed at start), and the same with `--spec-type ngram-simple` (llama.cpp's
  prompt-lookup speculation, no draft model) when its --help lists it. A missing binary is skipped with a
  note;
- with --vllm: vLLM's CPU build (benchmarks/peers/vllm_cpu.sh: its own venv, its OpenAI server) on the
  model's bf16 checkpoint dequantized from the same GGUF (benchmarks/peers/export_checkpoint.py),
  `--max-num-seqs` the largest level (one process for all levels, continuous batching as ours), and the
  same with its n-gram speculation (--vllm-ngram) and with a draft model's checkpoint (--vllm-draft).
  Prefix caching off, as llama-server's prompt cache.
Prompt caching is off in every server by default (our --no-prefix-cache, llama-server's --no-cache-prompt,
vLLM's --no-enable-prefix-caching; --cache-prompt keeps ours and llama-server's on): the prompts cycle, and
a cached prefix would skip the prefill work the others do. Every server runs in a process group of its own
that dies with this script (bench/children.py).
Every request sends ignore_eos (exactly --max-tokens tokens each: equal work) at temperature 0. Each
server's resident memory is read from /proc after each level (VmRSS, and the peak VmHWM).

Output (--out DIR, default bench_out/serve_peers-TIME): serve_peers.json (settings, machine, per server
its command, per-level summaries, rows, memory; tokens/s ratios against llama-server at each level),
serve_peers.md (one table of every server's levels, then the ratios), serve_peers.png (tokens/s and
ITL against concurrency, one line per server), and each server's log.

    python benchmarks/serve_peers.py --concurrency 1,2,4,8,16 --limit 12 --max-tokens 128 \\
        [--methods "chain:k=4"] [--llama-server PATH] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from specstack.bench import children, serve_load, serve_report
from specstack.bench.datasets import iter_prompts
from specstack.bench.llama_build import binary_about
from specstack.bench.serve_settings import Level, LoadSettings
from specstack.bench.serve_stats import LevelResult, row_dict
from specstack.cli.common import sizes
from specstack.errors import SpecstackError
from specstack.files import atomic_write_text, cache_root, check_writable_dir
from specstack.models.registry import resolve
from specstack.validate import MAX_BATCH_SIZE

# where benchmarks/build_llama_cpp.sh puts it with its default DIR
LLAMA_SERVER = Path.home() / ".cache/specstack/llama_cpp/build/bin/llama-server"
BASELINE = "llama-server"  # the row every ratio divides by
VLLM_SCRIPT = Path(__file__).resolve().parent / "peers" / "vllm_cpu.sh"
VLLM_VENV = cache_root() / "venvs" / "vllm-cpu"  # vllm_cpu.sh's default


@dataclass
class ServerConfig:
    """One server to measure: `argv(port, slots)` starts it; per_level: restart it for every level."""
    label: str
    argv: Callable[[int, int], list[str]]
    per_level: bool = False
    levels: list[dict[str, Any]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    note: str | None = None
    probes: dict[str, Any] = field(default_factory=dict)  # what `after` measured while it was up
    about: str | None = None  # what runs it (a peer's binary or package, version, build)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_memory(pid: int) -> dict[str, int | None]:
    """VmRSS and VmHWM (the peak) of a process, in bytes, from /proc (None where unreadable)."""
    out: dict[str, int | None] = {"rss_bytes": None, "peak_rss_bytes": None}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out["rss_bytes" if key == "VmRSS" else "peak_rss_bytes"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def wait_healthy(proc: subprocess.Popen[bytes], root: str, log: Path, timeout: float) -> None:
    """Until GET /health answers 200 (503 while a server loads its model); the log's tail if it dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise SpecstackError(f"the server exited with status {proc.returncode} before it was ready:\n{tail}")
        try:
            if httpx.get(root + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SpecstackError(f"the server at {root} was not ready within {timeout:g} s (log: {log})")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to its whole group, then SIGKILL after 20 s: no server (or its workers) outlives the script."""
    children.stop(proc, grace_s=20)


def measure(config: ServerConfig, levels: Sequence[Level], prompts: list[Any],
            settings: LoadSettings, slots: int, out: Path, startup: float,
            after: Callable[[str], dict[str, Any]] | None = None) -> None:
    """Start the server, run `levels` against it, then `after(root)` if given, and stop it; the summaries,
    rows, memory and what `after` returned go to `config`."""
    port = free_port()
    argv = config.argv(port, slots)
    log = out / f"{config.label.replace(' ', '_')}-{slots}.log"
    config.commands.append(" ".join(argv))
    print(f"[{config.label}] starting: {' '.join(argv)}", file=sys.stderr, flush=True)
    with log.open("ab") as f:  # its own process group, gone with this script even when it is killed
        proc = children.start(argv, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log, startup)

        def progress(lr: LevelResult) -> None:
            config.memory.append({"level": lr.level.name, **proc_memory(proc.pid)})
            print(f"[{config.label}] {serve_load.progress_line(lr)}", file=sys.stderr, flush=True)

        if levels:
            result = serve_load.run(f"http://127.0.0.1:{port}/v1", None, None, settings, levels, prompts, progress)
            config.levels += [lr.summary(result.greedy) for lr in result.levels]
            config.rows += [row_dict(r) for r in result.rows()]
        if after is not None:
            config.probes.update(after(f"http://127.0.0.1:{port}"))
    finally:
        stop(proc)


def llama_spec_type(binary: Path, wanted: str) -> str | None:
    """`wanted` if this llama-server's --help lists it among --spec-type's choices, else None."""
    try:
        text = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = next((ln for ln in text.splitlines() if ln.lstrip().startswith("--spec-type")), "")
    return wanted if wanted in line.replace(",", " ").split() else None


def configs(args: argparse.Namespace, top: int) -> tuple[list[ServerConfig], list[str]]:
    """The servers to run, and notes on those skipped."""
    ours = [sys.executable, "-m", "specstack.cli", "serve", "--model", args.model, "--threads", str(args.threads),
            "--host", "127.0.0.1", "--max-batch", str(top), "--max-queue", str(args.max_queue),
            *([] if args.llama_cache_prompt else ["--no-prefix-cache"])]
    methods = list(dict.fromkeys(["ar", "auto", *[m for m in (args.methods or "").split(";") if m.strip()]]))
    out = [ServerConfig(f"specstack {m}", lambda port, _slots, m=m: [*ours, "--method", m, "--port", str(port)])
           for m in methods]
    notes = []
    binary = args.llama_server
    if not binary.is_file():
        notes.append(f"llama-server skipped: {binary} not found (benchmarks/build_llama_cpp.sh builds it)")
        return out, notes

    def llama(extra: list[str]) -> Callable[[int, int], list[str]]:
        def argv(port: int, slots: int) -> list[str]:
            cache = [] if args.llama_cache_prompt else ["--no-cache-prompt"]
            return [str(binary), "-m", str(args.gguf), "-t", str(args.threads), "--parallel", str(slots),
                    "-c", str(slots * args.ctx), "--cont-batching", "--metrics", *cache, "--host", "127.0.0.1",
                    "--port", str(port), *extra]
        return argv

    out.append(ServerConfig(BASELINE, llama([]), per_level=True, about=binary_about(binary)))
    spec = llama_spec_type(binary, args.llama_spec_type) if args.llama_spec_type != "none" else None
    if spec:
        out.append(ServerConfig(f"{BASELINE} {spec}", llama(["--spec-type", spec]), per_level=True,
                                about=binary_about(binary)))
    elif args.llama_spec_type != "none":
        notes.append(f"llama-server speculation skipped: its --help lists no --spec-type {args.llama_spec_type}")
    return out, notes


def vllm_configs(args: argparse.Namespace, top: int) -> tuple[list[ServerConfig], list[str]]:
    """vLLM's CPU server on the model's bf16 checkpoint, plain and (--vllm-ngram) with its n-gram speculation."""
    python = args.vllm / "bin" / "python"
    checkpoint = args.vllm_checkpoint or cache_root() / "hf" / args.model
    if not python.is_file():
        return [], [f"vLLM skipped: no venv at {args.vllm} ({VLLM_SCRIPT} setup makes it)"]
    if not (checkpoint / "config.json").is_file():
        return [], [f"vLLM skipped: no checkpoint at {checkpoint} (benchmarks/peers/export_checkpoint.py {args.model})"]
    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                             capture_output=True, text=True).stdout.strip() or "version unknown"
    about = f"vllm-cpu {version} in {args.vllm}, bf16 weights of {checkpoint}"

    def vllm(extra: list[str]) -> Callable[[int, int], list[str]]:
        def argv(port: int, slots: int) -> list[str]:
            return ["env", f"VLLM_CPU_VENV={args.vllm}", "bash", str(VLLM_SCRIPT), "serve", str(checkpoint), str(port), "--", "--max-num-seqs", str(slots),
                    "--no-enable-prefix-caching", *extra]
        return argv

    out = [ServerConfig("vllm", vllm([]), about=about)]
    if args.vllm_draft:
        draft = cache_root() / "hf" / args.vllm_draft
        if not (draft / "config.json").is_file():
            return out, [f"vLLM with a draft skipped: no checkpoint at {draft} (benchmarks/peers/export_checkpoint.py "
                         f"{args.vllm_draft})"]
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.vllm_draft_tokens}
        out.append(ServerConfig(f"vllm draft {args.vllm_draft}", vllm(["--speculative-config", json.dumps(spec)]),
                                about=f"{about}; draft: bf16 weights of {draft}"))
    if args.vllm_ngram:
        spec = {"method": "ngram", "num_speculative_tokens": args.vllm_ngram, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}
        out.append(ServerConfig("vllm ngram", vllm(["--speculative-config", json.dumps(spec)]), about=about))
    return out, []


def ratios(servers: Sequence[ServerConfig], baseline: str = BASELINE) -> dict[str, dict[str, float | None]]:
    """Per server and level: its tokens/s over the baseline's at that level (empty without the baseline)."""
    base = next((s for s in servers if s.label == baseline), None)
    if base is None:
        return {}
    ref = {lv["level"]: lv["tokens_per_s"] for lv in base.levels}
    return {s.label: {lv["level"]: (lv["tokens_per_s"] / ref[lv["level"]]
                                    if lv["tokens_per_s"] and ref.get(lv["level"]) else None) for lv in s.levels}
            for s in servers}


def header(doc: dict[str, Any], title: str, knob: str) -> list[str]:
    """A report's first lines: its title, command, machine and load settings (`knob`: what else it fixed)."""
    s = doc["settings"]
    return [f"# {title}", "", f"`{doc['command']}`", "",
            f"{doc['machine']['cpu']} ({doc['machine']['cores']} cores), {doc['machine']['date']}; prompts "
            f"{s['prompts']} (first {s['limit']}), max_tokens {s['max_tokens']} exactly (ignore_eos), temperature 0, "
            f"{knob}.", ""]


def level_tables(servers: dict[str, Any]) -> list[str]:
    """Every server's levels in one markdown table."""
    tables = [serve_report.level_table(v["levels"], k).splitlines() for k, v in servers.items() if v["levels"]]
    return tables[0][:2] + [row for t in tables for row in t[2:]] if tables else []


def ratio_table(ratios: dict[str, dict[str, float | None]], levels: Sequence[str], baseline: str) -> list[str]:
    labels = list(ratios)
    lines = ["", f"Total tokens/s over {baseline}'s at each level:", "",
             "| level | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for lv in levels:
        cells = [ratios[k].get(lv) for k in labels]
        lines.append(f"| {lv} | " + " | ".join("–" if c is None else f"{c:.2f}" for c in cells) + " |")
    return lines


def render_md(doc: dict[str, Any]) -> str:
    lines = header(doc, "Serving side by side", f"threads {doc['settings']['threads']}")
    lines += [f"- {label}: {v['about']}" for label, v in doc["servers"].items() if v.get("about")]
    lines += ([""] if lines[-1].startswith("- ") else []) + level_tables(doc["servers"])
    if doc["ratios"]:
        levels = [lv["level"] for lv in doc["servers"][BASELINE]["levels"]]
        lines += ratio_table(doc["ratios"], levels, BASELINE)
    for note in doc["notes"]:
        lines += ["", f"Note: {note}"]
    return "\n".join(lines) + "\n"


def add_load_args(ap: argparse.ArgumentParser, concurrency: str) -> None:
    """The load's flags, shared by the scripts that start servers and drive them (load_plan reads them)."""
    ap.add_argument("--concurrency", type=lambda t: sizes(MAX_BATCH_SIZE, concurrency)("--concurrency", t),
                    default=[int(c) for c in concurrency.split(",")])
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--requests", type=int, default=None, help="per level (default: max(prompts, 4 x C))")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-queue", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)


def load_plan(args: argparse.Namespace, name: str) -> tuple[Path, list[Any], list[Level],
                                                             LoadSettings]:
    """The output folder (checked), the prompts, the levels and the load's settings of add_load_args' flags."""
    out = args.out or Path("bench_out") / time.strftime(f"{name}-%Y%m%d-%H%M%S")
    check_writable_dir(out, "--out")
    prompts = [p for _, p in zip(range(args.limit), iter_prompts(args.prompts), strict=False)]
    levels = [Level("concurrency", c) for c in args.concurrency]
    settings = LoadSettings(max_tokens=args.max_tokens, ignore_eos=True, seed=args.seed,
                                       timeout=args.timeout, requests=args.requests)
    return out, prompts, levels, settings


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_args(ap, "1,2,4,8,16")
    ap.add_argument("--methods", default=None, help="more `specstack serve --method` values besides ar and auto, ';'-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m", help="our server's --model (the registry entry of the GGUF)")
    ap.add_argument("--gguf", type=Path, default=None,
                    help="llama-server's -m (default: the GGUF of --model's registry entry, the same weights)")
    ap.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    ap.add_argument("--llama-spec-type", default="ngram-simple", help="llama-server's draft-free speculation ('none': skip)")
    ap.add_argument("--cache-prompt", "--llama-cache-prompt", dest="llama_cache_prompt", action="store_true",
                    help="keep our prefix cache and llama-server's prompt cache on")
    ap.add_argument("--ctx", type=int, default=2048, help="llama-server's context per slot")
    ap.add_argument("--vllm", type=Path, nargs="?", const=VLLM_VENV, default=None,
                    help=f"also vLLM's CPU build, from this venv (default {VLLM_VENV}; {VLLM_SCRIPT} setup makes it)")
    ap.add_argument("--vllm-checkpoint", type=Path, default=None,
                    help="vLLM's model folder (default: the cache's hf/MODEL, from benchmarks/peers/export_checkpoint.py)")
    ap.add_argument("--vllm-ngram", type=int, default=0, help="also vLLM with n-gram speculation of this many tokens")
    ap.add_argument("--vllm-draft", default=None, help="also vLLM with this registry model's checkpoint as its draft")
    ap.add_argument("--vllm-draft-tokens", type=int, default=4, help="tokens vLLM's draft proposes a step")
    args = ap.parse_args(argv)
    try:
        return run(args)
    except SpecstackError as e:
        print(f"serve_peers: error: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    if args.gguf is None:
        source = resolve(args.model)
        if source.kind != "gguf":
            raise SpecstackError(f"--model {args.model} is not a GGUF: give llama-server's weights with --gguf")
        args.gguf = source.path
    out, prompts, levels, settings = load_plan(args, "serve_peers")
    servers, notes = configs(args, max(args.concurrency))
    if args.vllm is not None:
        more, why = vllm_configs(args, max(args.concurrency))
        servers, notes = servers + more, notes + why
    for note in notes:
        print(f"serve_peers: {note}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    for config in servers:
        if config.per_level:  # llama-server's slots are fixed at start: one process per level
            for level in levels:
                measure(config, [level], prompts, settings, int(level.value), out, args.startup_timeout)
        else:
            measure(config, levels, prompts, settings, max(args.concurrency), out, args.startup_timeout)

    doc = {"command": " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]), "machine": serve_report.machine(),
           "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                        "out": str(out)},
           "servers": {s.label: {"commands": s.commands, "about": s.about, "levels": s.levels, "memory": s.memory,
                                 "rows": s.rows}
                       for s in servers},
           "ratios": ratios(servers), "notes": notes}
    atomic_write_text(out / "serve_peers.json", json.dumps(doc, indent=1) + "\n")
    md = render_md(doc)
    atomic_write_text(out / "serve_peers.md", md)
    serve_report.plot_levels({s.label: s.levels for s in servers if s.levels}, out / "serve_peers.png",
                             "Serving throughput, same GGUF")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
