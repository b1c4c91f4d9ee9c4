"""τ measured with the engine (`specstack throughput --tau auto`): tokens emitted per speculation round,
pooled over a prompt set (total new tokens / total target forwards), greedy, every prompt generating
exactly the same number of tokens.

The designs the engine can run: `vanilla` (a chain of k tokens from a draft model or a self-draft)
and `magicdec` (the target drafting for itself through a sliding-window KV of sink + L // 8 positions,
L the prompt's length: the published convention, with the cache's window mode, DESIGN §3). A SPIRe
draft needs its own drafter (feedback memory, target activations; DESIGN §7), so its τ is given.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specstack.config import GenerationConfig, WindowSpec
from specstack.drafting.base import Drafter
from specstack.drafting.model import ModelDrafter, TreeParams
from specstack.engine.methods import run_method
from specstack.models.base import LoadedModel
from specstack.throughput.model import Conventions

MEASURABLE = ("vanilla", "magicdec")


@dataclass(frozen=True)
class TauMeasurement:
    design: str
    tau: float
    new_tokens: int
    rounds: int
    prompts: int


def sparse_self_drafter(model: LoadedModel, k: int, window: WindowSpec) -> ModelDrafter:
    """MagicDec: a model drafting a chain with only `window.sink` first and `window.window` last
    positions of its KV (the cache evicts the rest)."""
    return ModelDrafter(model, TreeParams.chain(k), window=window)


def magicdec_drafters(target: LoadedModel, k: int, conv: Conventions) -> Callable[[Sequence[int]], Drafter]:
    """A fresh drafter per prompt: its window follows that prompt's length L (sink + L // divisor)."""
    def make(prompt_ids: Sequence[int]) -> Drafter:
        window = WindowSpec(conv.sink, max(1, len(prompt_ids) // conv.window_divisor))
        return sparse_self_drafter(target, k, window)

    return make


def measure_tau(design: str, target: LoadedModel, drafter_for: Callable[[Sequence[int]], Drafter],
                prompts: Sequence[Sequence[int]], new_tokens: int,
                on_prompt: Callable[[], None] | None = None) -> TauMeasurement:
    gen = GenerationConfig(max_new_tokens=new_tokens, stop_on_eos=False)
    emitted = rounds = 0
    for ids in prompts:
        stats = run_method(target, drafter_for(ids), ids, gen).stats
        emitted += stats.new_tokens
        rounds += stats.target_forwards
        if on_prompt is not None:
            on_prompt()
    return TauMeasurement(design, emitted / max(1, rounds), emitted, rounds, len(prompts))
