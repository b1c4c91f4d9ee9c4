"""What a `specstack bench` run measures, checked before anything is loaded.

Terms:
- method list: methods separated by ';' ("ar;chain:k=4;hf;llamacpp"); commas separate one method's
  parameters. Engine methods take theirs (engine.methods); every method also takes `dtype=F`, the
  target's weight format for that method. Peers (bench/peer_table.py): transformers, llama.cpp, OpenVINO.
- label: a method as written in the list; rows, summaries and --resume know methods by label.
- settings (BenchSettings): every choice that shapes the numbers; written to DIR/run.json, and a
  --resume must repeat the RESUME_KEYS of them.
- batch mode (--batch-sizes): every method decodes batches of B prompts at once (bench/batched.py);
  engine methods then also take `layout=auto|pad|split` (how the batched engine lays out ragged rows),
  the peers are `hf` (transformers' batched generate) and `llamacpp-batched` (llama-batched-bench).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specstack.bench.peer_table import BATCH_PEERS, PEERS
from specstack.bench.rows import read_rows, read_run
from specstack.config import SamplingParams
from specstack.engine.methods import METHODS, MethodSpec, parse_method
from specstack.errors import SpecstackError
from specstack.files import check_writable_dir
from specstack.weight_formats import WEIGHT_FORMATS

LAYOUTS = ("auto", "pad", "split")  # engine.batched's LAYOUT_CHOICES (plan stays importable without it)
RESUME_KEYS = ("model", "prompts", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "dtype", "device",
               "draft", "draft_dtype", "ngram", "batch_sizes", "draft_vocab")


@dataclass(frozen=True)
class BenchMethod:
    label: str  # as written in the method list
    name: str
    dtype: str  # the target's weight format asked for
    params: dict[str, int] = field(default_factory=dict)  # a peer's parameters
    spec: MethodSpec | None = None  # engine methods; None for peers
    layout: str | None = None  # batch mode, engine methods: the batched engine's layout (None: auto)

    @property
    def peer(self) -> bool:
        return self.spec is None

    def key(self) -> tuple:
        return (self.name, tuple(sorted((self.spec.params if self.spec else self.params).items())), self.dtype,
                self.layout or "auto")

    def batch_label(self, batch_size: int) -> str:
        """How rows and summaries name this method at batch size B: `METHOD@bB`."""
        return f"{self.label}@b{batch_size}"


def parse_methods(values: Sequence[str], default_dtype: str) -> list[BenchMethod]:
    """The method lists (each ';'-separated; --methods may be repeated) -> methods, each listed once."""
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
        if name not in METHODS and name not in PEERS:
            raise SpecstackError(f"unknown method {name!r}; choose from {', '.join([*METHODS, *PEERS])}")
        dtype, layout, others = default_dtype, None, []
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, _, value = item.partition("=")
            if key.strip() == "dtype":
                if value.strip() not in WEIGHT_FORMATS:
                    raise SpecstackError(f"method {text!r}: dtype must be one of {', '.join(WEIGHT_FORMATS)}")
                dtype = value.strip()
            elif key.strip() == "layout" and name in METHODS:
                if value.strip() not in LAYOUTS:
                    raise SpecstackError(f"method {text!r}: layout must be one of {', '.join(LAYOUTS)}")
                layout = value.strip()
            else:
                others.append(item)
        if name in METHODS:
            m = BenchMethod(text, name, dtype, spec=parse_method(":".join([name, ",".join(others)])), layout=layout)
        else:
            m = BenchMethod(text, name, dtype, _peer_params(name, others))
        if any(m.key() == o.key() for o in methods) or any(m.label == o.label for o in methods):
            raise SpecstackError(f"--methods: {text!r} is listed twice")
        methods.append(m)
    return methods


def check_batch_mode(methods: Sequence[BenchMethod], batch_sizes: Sequence[int] | None) -> None:
    """The methods suit the mode: in batch mode only engine methods and the batching peers; outside
    it, no batch-only peer and no layout (a single sequence has no rows to lay out)."""
    for m in methods:
        if batch_sizes:
            if m.peer and m.name not in BATCH_PEERS:
                raise SpecstackError(f"--methods {m.label!r}: not a batched method; with --batch-sizes the peers "
                                     f"are {', '.join(BATCH_PEERS)}")
        elif m.peer and PEERS[m.name].batch_only:
            raise SpecstackError(f"--methods {m.label!r}: runs batches only; give --batch-sizes, e.g. 1,4,8,16,32")
        elif m.layout is not None:
            raise SpecstackError(f"--methods {m.label!r}: layout= lays out the rows of a batch; give --batch-sizes")


def _peer_params(name: str, items: Sequence[str]) -> dict[str, int]:
    params = dict(PEERS[name].params)
    for item in items:
        key, _, value = item.partition("=")
        if key not in params or not value.strip().isdigit() or int(value) < 1:
            known = ", ".join(params) or "dtype only"
            raise SpecstackError(f"method {name!r}: bad parameter {item!r} (parameters: {known})")
        params[key] = int(value)
    return params


@dataclass(frozen=True)
class BenchSettings:
    """A run's settings, in DIR/run.json's order and names."""

    model: str
    prompts: str  # humaneval, sharegpt or a JSONL file
    limit: int | None  # the first N prompts
    methods: tuple[str, ...]  # labels
    max_new_tokens: int  # exactly, per generation
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    dtype: str  # the target's weight format where a method names none
    device: str
    draft: str | None
    draft_dtype: str | None
    ngram: str | None
    repeats: int  # runs of every (prompt, method)
    threads: int | None  # torch and llama.cpp threads; None: torch's choice
    batch_sizes: tuple[int, ...] | None = None  # batch mode: rows decoded at once; None: one sequence at a time
    draft_vocab: int | None = None  # FR-Spec: the draft's head over the K most frequent tokens

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)


@dataclass(frozen=True)
class Plan:
    """A checked run: its settings, parsed methods and output folder."""

    settings: BenchSettings
    methods: tuple[BenchMethod, ...]
    out: Path
    resume: bool  # continue out/results.jsonl
    llama_bin_dir: Path | None = None  # where llama-batched-bench is (--llama-bin-dir)

    def check_output(self) -> None:
        """The output folder can take this run: a new folder, or the same settings when resuming (whose
        rows must read: a damaged line fails here, before any model is loaded)."""
        out = self.out
        check_writable_dir(out, "--out")
        results = out / "results.jsonl"
        if results.is_file() and results.stat().st_size > 0 and not self.resume:
            raise SpecstackError(f"{out} already holds results.jsonl: pass --resume to continue it, "
                                 "or choose another --out")
        if self.resume and (out / "run.json").is_file():
            before = read_run(out)
            now = asdict(self.settings)
            # JSON has no tuples: compare lists (batch_sizes)
            changed = [k for k in RESUME_KEYS if _plain(before.get(k)) != _plain(now[k])]
            if changed:
                was = ", ".join(f"--{k.replace('_', '-')} was {before.get(k)!r}, now {now[k]!r}" for k in changed)
                raise SpecstackError(f"--resume: the settings differ from the run in {out} ({was})")
        if self.resume:
            read_rows(results)


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value
