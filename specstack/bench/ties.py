"""Is every divergence of a greedy `specstack bench` run from `ar` a near-tie (`specstack bench-ties DIR`)?

In bf16/int4 a T-token verification forward rounds differently from T one-token forwards, so a
lossless method can part from `ar` (DESIGN §2.1). Where it does, both tokens must be at the top of
the target's logits there: each within TIE_TOLERANCE of the largest logit (a tie of two, or of
three or more, where rounding picks any of them); anything else is a bug. For every row of an engine
method that is not identical to `ar` at its weight format, this finds the first divergent token,
recomputes the target's logits there (prefill of the prompt and the common prefix) and checks it.
Rows of the peers (transformers, llama.cpp) are other implementations and are not checked.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specstack.bench.datasets import iter_prompts
from specstack.bench.rows import read_rows, read_run
from specstack.engine.methods import METHODS
from specstack.errors import SpecstackError
from specstack.models.base import LoadedModel
from specstack.models.loading import load_model
from specstack.prompts import encode_prompt

# bf16 logits of these models are 20-40 in size, where one bf16 step is 0.125-0.25; rounding in a
# different kernel order moves a logit by a few steps at most
TIE_TOLERANCE = 0.75


@dataclass(frozen=True)
class Divergence:
    task_id: str
    method: str
    index: int  # first token where the method's output differs from ar's
    ar_token: int
    token: int
    gap: float  # how far the lower of the two logits is below the largest logit at that point

    @property
    def near_tie(self) -> bool:
        return self.gap <= TIE_TOLERANCE


def tie_gap(logits: torch.Tensor, a: int, b: int) -> float:
    """How far below the top logit the lower of tokens a and b is (0: both are at the top)."""
    return float(logits.max() - min(logits[a], logits[b]))


def first_divergence(ref: Sequence[int], out: Sequence[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b), None)


def check_folder(folder: Path, threads: int | None = None) -> list[Divergence]:
    """The first divergence of every engine row of a finished greedy bench run in `folder`."""
    pairs = divergent_rows(read_rows(folder / "results.jsonl"))
    if any(not isinstance(row.get("tokens"), list) for pair in pairs for row in pair):
        raise SpecstackError(f"{folder}: rows carry no token ids: run bench-ties on the bench_out folder of the run "
                             "(a published copy keeps none)")
    if any(not isinstance(r.get("dtype"), str) for r, _ in pairs):
        raise SpecstackError(f"{folder}: rows carry no weight format (dtype): the target cannot be rerun as they ran")
    run = read_run(folder)
    for key in ("model", "prompts"):
        if not isinstance(run.get(key), str):
            raise SpecstackError(f"{folder / 'run.json'}: the setting {key!r} is missing or not a string")
    temperature = run.get("temperature", 0)
    if not isinstance(temperature, (int, float)):
        raise SpecstackError(f"{folder / 'run.json'}: the setting 'temperature' is not a number")
    if temperature > 0:
        raise SpecstackError(f"{folder} is a sampling run: only greedy runs compare tokens with ar")
    return check_run(run, pairs, threads)


def divergent_rows(rows: Sequence[dict]) -> list[tuple[dict, dict]]:
    """(row, its ar row) for every engine row marked not identical to the ar of its weight format (a
    batch-mode row, against the single-sequence ar of its prompt)."""
    engine = [r for r in rows if r.get("base_method", r["method"]).partition(":")[0] in METHODS]
    ar = {(r["task_id"], r.get("dtype")): r for r in engine
          if r["method"].partition(":")[0] == "ar" and "batch_size" not in r}
    return [(r, ar[key]) for r in engine
            if r.get("identical_to_ar") is False and (key := (r["task_id"], r.get("dtype"))) in ar]


def report(divergences: Sequence[Divergence]) -> str:
    """One line for all divergences, then one per divergence that is no near-tie (a bug)."""
    bad = [d for d in divergences if not d.near_tie]
    gaps = sorted(d.gap for d in divergences)
    lines = [f"{len(divergences)} rows differ from ar; {len(divergences) - len(bad)} first divergences are near-ties "
             f"(both tokens within {TIE_TOLERANCE} of the top logit)"
             + (f"; gaps {gaps[0]:.3f} .. {gaps[-1]:.3f}" if gaps else "")]
    lines += [f"NOT A NEAR-TIE: {d.task_id} {d.method} token {d.index}: ar {d.ar_token}, method {d.token}, "
              f"{d.gap:.3f} below the top logit" for d in bad]
    return "\n".join(lines)


def check_run(run: dict, pairs: Sequence[tuple[dict, dict]], threads: int | None = None) -> list[Divergence]:
    """Each (row, ar row) pair's first divergence, with the gap of the target's logits there."""
    if threads:
        torch.set_num_threads(threads)
    prompts = {p.task_id: p for p in iter_prompts(run["prompts"])}
    models: dict[str, LoadedModel] = {}
    out = []
    for r, ar in pairs:
        ref = ar["tokens"]
        i = first_divergence(ref, r["tokens"])
        if i is None:
            continue
        p = prompts.get(r["task_id"])
        if p is None:
            raise SpecstackError(f"task {r['task_id']!r} of the run is not in its prompt set {run['prompts']}")
        if r["dtype"] not in models:
            models[r["dtype"]] = load_model(run["model"], dtype=r["dtype"])
        lm = models[r["dtype"]]
        ids = list(encode_prompt(lm.tokenizer, p.text, chat=p.chat)) + list(ref[:i])
        logits = lm.model.extend(torch.tensor([ids]), lm.model.new_cache(1, len(ids) + 1)).logits[0, -1]
        a, b = ref[i], r["tokens"][i]
        out.append(Divergence(r["task_id"], r["method"], i, a, b, tie_gap(logits, a, b)))
    return out
