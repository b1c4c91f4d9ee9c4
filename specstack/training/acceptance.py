"""Held-out greedy acceptance of drafts, by context, teacher-forced (`specstack draft-acceptance`).

Every design is measured on the same held-out sequences (of a `train-draft --sequences` file) with the
same counting (distill.ChainCounts): α_j, the acceptance of chain position j given the positions before
it were accepted; τ of a k-chain over every position; τ of rounds walked along the text as decoding
does; each overall and for chains whose first query sees (C/2, C] tokens, for each context C.
A design is
- a draft file from `specstack train-draft`, fed the target's activations as in the engine;
- `magicdec`: the target drafting for itself through a sliding-window KV of sink 1 + C // 8 positions
  at context C (the published convention; one window per context, so there is no overall figure);
- `magicdec:W`: the same with a fixed window of W positions;
- a model (a registered name or a path, sharing the target's vocabulary: the 0.5B sibling of
  Qwen2.5-Coder-1.5B), drafting with its full context; `MODEL@K` gives it a head over the target's K
  most frequent tokens (FR-Spec, as `--draft-vocab K` does in the engine). It runs in bf16 like the
  teacher, so its guesses are those of its bf16 weights, not of its own GGUF format.
A teacher-forced guesser that sees the whole text (MagicDec, a model) makes its step-j guess at a
position with the text before it, which is the accepted chain whenever step j counts.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from specstack.attention import build_batch
from specstack.config import WindowSpec
from specstack.errors import SpecstackError
from specstack.models.draft_file import load_draft_file, read_draft_header
from specstack.models.drafts import FILE_SUFFIX
from specstack.models.loading import LoadedModel, load_model
from specstack.models.transformer import Transformer
from specstack.training.data import read_sequences
from specstack.training.distill import Acceptance, ChainCounts, acceptance
from specstack.training.teacher import OnlineTeacher, TeacherSpec
from specstack.validate import MAX_CONTEXT, bounded_int

MAGICDEC = "magicdec"
VOCAB_MARK = "@"  # MODEL@K: the model's head over the target's K most frequent tokens


def is_magicdec(design: str) -> bool:
    """`magicdec` or `magicdec:W` (anything else names a draft file)."""
    return design.split(":")[0] == MAGICDEC


def magicdec_window(design: str) -> int | None:
    """None for `magicdec` (window C // 8 per context), W for `magicdec:W`."""
    _, _, w = design.partition(":")
    if not w:
        return None
    if not w.isdigit() or int(w) < 1:
        raise SpecstackError(f"{design}: the window must be a positive integer")
    # a window beyond any context keeps every position: no need to build masks of its size
    return bounded_int(f"{design}: the window", w, 1, MAX_CONTEXT, "longer than any model's context")


def is_draft_file(design: str) -> bool:
    return design.endswith(FILE_SUFFIX)


def model_design(design: str) -> tuple[str, int | None]:
    """`MODEL` -> (MODEL, None); `MODEL@K` -> (MODEL, K), K >= 1."""
    name, mark, k = design.rpartition(VOCAB_MARK)
    if not mark:
        return design, None
    if not name or not k.isdigit() or int(k) < 1:
        raise SpecstackError(f"{design}: expected MODEL or MODEL{VOCAB_MARK}K with K >= 1 tokens in its head")
    return name, int(k)


def check_designs(designs: Sequence[str]) -> None:
    """Each design is magicdec[:W] with a valid window, a draft file (read only for its header), or a
    model that can be found (a registered name, a .gguf file, a checkpoint folder)."""
    from specstack.models.registry import resolve

    for d in designs:
        if is_magicdec(d):
            magicdec_window(d)
        elif is_draft_file(d):
            read_draft_header(d)  # a missing or malformed file fails here, saying what is wrong
        else:
            try:
                resolve(model_design(d)[0])
            except SpecstackError as e:
                raise SpecstackError(f"{d}: neither a draft file from `specstack train-draft`, magicdec[:W] nor a "
                                     f"model ({e})") from None


def heldout_tokens(path: Path, n: int) -> torch.Tensor:
    """The first `n` held-out sequences of a `train-draft --sequences` file, int32 [n, seq_len]."""
    (held,) = read_sequences(path, ("heldout",))
    if held.ndim != 2 or len(held) == 0:
        raise SpecstackError(f"{path} holds no held-out sequences to measure on")
    return held[:n].to(torch.int32)


def check_length(path: Path, seq_len: int, k: int) -> None:
    """A k-chain needs a first query and k tokens after it inside a sequence: more than k tokens."""
    if seq_len <= k:
        raise SpecstackError(f"the held-out sequences of {path} hold {seq_len} tokens: a {k}-chain needs more than "
                             f"{k} (lower --k or prepare longer sequences)")


def choose_device(requested: str | None) -> str:
    """The device asked for (an error if it is cuda and there is none), else cuda when present."""
    device = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecstackError("--device cuda requested but no CUDA device is available")
    return device


def greedy_guesses(model: Transformer, tokens: torch.Tensor, window: WindowSpec | None = None) -> torch.Tensor:
    """[T] the model's greedy next token at every position of `tokens` [1, T], read in one forward
    (through a sliding-window KV when `window` is given)."""
    cache = model.new_cache(1, tokens.shape[1] + 8, window=window)
    return model.forward(tokens, build_batch(cache, tokens.shape[1]), cache).logits[0].argmax(-1)


def model_acceptance(draft: Transformer, teacher: OnlineTeacher, k: int, contexts: tuple[int, ...]) -> Acceptance:
    """A draft model's greedy guesses with its full context, teacher-forced (see the module's docstring)."""
    counts = ChainCounts(k, contexts, draft.device)
    with torch.inference_mode():
        for batch in teacher.heldout_batches():
            tokens = batch["tokens"].long().to(draft.device)  # [1, seq_len]
            greedy = batch["topk_ids"][0, :, 0].long().to(draft.device)
            counts.add(tokens[0], greedy, [greedy_guesses(draft, tokens)] * k)
    return counts.result()


def load_model_design(design: str, target: LoadedModel, device: str) -> Transformer:
    """The model of a `MODEL[@K]` design in bf16, its head cut to the target's K most frequent tokens
    (and its special tokens) when K is given; an error when its vocabulary is not the target's."""
    from specstack.engine.draft_sources import restricted_head

    name, k = model_design(design)
    lm = load_model(name, dtype="bf16", device=device, tokenizer=False)
    if lm.config.vocab_size != target.config.vocab_size:
        raise SpecstackError(f"{design}: its vocabulary ({lm.config.vocab_size} tokens) is not the target's "
                             f"({target.config.vocab_size})")
    return (restricted_head(lm, target, k) if k is not None else lm).model


def magicdec_acceptance(target: Transformer, teacher: OnlineTeacher, k: int, contexts: tuple[int, ...],
                        fixed: int | None) -> Acceptance:
    """The target's greedy guesses through a sliding-window KV, teacher-forced: with the accepted chain
    equal to the text, the draft's step-j guess at a position is its windowed prediction there. `fixed`:
    a window of that many positions; None: 1 + C // 8 at each context C (then no overall figure)."""
    windows = {c: fixed or max(1, c // 8) for c in contexts}
    per_window = {w: ChainCounts(k, contexts, target.device) for w in ({fixed} if fixed else set(windows.values()))}
    with torch.inference_mode():
        for batch in teacher.heldout_batches():
            tokens = batch["tokens"].long()  # [1, seq_len]
            greedy = batch["topk_ids"][0, :, 0].long()  # [seq_len]: the target's greedy choice at each position
            for w, counts in per_window.items():
                counts.add(tokens[0], greedy, [greedy_guesses(target, tokens, WindowSpec(1, w))] * k)
    if fixed is not None:
        return per_window[fixed].result()
    by_context = {c: per_window[windows[c]].result().by_context[c] for c in contexts}
    return Acceptance([], by_context)


def measure_acceptance(target_name: str, held: torch.Tensor, designs: Sequence[str], k: int,
                       contexts: tuple[int, ...], device: str) -> dict[str, Acceptance]:
    """Acceptance of each design on `held` ([sequences, seq_len]): the target (bf16) is the teacher, with
    the activations every draft file reads; draft files run in fp32. Progress on stderr."""
    target = load_model(target_name, dtype="bf16", device=device, tokenizer=False)
    drafts = {d: load_draft_file(d, target, "fp32").model for d in designs if is_draft_file(d)}
    models = {d: load_model_design(d, target, device) for d in designs if not is_draft_file(d) and not is_magicdec(d)}
    layers = sorted({i for m in drafts.values() for i in m.spire.target_layers})
    teacher = OnlineTeacher(target.model, held[:0], held, TeacherSpec(layers=tuple(layers)))
    results: dict[str, Acceptance] = {}
    for d in tqdm(designs, desc="draft-acceptance", unit="design", file=sys.stderr):
        if d in drafts:
            results[d] = acceptance(drafts[d], teacher.heldout_batches(), k, len(held), contexts)
        elif d in models:
            results[d] = model_acceptance(models[d], teacher, k, contexts)
        else:
            results[d] = magicdec_acceptance(target.model, teacher, k, contexts, magicdec_window(d))
    return results


def table(results: dict[str, Acceptance], k: int, contexts: Sequence[int]) -> str:
    """τ per design, overall and by context (walked τ in brackets; – where no chain counted), and α."""
    def cell(a: Acceptance) -> str:
        walk = "" if a.walk_tau is None else f" ({a.walk_tau:.3f})"
        return (f"{a.tau:.3f}" if a.alpha else "–") + walk

    def row(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    lines = [f"τ of a {k}-chain over every position, (in brackets) walked as decoding does"
             + ("; by context:" if contexts else ":"),
             row(["design", "overall", *(f"({c // 2}, {c}]" for c in contexts), "α overall"]),
             "|---|---:|" + "---:|" * len(contexts) + "---|"]
    for d, acc in results.items():
        lines.append(row([d, cell(acc), *(cell(acc.by_context[c]) for c in contexts),
                          ", ".join(f"{a:.3f}" for a in acc.alpha)]))
    return "\n".join(lines)
