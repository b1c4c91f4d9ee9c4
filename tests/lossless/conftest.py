"""Fixtures for the lossless tests: drafts for the tiny V = 257 targets of tests/conftest.py (a random
one-layer Llama, and the target's own first layer via engine.draft_sources.self_draft), and a tiny V = 8
target/draft pair small enough for chi-square tests over whole token sequences."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_checkpoints import Tiny, llama

from specstack.models.base import LoadedModel
from specstack.models.loading import load_model


def load_fp32(tiny: Tiny, path: Path) -> LoadedModel:
    """`tiny` built into `path`, loaded by specstack in fp32."""
    tiny.save(path)
    return load_model(str(path), dtype="fp32", use_cache=False, tokenizer=False)


@pytest.fixture(scope="session")
def random_draft(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A one-layer Llama with the tiny targets' vocabulary (257) and context (256), other weights."""
    root = tmp_path_factory.mktemp("random-draft")
    return load_fp32(llama(seed=999, vocab=257, layers=1, hidden=32, max_pos=256, init=0.15), root / "d")


@pytest.fixture(scope="session")
def self_drafts(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    """engine.draft_sources.self_draft: each tiny target's first layer plus its final norm and head."""
    from specstack.engine.draft_sources import self_draft

    with pytest.MonkeyPatch.context() as mp:  # self_draft loads through the on-disk weight cache
        mp.setenv("SPECSTACK_CACHE", str(tmp_path_factory.mktemp("specstack-cache")))
        return {arch: self_draft(str(t.path), 1, "fp32", "cpu") for arch, t in tiny_models.items()}


@pytest.fixture(scope="session")
def vocab8(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, LoadedModel]:
    """(target, draft): tiny Llamas with an 8-token vocabulary. A large init spreads the logits so the
    distributions are far from uniform and the draft is often, but not always, right."""
    root = tmp_path_factory.mktemp("vocab8")
    target = load_fp32(llama(seed=11, vocab=8, layers=2, hidden=32, max_pos=64, init=0.5), root / "t")
    draft = load_fp32(llama(seed=12, vocab=8, layers=1, hidden=32, max_pos=64, init=0.5), root / "d")
    return target, draft


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and on a shared machine two spinning threads can slow
    these many small forwards down by an order of magnitude."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def spire_lm(target: LoadedModel, keep: list[int], window=None, feedback: bool = True,
             vocab_ids: torch.Tensor | None = None, mix: str = "random", feature_input: bool = False) -> LoadedModel:
    """A SPIRe draft (specstack.models.spire_draft) pruned from `target`'s blocks `keep`, reading its activations.
    mix: "random" memory mixes, or "own" (one-hot on each block's own input: with every target block
    kept, the draft computes exactly the target)."""
    from specstack.training.prune import build_draft

    draft = build_draft(target.model, n_layers=len(keep), keep=keep, window=window, feedback=feedback,
                        target_acts=True, vocab_ids=vocab_ids, feature_input=feature_input)
    g = torch.Generator().manual_seed(len(keep))
    with torch.no_grad():
        for i, blk in enumerate(draft.layers):
            if mix == "own":
                blk.mix.fill_(-1e4)
                blk.mix[i] = 0.0
            else:
                blk.mix.copy_(torch.randn(blk.mix.shape, generator=g))
        if feature_input:
            draft.fuse.weight.copy_(0.2 * torch.randn(draft.fuse.weight.shape, generator=g))
    draft.eval().requires_grad_(False)
    return LoadedModel("spire", draft, None, draft.config, "fp32")


@pytest.fixture(scope="session")
def spire_drafts(tiny_models) -> dict[str, LoadedModel]:
    """For the tiny Llama target (3 blocks, V = 257): "spire", one block pruned from its last, a
    sliding window of 16 after 1 sink, random feedback mixes, a random feature input and a 200-token
    vocabulary; "spire-int8", the same with int8 weights (the default for trained drafts); "spire-exact",
    all three blocks with one-hot mixes, a perfect draft (its own memories equal the target's)."""
    from specstack.config import WindowSpec

    target = tiny_models["llama"].lm
    vocab = torch.randperm(257, generator=torch.Generator().manual_seed(3))[:200].sort().values
    int8 = spire_lm(target, [2], WindowSpec(1, 16), vocab_ids=vocab, feature_input=True)
    int8.model.quantize_("int8")
    return {"spire": spire_lm(target, [2], WindowSpec(1, 16), vocab_ids=vocab, feature_input=True),
            "spire-int8": int8, "spire-exact": spire_lm(target, [0, 1, 2], mix="own")}
