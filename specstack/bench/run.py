"""`specstack bench`: speculative methods against autoregressive decoding and the peers people would
otherwise use, on a prompt set, on this machine.

    specstack bench --model M --prompts SET [--limit N] --methods "ar;chain:k=4;staged:budget=36,depth=8;hf" \\
        [--max-new-tokens 128] [--temperature T --top-k K --top-p P --seed S] [--dtype D] \\
        [--draft X --draft-dtype D --ngram FILE] [--repeats R] [--threads N] --out DIR [--resume]
    specstack bench --compare DIR1 DIR2
    specstack bench --ratios DIR "ngram/llamacpp" "ar/hf"    (per-prompt ratios within one run)
    specstack bench --phases DIR                            (where each method's time goes, per step)

Methods are separated by ';' (commas separate one method's parameters; --methods may also be
repeated). Engine methods take their parameters (`chain:k=4`); every method also takes `dtype=F`, the
target's weight format for that method (default --dtype). Peers: `hf` (transformers `generate`), `hf-pld`
(prompt lookup, `tokens=10`), `hf-assisted` (our --draft as transformers' assistant model),
`llamacpp` and `llamacpp-pld` (llama-cpp-python on the same GGUF; prompt lookup `tokens=10`).
transformers runs bf16 or fp32 only: asked for int4/int8 it runs bf16 (noted in the summary).

Protocol: every model is loaded once and every drafter built once; one warm-up generation per method;
then for each prompt every method in turn (A B C A B C ...), --repeats times. Every method generates
exactly --max-new-tokens tokens (EOS does not stop it: equal work, fair tokens/s); wall time includes
the prefill; torch and llama.cpp use the same threads. Greedy runs mark each row `identical_to_ar`:
same tokens as our `ar` at that method's weight format (run once extra, untimed, when the list has no
such `ar`). Rows go to DIR/results.jsonl as they finish (--resume skips those already there); then
summary.json, summary.md, speedup_per_prompt.png, tau_hist.png and origins.html (report.py).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specstack.config import DEVICES, WEIGHT_FORMATS, SamplingParams
from specstack.errors import SpecstackError
from specstack.models.registry import DEFAULT_MODEL

PEER_PARAMS: dict[str, dict[str, int]] = {
    "hf": {}, "hf-pld": {"tokens": 10}, "hf-assisted": {}, "llamacpp": {}, "llamacpp-pld": {"tokens": 10},
}
WARMUP_TOKENS = 16
DEFAULT_DTYPE = {"cpu": "int4", "cuda": "bf16"}  # as `specstack generate`
RESUME_KEYS = ("model", "prompts", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "dtype", "device",
               "draft", "draft_dtype", "ngram")


# ---------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` on the CLI's subparsers; the parser's `func` is `run`."""
    from specstack.cli.app import _finite_float

    p = subparsers.add_parser("bench", help="benchmark methods and peers on a prompt set",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registry name, .gguf file or HF directory (default {DEFAULT_MODEL})")
    p.add_argument("--prompts", default=None, metavar="SET",
                   help="humaneval, sharegpt, or a JSONL file (task_id, prompt[, chat])")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="the first N prompts (default: all)")
    p.add_argument("--methods", action="append", default=[], metavar="LIST",
                   help="methods separated by ';', e.g. \"ar;chain:k=4;staged:budget=36,depth=8;hf;llamacpp\"")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="tokens per generation, exactly (default 128)")
    p.add_argument("--temperature", type=_finite_float, default=0.0, help="0 (default) = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=_finite_float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=WEIGHT_FORMATS, default=None,
                   help="target weight format (default int4 on cpu, bf16 on cuda)")
    p.add_argument("--device", choices=DEVICES, default="cpu")
    p.add_argument("--draft", default=None, metavar="MODEL",
                   help="draft model or self:N (default: the model's default)")
    p.add_argument("--draft-dtype", choices=WEIGHT_FORMATS, default=None,
                   help="default: int8 for a trained draft, int4 for a model or self:N draft")
    p.add_argument("--ngram", default=None, metavar="FILE", help="trigram file for ngram/staged")
    p.add_argument("--repeats", type=int, default=1, metavar="R", help="runs of every (prompt, method) (default 1)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="threads for torch and llama.cpp")
    p.add_argument("--out", type=Path, default=None, metavar="DIR", help="output folder")
    p.add_argument("--resume", action="store_true", help="continue DIR/results.jsonl, skipping rows already there")
    p.add_argument("--compare", nargs=2, type=Path, default=None, metavar=("DIR1", "DIR2"),
                   help="print the per-method change between two finished runs")
    p.add_argument("--ratios", nargs="+", default=None, metavar="DIR A/B",
                   help="print per-prompt tokens/s ratios of method A over method B in the run in DIR")
    p.add_argument("--phases", default=None, metavar="DIR",
                   help="print each method's milliseconds per step in each phase (draft, target, ...) of the run in DIR")
    p.set_defaults(func=run)
    return p


@dataclass(frozen=True)
class BenchMethod:
    label: str  # as written in --methods
    name: str
    dtype: str  # the target's weight format asked for
    params: dict[str, int] = field(default_factory=dict)
    spec: Any = None  # MethodSpec for engine methods, None for peers

    @property
    def peer(self) -> bool:
        return self.spec is None

    def key(self) -> tuple:
        return (self.name, tuple(sorted((self.spec.params if self.spec else self.params).items())), self.dtype)


def parse_methods(values: Sequence[str], default_dtype: str) -> list[BenchMethod]:
    from specstack.engine.methods import METHOD_PARAMS, parse_method

    texts = [t.strip() for v in values for t in v.split(";") if t.strip()]
    if not texts:
        raise SpecstackError("--methods is required, e.g. --methods \"ar;chain:k=4;hf\"")
    methods: list[BenchMethod] = []
    for text in texts:
        name, _, rest = text.partition(":")
        name = name.strip()
        if "," in name:
            raise SpecstackError(f"--methods {text!r}: separate methods with ';' "
                                 "(commas separate one method's parameters)")
        if name not in METHOD_PARAMS and name not in PEER_PARAMS:
            raise SpecstackError(f"unknown method {name!r}; choose from {', '.join([*METHOD_PARAMS, *PEER_PARAMS])}")
        dtype, others = default_dtype, []
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, _, value = item.partition("=")
            if key.strip() == "dtype":
                if value.strip() not in WEIGHT_FORMATS:
                    raise SpecstackError(f"method {text!r}: dtype must be one of {', '.join(WEIGHT_FORMATS)}")
                dtype = value.strip()
            else:
                others.append(item)
        if name in METHOD_PARAMS:
            m = BenchMethod(text, name, dtype, spec=parse_method(":".join([name, ",".join(others)])))
        else:
            m = BenchMethod(text, name, dtype, _peer_params(name, others))
        if any(m.key() == o.key() for o in methods) or any(m.label == o.label for o in methods):
            raise SpecstackError(f"--methods: {text!r} is listed twice")
        methods.append(m)
    return methods


def _peer_params(name: str, items: Sequence[str]) -> dict[str, int]:
    params = dict(PEER_PARAMS[name])
    for item in items:
        key, _, value = item.partition("=")
        if key not in params or not value.strip().isdigit() or int(value) < 1:
            known = ", ".join(params) or "dtype only"
            raise SpecstackError(f"method {name!r}: bad parameter {item!r} (parameters: {known})")
        params[key] = int(value)
    return params


@dataclass
class Plan:
    """The checked arguments, before anything is loaded."""

    methods: list[BenchMethod]
    sampling: SamplingParams
    new_tokens: int
    out: Path
    settings: dict[str, Any]


def check_args(args: argparse.Namespace) -> Plan:
    """Every cheap check, before any weights are read (SpecstackError: one line, exit 2)."""
    from specstack.bench.datasets import check_prompt_set
    from specstack.models.registry import resolve

    if args.out is None:
        raise SpecstackError("--out DIR is required (or --compare DIR1 DIR2, --ratios DIR A/B, --phases DIR)")
    if args.prompts is None:
        raise SpecstackError("--prompts is required: humaneval, sharegpt, or a JSONL file")
    for flag, value in (("--limit", args.limit), ("--repeats", args.repeats), ("--threads", args.threads),
                        ("--max-new-tokens", args.max_new_tokens)):
        if value is not None and value <= 0:
            raise SpecstackError(f"{flag} must be > 0, got {value}")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    dtype = args.dtype or DEFAULT_DTYPE[args.device]
    methods = parse_methods(args.methods, dtype)
    check_prompt_set(args.prompts)
    resolve(args.model)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SpecstackError("--device cuda: no CUDA device is available")
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise SpecstackError(f"--out {out} is a file, not a folder")
    if (out / "results.jsonl").is_file() and (out / "results.jsonl").stat().st_size > 0 and not args.resume:
        raise SpecstackError(f"{out} already holds results.jsonl: pass --resume to continue it, "
                             "or choose another --out")
    settings = {"model": args.model, "prompts": args.prompts, "limit": args.limit,
                "methods": [m.label for m in methods],
                "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
                "top_p": args.top_p, "seed": args.seed, "dtype": dtype, "device": args.device, "draft": args.draft,
                "draft_dtype": args.draft_dtype, "ngram": args.ngram, "repeats": args.repeats, "threads": args.threads}
    if args.resume and (out / "run.json").is_file():
        before = json.loads((out / "run.json").read_text(encoding="utf-8"))
        changed = [k for k in RESUME_KEYS if before.get(k) != settings[k]]
        if changed:
            was = ", ".join(f"--{k.replace('_', '-')} was {before.get(k)!r}, now {settings[k]!r}" for k in changed)
            raise SpecstackError(f"--resume: the settings differ from the run in {out} ({was})")
    return Plan(methods, sampling, args.max_new_tokens, out, settings)


# ---------------------------------------------------------------------------------------------------
# Runners: prompt ids, n -> Output (one per method, everything loaded up front)
# ---------------------------------------------------------------------------------------------------
@dataclass
class Output:
    tokens: list[int]
    dtype: str  # the weight format it ran in
    target_forwards: int | None = None
    tau: float | None = None
    origins: dict[str, int] | None = None
    phases: dict[str, float] | None = None
    accepted_per_step: list[int] | None = None
    token_origins: list[str] | None = None


Runner = Callable[[list[int], int], Output]


def run_method(target, drafter, ids, gen):  # indirection: tests wrap it to count or alter generations
    from specstack.engine.methods import run_method as engine_run

    return engine_run(target, drafter, ids, gen)


def engine_runner(lm: Any, drafter: Any, sampling: SamplingParams) -> Runner:
    from specstack.config import GenerationConfig
    from specstack.report.origins import token_origins

    def go(ids: list[int], n: int) -> Output:
        res = run_method(lm, drafter, ids, GenerationConfig(max_new_tokens=n, sampling=sampling, stop_on_eos=False))
        st = res.stats
        origins = token_origins(st, len(res.tokens))
        phases = {"prefill": st.prefill_seconds, "decode": st.decode_seconds}
        if st.steps:
            phases |= st.phase_seconds()
        return Output(res.tokens, lm.fmt, st.target_forwards, st.tau, dict(Counter(origins)), phases,
                      [s.accepted for s in st.steps] if drafter is not None else None,
                      origins if drafter is not None else None)

    return go


class Peers:
    """transformers and llama.cpp models, loaded once each (by weight format / flavour)."""

    def __init__(self, model: str, sources: Any, sampling: SamplingParams, device: str, threads: int,
                 pad_id: int | None) -> None:
        from specstack.models.registry import resolve

        self.src, self.sources, self.sampling, self.device = resolve(model), sources, sampling, device
        self.threads, self.pad_id = threads, pad_id
        self.hf: dict[str, tuple[Any, Any]] = {}
        self.assistants: dict[str, Any] = {}
        self.llama: dict[int, Any] = {}

    def unavailable(self, m: BenchMethod) -> str | None:
        from specstack.bench.peers import llama_cpp_unavailable

        if m.name.startswith("llamacpp"):
            return llama_cpp_unavailable(self.src)
        if m.name == "hf-assisted" and (self.sources.draft is None or self.sources.draft.startswith("self:")):
            return (f"unavailable: the draft {self.sources.draft or 'self:N'} (the target's first layers) is not a "
                    "model transformers can load as an assistant; pass --draft MODEL (a small model with the same "
                    "tokenizer)")
        return None

    def _hf(self, dtype: str) -> tuple[Any, Any]:
        from specstack.bench.peers import ForwardCounter, load_hf

        if dtype not in self.hf:
            model = load_hf(self.src, dtype, self.device)
            self.hf[dtype] = (model, ForwardCounter(model))
        return self.hf[dtype]

    def runner(self, m: BenchMethod, n_ctx: int) -> Runner:
        from specstack.bench.peers import hf_dtype, hf_generate, llama_cpp_generate, load_llama_cpp
        from specstack.models.registry import resolve

        if m.name.startswith("llamacpp"):
            lookup = m.params.get("tokens", 0)
            if lookup not in self.llama:
                self.llama[lookup] = load_llama_cpp(self.src, self.threads, n_ctx, prompt_lookup=lookup)
            llm = self.llama[lookup]
            return lambda ids, n: Output(llama_cpp_generate(llm, ids, n, self.sampling), "gguf")
        dt = hf_dtype(m.dtype)
        model, counter = self._hf(dt)
        extra: dict[str, Any] = {}
        if m.name == "hf-pld":
            extra["prompt_lookup_num_tokens"] = m.params["tokens"]
        elif m.name == "hf-assisted":
            from specstack.bench.peers import load_hf

            if dt not in self.assistants:
                self.assistants[dt] = load_hf(resolve(self.sources.draft), dt, self.device)
            extra["assistant_model"] = self.assistants[dt]

        def go(ids: list[int], n: int) -> Output:
            before = counter.calls
            tokens = hf_generate(model, ids, n, self.sampling, self.pad_id, **extra)
            calls = counter.calls - before  # the prefill forward emits the first token
            return Output(tokens, dt, max(0, calls - 1), len(tokens) / calls if calls else None)

        return go


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------
def command_line() -> str:
    argv = sys.argv[1:]
    return shlex.join(["specstack", *argv]) if argv[:1] == ["bench"] else shlex.join(["specstack", "bench", *argv])


def _meta(plan: Plan, args: argparse.Namespace, methods: Sequence[BenchMethod], skipped: dict[str, str],
          notes: list[str], threads: int) -> dict[str, Any]:
    from specstack.machine import cpu_model, now, versions

    ars = [m for m in methods if m.name == "ar"]
    ar = next((m for m in ars if m.dtype == plan.settings["dtype"]), ars[0] if ars else None)
    hf = next((m for m in methods if m.name == "hf"), None)
    return {"baselines": {"ar": ar and ar.label, "hf": hf and hf.label}, "skipped": skipped, "notes": notes,
            "settings": plan.settings, "machine": {"cpu": cpu_model(), "threads": threads},
            "versions": versions(), "command": command_line(), "date": now()}


class Results:
    """results.jsonl: rows appended as they finish; the keys of the rows already there."""

    def __init__(self, path: Path, resume: bool) -> None:
        from specstack.bench.report import read_rows

        self.path = path
        self.rows = read_rows(path) if resume else []
        path.write_text("".join(json.dumps(r) + "\n" for r in self.rows), encoding="utf-8")  # drops a cut-off line
        self.done = {(r["task_id"], r["method"], r["repeat"]) for r in self.rows}

    def add(self, row: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        self.rows.append(row)
        self.done.add((row["task_id"], row["method"], row["repeat"]))


def run(args: argparse.Namespace) -> int:
    if args.compare is not None:
        from specstack.bench.report import compare

        print(compare(*args.compare))
        return 0
    if args.ratios is not None:
        from specstack.bench.report import ratio_table

        if len(args.ratios) < 2:
            raise SpecstackError("--ratios DIR A/B [C/D ...]: give the run folder and at least one pair")
        print(ratio_table(Path(args.ratios[0]), args.ratios[1:]))
        return 0
    if args.phases is not None:
        from specstack.bench.report import phase_table

        print(phase_table(Path(args.phases)))
        return 0
    plan = check_args(args)

    import torch

    from specstack.bench.datasets import SHAREGPT_MAX_PROMPT_TOKENS, iter_prompts, select_prompts
    from specstack.bench.peers import hf_dtype
    from specstack.engine.methods import DraftSources, build_drafter
    from specstack.models.loading import load_model
    from specstack.prompts import encode_prompt

    # 1. models, once per weight format; prompts; drafters and peers, once per method
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    methods = plan.methods
    targets = {d: load_model(args.model, dtype=d, device=args.device) for d in dict.fromkeys(m.dtype for m in methods)}
    first = next(iter(targets.values()))
    if first.tokenizer is None:
        raise SpecstackError(f"{args.model} has no tokenizer: the benchmark needs one to encode its prompts")
    sharegpt = args.prompts == "sharegpt"
    prompts = select_prompts(iter_prompts(args.prompts), lambda p: encode_prompt(first.tokenizer, p.text, chat=p.chat),
                             args.limit, first.config.max_seq_len, plan.new_tokens, skip_long=sharegpt,
                             max_prompt_tokens=SHAREGPT_MAX_PROMPT_TOKENS if sharegpt else None)
    sources = DraftSources.for_model(first.name, args.draft, args.draft_dtype, args.ngram)
    tok = first.tokenizer
    peers = Peers(args.model, sources, plan.sampling, args.device, threads,
                  tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    n_ctx = max(len(p.ids) for p in prompts) + plan.new_tokens + 64
    runners: dict[str, Runner] = {}
    skipped: dict[str, str] = {}
    notes: list[str] = []
    for m in methods:
        if m.peer:
            why = peers.unavailable(m)
            if why is not None:
                skipped[m.label] = why
                print(f"{m.label}: skipped ({why})", file=sys.stderr)
                continue
            if m.name.startswith("hf") and hf_dtype(m.dtype) != m.dtype:
                notes.append(f"{m.label}: transformers cannot run {m.dtype} weights: it ran {hf_dtype(m.dtype)}")
            if m.name.startswith("llamacpp"):
                notes.append(f"{m.label}: llama.cpp runs the GGUF's own quantization, on the CPU")
            runners[m.label] = peers.runner(m, n_ctx)
        else:
            target = targets[m.dtype]
            runners[m.label] = engine_runner(target, build_drafter(m.spec, target, sources, args.device), plan.sampling)
    if plan.sampling.greedy and any(not m.peer and m.dtype != "fp32" for m in methods):
        notes.append("identical to ar: the int4/int8/bf16 formats compute in bf16, where the top logits often tie "
                     "or nearly tie and forwards of different widths can break a tie differently, so a lossless "
                     "method can still differ from ar there (DESIGN §2.1); fp32 runs compare exactly")
    active = [m for m in methods if m.label in runners]
    if not active:
        raise SpecstackError("every method was skipped: nothing to run")

    # 2. rows: warm-up, then per prompt every method in turn, --repeats times
    plan.out.mkdir(parents=True, exist_ok=True)
    (plan.out / "run.json").write_text(json.dumps(plan.settings, indent=1) + "\n", encoding="utf-8")
    results = Results(plan.out / "results.jsonl", args.resume)
    meta = _meta(plan, args, methods, skipped, notes, threads)
    todo = [(p, r, m) for p in prompts for r in range(args.repeats) for m in active
            if (p.task_id, m.label, r) not in results.done]
    if todo:
        measure(todo, active, runners, results, targets, plan)
    from specstack.bench.report import write_report

    write_report(plan.out, results.rows, meta, [m.label for m in methods], tok)
    print((plan.out / "summary.md").read_text(encoding="utf-8"))
    return 0


def measure(todo: Sequence[tuple[Any, int, BenchMethod]], methods: Sequence[BenchMethod], runners: dict[str, Runner],
            results: Results, targets: dict[str, Any], plan: Plan) -> None:
    from tqdm import tqdm

    ar_of = {}  # weight format -> label of the list's `ar` in it (the identical_to_ar reference)
    for m in methods:
        if m.name == "ar":
            ar_of.setdefault(m.dtype, m.label)
    refs: dict[tuple[str, str], list[int]] = {}
    for r in results.rows:
        d = next((d for d, label in ar_of.items() if label == r["method"]), None)
        if d is not None and r["repeat"] == 0:
            refs[(r["task_id"], d)] = r["tokens"]

    print(f"warming up {len(methods)} methods", file=sys.stderr)
    first_ids = todo[0][0].ids
    for m in methods:
        runners[m.label](first_ids, min(plan.new_tokens, WARMUP_TOKENS))

    totals = {m.label: [0, 0.0] for m in methods}
    bar = tqdm(total=len(todo), desc="bench", unit="gen", file=sys.stderr)
    for task in dict.fromkeys(p.task_id for p, _, _ in todo):
        items = [(p, r, m) for p, r, m in todo if p.task_id == task]
        prompt = items[0][0]
        pending: list[tuple[dict[str, Any], str]] = []
        if plan.sampling.greedy:  # references the list's `ar` will not produce on this prompt: run once, untimed
            coming = {m.dtype for _, _, m in items if ar_of.get(m.dtype) == m.label}
            for d in dict.fromkeys(m.dtype for _, _, m in items):
                if (task, d) not in refs and d not in coming:
                    refs[(task, d)] = engine_runner(targets[d], None, plan.sampling)(prompt.ids, plan.new_tokens).tokens
        for p, r, m in items:
            t0 = time.perf_counter()
            out = runners[m.label](p.ids, plan.new_tokens)
            seconds = time.perf_counter() - t0
            row = {"task_id": task, "method": m.label, "repeat": r, "dtype": out.dtype, "new_tokens": len(out.tokens),
                   "seconds": seconds, "tokens_per_s": len(out.tokens) / seconds,
                   "target_forwards": out.target_forwards,
                   "tau": out.tau, "identical_to_ar": None, "origins": out.origins, "phases": out.phases,
                   "accepted_per_step": out.accepted_per_step, "token_origins": out.token_origins, "tokens": out.tokens}
            if plan.sampling.greedy and ar_of.get(m.dtype) == m.label:
                refs.setdefault((task, m.dtype), out.tokens)
            pending.append((row, m.dtype))
            # write every row whose reference is known (greedy), or at once (sampling: no reference)
            keep = []
            for row_, d in pending:
                if plan.sampling.greedy and (task, d) not in refs:
                    keep.append((row_, d))
                    continue
                if plan.sampling.greedy:
                    row_["identical_to_ar"] = row_["tokens"] == refs[(task, d)]
                results.add(row_)
            pending = keep
            totals[m.label][0] += len(out.tokens)
            totals[m.label][1] += seconds
            bar.set_postfix_str(" | ".join(f"{k} {n / s:.1f}" for k, (n, s) in totals.items() if s > 0) + " tok/s")
            bar.update()
        assert not pending, "every reference is known by the end of a prompt"
    bar.close()
