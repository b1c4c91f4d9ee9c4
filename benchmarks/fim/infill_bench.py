"""Issue 34's editor workload against one server's `/infill` (ours or llama-server): held-out code, a function's
body cut out, the server asked to fill it back.

Cases come from installed packages that are in no training or tuning set of ours (the trigram and the
drafts were built from the standard library: docs/NGRAM.md): by default `httpx` and `starlette`, both
installed with specstack. From each file (sorted, deterministic) the function whose body starts nearest
the file's middle, with a body of 3-24 lines: prefix = the file above the body's first line (its last
PREFIX_CHARS, from a line start), `prompt` = that line's indentation (the cursor sits where the code
starts, as llama.vscode sends the typed part of the line), suffix = the file below the function (its first
SUFFIX_CHARS). Both stay under llama-server's own FIM limits (prefix 3/4, suffix 1/4 of its 2,048-token
batch), so both servers read the same prompt.

Each case is sent twice in a row, greedy, `n_predict` 64, `n_indent` = the body's indentation (the end of
the block stops it, on both servers): `cold` (the file is new to the server) and `cached` (sent again, as
an editor resends at every pause). `--ar` adds a third request to our server with speculation off, for the
exact-match column and the speed of plain decoding. Every request's row goes to OUT (JSON lines): the
client's latency until the answer returned, the server's own `timings`, and on ours `speculation` (τ and
tokens by origin).

    python benchmarks/fim/infill_bench.py --url http://127.0.0.1:PORT --label NAME --out rows.jsonl [--ar]
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

PREFIX_CHARS = 4000  # ~1,000-1,200 tokens of Python
SUFFIX_CHARS = 1200  # ~300-400 tokens
N_PREDICT = 64


@dataclass(frozen=True)
class Case:
    source: str  # package/path.py:function
    prefix: str
    prompt: str  # the indentation of the body's first line
    suffix: str
    middle: str  # the body that was cut out (what the file had)

    def body(self, **extra: object) -> dict[str, object]:
        return {"input_prefix": self.prefix, "input_suffix": self.suffix, "prompt": self.prompt, "input_extra": [],
                "n_predict": N_PREDICT, "n_indent": len(self.prompt), "temperature": 0, "top_k": 1,
                "samplers": ["top_k", "temperature"], "cache_prompt": True, "stream": False, **extra}


def package_files(name: str) -> list[Path]:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name} is not installed")
    root = Path(list(spec.submodule_search_locations)[0])
    return sorted(p for p in root.rglob("*.py") if "test" not in p.parts)


def cut(path: Path, package: str) -> Case | None:
    text = path.read_text(encoding="utf-8")
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    best: tuple[int, Case] | None = None
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.end_lineno is None:
            continue
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
            body = body[1:]  # the docstring stays in the prefix
        if not body:
            continue
        first, last = body[0].lineno, node.end_lineno
        if not 3 <= last - first + 1 <= 24:
            continue
        indent = lines[first - 1][: len(lines[first - 1]) - len(lines[first - 1].lstrip())]
        if not indent:
            continue
        at, end = starts[first - 1], starts[last]
        middle = text[at + len(indent) : end].rstrip("\n")
        prefix = text[:at]
        if len(prefix) > PREFIX_CHARS:
            cut_at = prefix.find("\n", len(prefix) - PREFIX_CHARS) + 1
            prefix = prefix[cut_at:]
        suffix = text[at + len(indent) + len(middle) :][:SUFFIX_CHARS]
        distance = abs(first - len(lines) // 2)
        case = Case(f"{package}/{path.name}:{node.name}", prefix, indent, suffix, middle)
        if best is None or distance < best[0]:
            best = (distance, case)
    return best[1] if best else None


def cases(packages: list[str], count: int) -> list[Case]:
    out: list[Case] = []
    for package in packages:
        for path in package_files(package):
            case = cut(path, package)
            if case is not None and len(case.prefix) > 600:
                out.append(case)
    step = max(1, len(out) // count)  # spread over the files
    return out[::step][:count]


def ask(url: str, body: dict[str, object]) -> tuple[dict[str, object], float]:
    start = time.perf_counter()
    r = httpx.post(url + "/infill", json=body, timeout=600)
    seconds = time.perf_counter() - start
    r.raise_for_status()
    return r.json(), seconds


def origin_counts(url: str) -> dict[str, float]:
    """Our server's generated tokens by origin so far (Prometheus counters)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        if line.startswith("specstack:generation_tokens_by_origin_total{"):
            origin = line.split('origin="')[1].split('"')[0]
            out[origin] = out.get(origin, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def plain(url: str, case: Case) -> dict[str, object]:
    """The same prefix as a plain completion (no suffix), 64 tokens: τ and tokens by origin from the
    server's counters around it (one request at a time)."""
    before = origin_counts(url)
    start = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"prompt": case.prefix + case.prompt, "max_tokens": N_PREDICT,
                                                   "temperature": 0}, timeout=600)
    seconds = time.perf_counter() - start
    r.raise_for_status()
    after = origin_counts(url)
    origins = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if after.get(k, 0.0) > before.get(k, 0.0)}
    tokens = r.json()["usage"]["completion_tokens"]
    return {"latency_s": seconds, "tokens": tokens, "content": r.json()["choices"][0]["text"],
            "speculation": {"origins": origins, "tau": tokens / max(1.0, origins.get("target", 0.0))}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--label", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cases", type=int, default=24)
    p.add_argument("--packages", default="httpx,starlette")
    p.add_argument("--ar", action="store_true", help="also each case with speculation off (our server only)")
    p.add_argument("--plain", action="store_true",
                   help="also each case's prefix as a plain completion, for τ by origin (our server only)")
    args = p.parse_args()
    todo = cases(args.packages.split(","), args.cases)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for i, case in enumerate(todo):
            kinds = [("cold", {}), ("cached", {})] + ([("ar", {"speculation": {"method": "ar"}})] if args.ar else [])
            for kind, extra in kinds:
                body, seconds = ask(args.url, case.body(**extra))
                timings = body.get("timings", {})
                row = {"label": args.label, "case": i, "source": case.source, "kind": kind, "latency_s": seconds,
                       "content": body["content"], "stop_type": body.get("stop_type"),
                       "tokens": timings.get("predicted_n"), "predicted_ms": timings.get("predicted_ms"),
                       "prompt_n": timings.get("prompt_n"), "cache_n": timings.get("cache_n"),
                       "prompt_ms": timings.get("prompt_ms"), "speculation": body.get("speculation"),
                       "exact_file": body["content"].rstrip() == case.middle.rstrip()}
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(f"{args.label} {i + 1}/{len(todo)} {kind}: {seconds * 1e3:.0f} ms, {row['tokens']} tokens "
                      f"({row['prompt_n']} read, {row['cache_n']} cached) {case.source}", file=sys.stderr, flush=True)
            if args.plain:
                row = {"label": args.label, "case": i, "source": case.source, "kind": "plain", **plain(args.url, case)}
                f.write(json.dumps(row) + "\n")
                f.flush()
    (args.out.parent / "cases.json").write_text(json.dumps([asdict(c) for c in todo], indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
