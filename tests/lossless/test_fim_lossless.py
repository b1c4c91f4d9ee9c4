"""Fill in the middle is lossless (fp32, greedy): on FIM prompts built by fim.py, every speculative method
emits exactly the middle autoregressive decoding does, alone and in a batch of FIM rows of different
lengths, with an editor's indentation stop; and the context drafter, which indexes the whole prompt, takes
tokens from the code after the cursor (a suffix that repeats what comes next is accepted from)."""
from __future__ import annotations

from pathlib import Path

import pytest
from tiny_checkpoints import build_fim_checkpoint

from specstack.config import EditorStops, GenerationConfig
from specstack.engine.batched import BatchEngine, BatchRequest, generate
from specstack.engine.methods import DraftSources, build_drafter, drafter_factory, length_rule, parse_method
from specstack.fim import ExtraFile, encode_fim
from specstack.models.loading import load_model
from specstack.models.registry import fim_template

CASES = [
    ("def area(radius):\n    ", "\n\ndef perimeter(radius):\n    return 2 * math.pi * radius\n", ()),
    ("import os\n\n\nclass Store:\n    def __init__(self, root):\n        ", "\n\n    def path(self, key):\n",
     (ExtraFile("util.py", "def join(a, b):\n    return a + '/' + b\n"),)),
    ("x = [", "]\nprint(x)\n", ()),
]
METHODS = ["chain:k=3", "tree:width=3,budget=12,depth=4,expand=3", "ngram", "ngram:max=6,cost=1,match=3",
           "staged:width=3,budget=16,depth=5"]
NEW = 20


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory):
    path: Path = build_fim_checkpoint(tmp_path_factory.mktemp("fim-lossless"), context=256)
    return load_model(str(path), dtype="fp32")


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    t = fim_template(target.name, target.tokenizer)
    return [encode_fim(target.tokenizer, t, p, s, extra).ids for p, s, extra in CASES]


@pytest.fixture(scope="module")
def sources(target, tmp_path_factory: pytest.TempPathFactory) -> DraftSources:
    """A draft of the target's first layer and a trigram of its tokenizer (over the cases' own code)."""
    from specstack.drafting.katz import KatzTrigram

    streams = [list(target.tokenizer(p + s, add_special_tokens=False).input_ids) for p, s, _ in CASES]
    path = KatzTrigram.train(streams, len(target.tokenizer)).save(tmp_path_factory.mktemp("fim-ngram") / "t.npz")
    return DraftSources.for_model(target.name, "self:1", ngram=str(path))


def gen(**kw: object) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NEW, stop_on_eos=False, **kw)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_fills_the_same_middle_as_ar(target, prompts, sources, method) -> None:
    spec = parse_method(method)
    drafter = build_drafter(spec, target, sources)
    for ids in prompts:
        ref = generate(target, ids, gen())
        got = generate(target, ids, gen(), drafter=drafter, length=length_rule(spec, target))
        assert got.tokens == ref.tokens and got.text == ref.text, method


def test_fim_rows_in_a_batch_with_an_editor_stop(target, prompts, sources) -> None:
    stop = gen(editor=EditorStops(indent=4))
    refs = [generate(target, ids, stop) for ids in prompts]
    spec = parse_method("ngram")
    engine = BatchEngine(target, max_rows=3, max_context=256, length=length_rule(spec, target, 3),
                         drafters=drafter_factory(spec, target, sources, "cpu"))
    got = engine.run([BatchRequest(ids, stop) for ids in prompts])
    assert [(r.text, r.finish_reason) for r in got] == [(r.text, r.finish_reason) for r in refs]


def test_the_context_drafter_reads_the_suffix(target, sources) -> None:
    """The suffix is in the sequence the context drafter indexes: once the middle reaches words the suffix
    holds, it proposes what follows them there (tokens of origin `context`)."""
    from specstack.config import SamplingParams
    from specstack.drafting.base import DraftContext

    tok = target.tokenizer
    t = fim_template(target.name, tok)
    prompt = encode_fim(tok, t, "def f(", "):\n    return alpha_value + beta_value * gamma_value\n").ids
    typed = list(tok("alpha_value + beta_value", add_special_tokens=False).input_ids)
    drafter = build_drafter(parse_method("ngram:depth=4"), target, sources)
    drafter.reset(prompt)
    tree = drafter.propose(DraftContext(prompt + typed, SamplingParams(temperature=0.0)))
    after = list(tok(" * gamma_value", add_special_tokens=False).input_ids)
    chain = [tree.tokens[i] for i in range(len(tree)) if tree.origin[i] == "context"]
    assert chain[: len(after)] == after[: len(chain)] and chain, (chain, after)
