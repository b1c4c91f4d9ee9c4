"""What a `specstack bench` run measures, checked before anything is loaded.

Terms:
- method list: methods separated by ';' ("ar;chain:k=4;hf;llamacpp"); commas separate one method's
  parameters. Engine methods take theirs (engine.methods); every method also takes `dtype=F`, the
  target's weight format for that method. Peers (PEER_PARAMS) are transformers and llama.cpp.
- label: a method as written in the list; rows, summaries and --resume know methods by label.
- settings (BenchSettings): every choice that shapes the numbers; written to DIR/run.json, and a
  --resume must repeat the RESUME_KEYS of them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specstack.bench.report import read_rows, read_run
from specstack.config import WEIGHT_FORMATS, SamplingParams
from specstack.engine.methods import METHODS, MethodSpec, parse_method
from specstack.errors import SpecstackError
from specstack.files import check_writable_dir

PEER_PARAMS: dict[str, dict[str, int]] = {
    "hf": {}, "hf-pld": {"tokens": 10}, "hf-assisted": {}, "llamacpp": {}, "llamacpp-pld": {"tokens": 10},
}
RESUME_KEYS = ("model", "prompts", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "dtype", "device",
               "draft", "draft_dtype", "ngram")


@dataclass(frozen=True)
class BenchMethod:
    label: str  # as written in the method list
    name: str
    dtype: str  # the target's weight format asked for
    params: dict[str, int] = field(default_factory=dict)  # a peer's parameters
    spec: MethodSpec | None = None  # engine methods; None for peers

    @property
    def peer(self) -> bool:
        return self.spec is None

    def key(self) -> tuple:
        return (self.name, tuple(sorted((self.spec.params if self.spec else self.params).items())), self.dtype)


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
        if name not in METHODS and name not in PEER_PARAMS:
            raise SpecstackError(f"unknown method {name!r}; choose from {', '.join([*METHODS, *PEER_PARAMS])}")
        dtype, others = default_dtype, []
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, _, value = item.partition("=")
            if key.strip() == "dtype":
                if value.strip() not in WEIGHT_FORMATS:
                    raise SpecstackError(f"method {text!r}: dtype must be one of {', '.join(WEIGHT_FORMATS)}")
                dtype = value.strip()
            else:
                others.append(item)
        if name in METHODS:
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
            changed = [k for k in RESUME_KEYS if before.get(k) != now[k]]
            if changed:
                was = ", ".join(f"--{k.replace('_', '-')} was {before.get(k)!r}, now {now[k]!r}" for k in changed)
                raise SpecstackError(f"--resume: the settings differ from the run in {out} ({was})")
        if self.resume:
            read_rows(results)
