"""The batch-invariant formats (`w8a8`, models/w8a8.py, and `w4a8`, models/w4a8.py) on whole models: the logits of a token do not
depend on what else shares its forward (a chain of T tokens, a tree, other rows of a batch), bit for
bit, so every method's greedy output equals `ar`'s in these quantized formats exactly as in fp32. The
tiny targets of tests/conftest.py (every block family), then the real default model, where int4 and
bf16 differ from `ar` on near-ties (test_bf16_near_ties.py) and these must not."""
from __future__ import annotations

import random

import pytest
import torch
from tiny_gguf import write_tiny_qwen2_gguf

from specstack.attention import build_batch, tree_batch
from specstack.config import GenerationConfig
from specstack.drafting.model import ModelDrafter, TreeParams
from specstack.engine.batched import BatchEngine, BatchRequest, generate
from specstack.models import w4a8
from specstack.models.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

_rnd = random.Random(88)
PROMPTS = [[_rnd.randrange(3, 257) for _ in range(n)] for n in (1, 5, 12, 33)]
GEN = GenerationConfig(max_new_tokens=24, stop_on_eos=False)


FORMATS = ("w8a8", "w4a8")
# a GGUF in a Q4_K_M file's types (tests/tiny_gguf.py): under w4a8 its layers are k4a8, k6a8 and q8a8
GGUF = ("w4a8", "qwen2-gguf")


@pytest.fixture(scope="module")
def invariant_models(tiny_models, tmp_path_factory):
    models = {(fmt, arch): load_model(str(t.path), dtype=fmt, use_cache=False, tokenizer=False)
              for arch, t in tiny_models.items() for fmt in FORMATS}
    path = tmp_path_factory.mktemp("qwen2-gguf") / "tiny-qwen2.gguf"
    write_tiny_qwen2_gguf(path)
    models[GGUF] = load_model(str(path), dtype="w4a8", use_cache=False, tokenizer=False)
    return models


@pytest.fixture(params=[(f, a) for f in FORMATS for a in ("llama", "gpt2", "qwen2", "qwen3")] + [GGUF], ids="-".join)
def lm(request, invariant_models):
    return invariant_models[request.param]


def test_the_gguf_model_holds_every_w4a8_layer_format(invariant_models):
    """What the GGUF parametrisation covers: where the kernel path has 6-bit and 5-bit groups, Q6_K's (k6a8)
    and Q5_0's (q5a8), the latter with the file's fp16 scales as fp16 on a wide path (w4a8_wide.HALF_SCALES)."""
    layers = [lin for b in invariant_models[GGUF].model.blocks() for lin in (b.qkv, b.o, b.up, b.down)]
    formats = {lin.fmt for lin in layers}
    slow = w4a8.slow_layer_formats()
    assert {"k4a8", "q8a8"} <= formats
    assert all((f in formats) == (f not in slow) for f in ("k6a8", "q5a8")), (formats, slow)
    for lin in layers:
        if lin.fmt == "q5a8":
            assert lin.scales.dtype == (torch.float16 if lin.wide_layout else torch.float32)


def one_by_one(model, prompt: list[int], cont: list[int]) -> torch.Tensor:
    cache = model.new_cache(1)
    model.extend(torch.tensor([prompt]), cache)
    return torch.cat([model.extend(torch.tensor([[t]]), cache).logits[0] for t in cont])


def test_a_chain_scores_each_token_as_one_token_steps_do(lm):
    model = lm.model
    prompt, cont = PROMPTS[2], [_rnd.randrange(257) for _ in range(9)]
    want = one_by_one(model, prompt, cont)
    cache = model.new_cache(1)
    model.extend(torch.tensor([prompt]), cache)
    got = model.forward(torch.tensor([cont]), build_batch(cache, len(cont)), cache).logits[0]
    assert torch.equal(got, want)
    # and the prompt read in one forward equals it read in pieces
    whole = model.extend(torch.tensor([prompt + cont]), model.new_cache(1)).logits[0, len(prompt):]
    assert torch.equal(whole, want)


def test_a_tree_scores_each_path_as_one_token_steps_do(lm):
    model = lm.model
    prompt = PROMPTS[1]
    # root children a, b; a's children c, d; c's child e
    tokens, parents = [11, 22, 33, 44, 55], [-1, -1, 0, 0, 2]
    cache = model.new_cache(1)
    model.extend(torch.tensor([prompt]), cache)
    got = model.forward(torch.tensor([tokens]), tree_batch(cache, parents), cache).logits[0]
    for node, path in [(1, [22]), (3, [11, 44]), (4, [11, 33, 55])]:
        assert torch.equal(got[node], one_by_one(model, prompt, path)[-1]), f"node {node}"


def test_rows_of_a_batch_score_as_each_row_alone(lm):
    model = lm.model
    prompts = [PROMPTS[1], PROMPTS[2][:5], [7, 8, 9, 10, 11]]
    cont = [[3, 4, 5], [6, 7, 8], [9, 10, 11]]
    cache = model.new_cache(3)
    model.extend(torch.tensor(prompts), cache)
    got = model.forward(torch.tensor(cont), build_batch(cache, 3), cache).logits
    for r in range(3):
        assert torch.equal(got[r], one_by_one(model, prompts[r], cont[r])), f"row {r}"


@pytest.mark.parametrize("shape", ["chain4", "tree3-20-5-2"])
def test_speculation_equals_autoregressive(lm, shape):
    params = TreeParams.chain(4) if shape == "chain4" else TreeParams(width=3, budget=20, depth=5, expand_per_forward=2)
    drafter = ModelDrafter(lm, params)  # a perfect draft: every step verifies a full chain or tree
    for prompt in PROMPTS:
        want = generate(lm, prompt, GEN).tokens
        assert generate(lm, prompt, GEN, drafter=drafter).tokens == want


def test_batched_rows_equal_autoregressive(lm):
    alone = {tuple(p): generate(lm, p, GEN).tokens for p in PROMPTS}
    for layout in ("pad", "split"):
        engine = BatchEngine(lm, max_rows=3, max_context=128, layout=layout, step_tokens=24)
        requests = [BatchRequest(p, GEN, drafter=ModelDrafter(lm, TreeParams.chain(3))) for p in PROMPTS]
        requests.append(BatchRequest(PROMPTS[2], GEN))  # a plain row beside the speculating ones
        for req, out in zip(requests, engine.run(requests), strict=True):
            assert out.tokens == alone[tuple(req.prompt_ids)], f"{layout}: prompt of {len(req.prompt_ids)} tokens"
