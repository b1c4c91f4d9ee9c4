"""FR-Spec's restricted draft head (`--draft-vocab K`, Transformer.with_head_over): the draft scores only
K tokens, every other token gets -inf (q = 0), and the target still verifies over the whole
vocabulary, so greedy output is token for token the target's and sampling keeps its distribution."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from stats.test_lossless_distribution import T1, Toy, run_and_check, sampled_tree

from specstack.config import GenerationConfig, SamplingParams, WindowSpec
from specstack.drafting.model import ModelDrafter, TreeParams
from specstack.engine import draft_sources
from specstack.engine.batched import generate
from specstack.engine.draft_sources import DraftSources, resolve_draft, restricted_head
from specstack.errors import SpecstackError
from specstack.models.base import LoadedModel
from specstack.models.draft_file import save_draft
from specstack.models.loading import load_model
from specstack.models.spire_draft import SpireDraft
from specstack.training.prune import build_draft
from specstack.verify import verify_rrs

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 17, 3, 99, 42, 8], [200, 1, 1, 7], list(range(30, 60))]


def kept(lm: LoadedModel, k: int) -> torch.Tensor:
    """The k tokens the target itself ranks highest over the prompts' next steps, so the restricted
    draft is right often (and, k < V, sometimes unable to propose the right token)."""
    scores = torch.zeros(lm.config.vocab_size)
    for p in PROMPTS:
        scores += lm.model.extend(torch.tensor([p]), lm.model.new_cache(1, capacity=64)).logits[0].softmax(-1).sum(0)
    return scores.topk(k).indices


def test_restricted_head_scores_its_tokens_exactly_and_no_other(tiny):
    lm = tiny.lm
    tokens = kept(lm, 100)
    small = lm.model.with_head_over(tokens)
    ids = torch.tensor([PROMPTS[0]])
    full = lm.model.extend(ids, lm.model.new_cache(1, capacity=16)).logits[0]
    cut = small.extend(ids, small.new_cache(1, capacity=16)).logits[0]
    assert cut.shape == full.shape
    assert torch.equal(cut[:, tokens], full[:, tokens])  # fp32: the very same rows of the head
    others = torch.ones(lm.config.vocab_size, dtype=torch.bool)
    others[tokens] = False
    assert torch.isneginf(cut[:, others]).all()
    assert all(a is b for a, b in zip(small.layers, lm.model.layers, strict=True))  # shared, not copied


@pytest.mark.parametrize("k", [40, 128, 257])
def test_greedy_output_is_the_targets(tiny, k):
    lm = tiny.lm
    draft = LoadedModel("cut", lm.model.with_head_over(kept(lm, k)), None, lm.config, lm.fmt)
    gen = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    accepted = 0
    for p in PROMPTS:
        out = generate(lm, p, gen, drafter=ModelDrafter(draft, TreeParams.chain(4)))
        assert out.tokens == generate(lm, p, gen).tokens, f"k={k}, prompt of {len(p)} tokens"
        accepted += sum(s.accepted for s in out.stats.steps)
    assert accepted > 0  # the restricted draft (the target's own layers) was right, and used


class CutToy(Toy):
    """The toy draft with all but `keep` tokens at -inf: q is 0 there, the target's p is not."""

    def __init__(self, keep: list[int]) -> None:
        super().__init__(vocab=7, sampling=T1)
        self.keep = keep

    def draft_logits(self, ctx):
        logits = torch.full((self.vocab,), float("-inf"))
        logits[self.keep] = super().draft_logits(ctx)[self.keep]
        return logits


@pytest.mark.parametrize("widths", [(1, 1), (3, 2)], ids=["chain2", "tree3x2"])
def test_sampling_with_a_restricted_draft_keeps_the_targets_distribution(widths):
    run_and_check(CutToy([0, 2, 3, 5]), sampled_tree(widths), verify_rrs,
                  n=6000, seed=11)


def test_draft_vocab_through_the_sources(tiny_llama, monkeypatch, tmp_path):
    """--draft-vocab K takes the first K of the target's shipped ranking and its end of text (a token the
    ranking need not hold); K past the ranking is an error."""
    rank = tmp_path / "rank.npy"
    np.save(rank, np.arange(256, -1, -1, dtype=np.int32)[:200])
    monkeypatch.setattr(draft_sources, "token_rank_path", lambda name: rank)
    target = tiny_llama.lm
    got = resolve_draft(target, DraftSources(draft=str(tiny_llama.path), draft_dtype="fp32", draft_vocab=50), "cpu")
    assert target.eos_token_ids == (2,)
    assert got.lm.model.head_tokens.tolist() == [2, *range(207, 257)]
    with pytest.raises(SpecstackError, match=r"--draft-vocab must be in \[1, 200\]"):
        resolve_draft(target, DraftSources(draft=str(tiny_llama.path), draft_dtype="fp32", draft_vocab=201), "cpu")
    monkeypatch.setattr(draft_sources, "token_rank_path", lambda name: None)
    with pytest.raises(SpecstackError, match="no token ranking ships"):
        resolve_draft(target, DraftSources(draft=str(tiny_llama.path), draft_dtype="fp32", draft_vocab=5), "cpu")


def test_a_restricted_head_keeps_the_tokenizers_special_tokens(monkeypatch, tmp_path):
    """The chat and end-of-text markers a corpus ranking lacks stay in the cut head (the default model's
    real tokenizer), beside the K ranked tokens."""
    rank = tmp_path / "rank.npy"
    np.save(rank, np.arange(1000, 2000, dtype=np.int32))
    monkeypatch.setattr(draft_sources, "token_rank_path", lambda name: rank)
    lm = load_model("smollm2-135m", dtype="fp32")
    special = set(lm.tokenizer.added_tokens_encoder.values())
    assert special and max(special) < 1000 and set(lm.eos_token_ids) <= special
    cut = restricted_head(lm, lm, 20)
    assert set(cut.model.head_tokens.tolist()) == special | set(range(1000, 1020))


def test_a_registry_default_vocab_cuts_what_it_can(tiny_llama, monkeypatch, tmp_path):
    """A model's registry K (RegisteredModel.draft_vocab) cuts a plain decoder draft's head unless
    --draft-vocab 0 asks for the full one; a draft whose head cannot be cut (a trained SPIRe draft) keeps
    it under the default, and is an error only where K was asked for."""
    rank = tmp_path / "rank.npy"
    np.save(rank, np.arange(256, -1, -1, dtype=np.int32)[:200])
    monkeypatch.setattr(draft_sources, "token_rank_path", lambda name: rank)
    monkeypatch.setattr(draft_sources, "default_draft_vocab", lambda name: 50)
    target = tiny_llama.lm
    plain = str(tiny_llama.path)
    cut = resolve_draft(target, DraftSources.for_model(target.name, plain, "fp32"), "cpu")
    assert cut.lm.model.head_tokens.tolist() == [2, *range(207, 257)]
    full = resolve_draft(target, DraftSources.for_model(target.name, plain, "fp32", draft_vocab=0), "cpu")
    assert full.lm.model.head_tokens is None
    trained = tmp_path / "d.safetensors"
    save_draft(build_draft(target.model, 1, keep=[0], window=WindowSpec(1, 8)), trained)
    kept_whole = resolve_draft(target, DraftSources.for_model(target.name, str(trained), "fp32"), "cpu")
    assert isinstance(kept_whole.lm.model, SpireDraft)
    with pytest.raises(SpecstackError, match="its head cannot be cut"):
        resolve_draft(target, DraftSources.for_model(target.name, str(trained), "fp32", draft_vocab=50), "cpu")


def test_sampled_rows_with_a_restricted_draft_run(tiny_llama):
    """Under sampling the engine runs the cut draft's q (zeros outside its tokens) through RRS."""
    lm = tiny_llama.lm
    draft = LoadedModel("cut", lm.model.with_head_over(kept(lm, 60)), None, lm.config, lm.fmt)
    gen = GenerationConfig(max_new_tokens=16, sampling=SamplingParams(temperature=0.8, seed=3), stop_on_eos=False)
    out = generate(lm, PROMPTS[0], gen, drafter=ModelDrafter(draft, TreeParams.chain(3)))
    assert len(out.tokens) == 16 and all(0 <= t < 257 for t in out.tokens)
