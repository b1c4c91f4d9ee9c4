"""τ measured with the engine (`specstack throughput --tau auto`): tokens emitted per speculation round,
pooled over a prompt set (total new tokens / total target forwards), greedy, every prompt generating
exactly the same number of tokens.

The designs the engine measures (tau.MEASURABLE, the keys of DRAFTERS): `vanilla` (a chain of k
tokens from the --draft model, a self-draft or a trained draft file) and `magicdec` (the target
drafting for itself through a sliding-window KV of sink + L // 8 positions, L the prompt's length: the
published convention, with the cache's window mode, DESIGN §3). The `spire` design of the model is
--spire-layers blocks of the target, which has a τ only once trained (`specstack train-draft`;
`specstack draft-acceptance` measures a trained draft), so its τ is given.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specstack.bench.datasets import iter_prompts, select_prompts
from specstack.config import GenerationConfig, WindowSpec
from specstack.drafting.base import Drafter
from specstack.drafting.model import ChainDrafter
from specstack.engine.batched import generate
from specstack.engine.draft_sources import DraftSources, load_draft
from specstack.errors import SpecstackError
from specstack.models.base import LoadedModel
from specstack.models.loading import load_model
from specstack.prompts import encode_prompt
from specstack.throughput.model import Conventions

DrafterFor = Callable[[Sequence[int]], Drafter]  # prompt ids -> the drafter that generates after them


@dataclass(frozen=True)
class TauMeasurement:
    design: str
    tau: float
    new_tokens: int
    rounds: int
    prompts: int


def sparse_self_drafter(model: LoadedModel, k: int, window: WindowSpec) -> ChainDrafter:
    """MagicDec: a model drafting a chain with only `window.sink` first and `window.window` last
    positions of its KV (the cache evicts the rest); a lone row, a chain group of one."""
    return ChainDrafter(model, k, window)


def magicdec_drafters(target: LoadedModel, k: int, conv: Conventions) -> DrafterFor:
    """A fresh drafter per prompt: its window follows that prompt's length L (sink + L // divisor)."""
    def make(prompt_ids: Sequence[int]) -> Drafter:
        window = WindowSpec(conv.sink, max(1, len(prompt_ids) // conv.window_divisor))
        return sparse_self_drafter(target, k, window)

    return make


def vanilla_drafters(target: LoadedModel, k: int, sources: DraftSources) -> DrafterFor:
    """One chain drafter of the draft model for every prompt (the engine resets it per generation)."""
    chain = ChainDrafter(load_draft(target, sources, "cpu"), k)
    return lambda _ids: chain


def measure_tau(design: str, target: LoadedModel, drafter_for: DrafterFor, prompts: Sequence[Sequence[int]],
                new_tokens: int, on_prompt: Callable[[], None] | None = None) -> TauMeasurement:
    """τ of one design: every prompt generates exactly `new_tokens` (no stop at EOS), greedy."""
    gen = GenerationConfig(max_new_tokens=new_tokens, stop_on_eos=False)
    emitted = rounds = 0
    for ids in prompts:
        stats = generate(target, ids, gen, drafter=drafter_for(ids)).stats
        emitted += stats.new_tokens
        rounds += stats.target_forwards
        if on_prompt is not None:
            on_prompt()
    return TauMeasurement(design, emitted / max(1, rounds), emitted, rounds, len(prompts))


@dataclass(frozen=True)
class TauRun:
    """What `--tau auto` measures every design on: the target in the engine's weight format, the
    prompts encoded (ids each), the chain length and the sparse-KV conventions, the vanilla draft."""

    target: LoadedModel
    prompts: list[list[int]]
    k: int
    conv: Conventions
    draft: DraftSources
    new_tokens: int

    @classmethod
    def load(cls, target: str, draft: str, dtype: str, prompt_set: str, limit: int, new_tokens: int, k: int,
             conv: Conventions, threads: int | None = None) -> TauRun:
        """Load the target (`dtype`, also the draft's) and the first `limit` prompts of `prompt_set` that
        fit with `new_tokens` (ShareGPT skips longer ones; another set's too-long prompt is an error)."""
        if threads is not None:
            torch.set_num_threads(threads)
        lm = load_model(target, dtype=dtype)
        if lm.tokenizer is None:
            raise SpecstackError(f"--tau auto: {target} has no tokenizer to encode the prompts with")
        prompts = select_prompts(iter_prompts(prompt_set), lambda p: encode_prompt(lm.tokenizer, p.text, chat=p.chat),
                                 limit, lm.config.max_seq_len, new_tokens, skip_long=prompt_set == "sharegpt")
        return cls(lm, [p.ids for p in prompts], k, conv, DraftSources(draft=draft, draft_dtype=dtype), new_tokens)

    def measure(self, design: str, on_prompt: Callable[[], None] | None = None) -> TauMeasurement:
        """τ of `design` (one of tau.MEASURABLE) over the prompts; `on_prompt` after each prompt."""
        return measure_tau(design, self.target, DRAFTERS[design](self), self.prompts, self.new_tokens, on_prompt)


# design -> its drafters on a TauRun; tau.MEASURABLE (torch-free, for the cheap checks) names these keys
DRAFTERS: dict[str, Callable[[TauRun], DrafterFor]] = {
    "vanilla": lambda run: vanilla_drafters(run.target, run.k, run.draft),
    "magicdec": lambda run: magicdec_drafters(run.target, run.k, run.conv),
}
