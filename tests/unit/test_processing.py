"""The logits rules of a request along a draft tree (processing.py, grammar.py, engine/forced.py): every
tree row is processed exactly as a plain decode at that position would be (penalties from the generated
tokens and the node's path, a grammar's mask after the path), the matcher comes back to its committed
state, refused nodes do no harm, forced tokens hang onto the drafter's tree without renumbering it, and
log-probabilities are the raw logits' log-softmax."""
from __future__ import annotations

import json

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specstack.config import GenerationConfig, GrammarSpec, Penalties
from specstack.engine.forced import forced_chain
from specstack.errors import SpecstackError
from specstack.grammar import GrammarCompiler, allowed, apply_masks
from specstack.processing import RowProcessor, path_tokens, token_logprobs, trie
from specstack.tree import DraftTree

V = 8  # a..g and <eos>


def letters_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level single letters a..g (ids 0..6) and <eos> (7): grammars over a countable vocabulary."""
    t = Tokenizer(models.BPE({c: i for i, c in enumerate("abcdefg")}, [], unk_token=None))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken("<eos>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(letters_tokenizer(), V, [7])


def a_tree() -> DraftTree:
    """root -> a(0) -> b(1) -> c(3); a(0) -> a(2); root -> c(4) -> c(5); root -> g(6)"""
    return DraftTree([0, 1, 0, 2, 2, 2, 6], [-1, 0, 0, 1, -1, 4, -1])


def test_path_tokens_list_each_rows_path():
    assert path_tokens(a_tree()) == [[], [0], [0, 1], [0, 0], [0, 1, 2], [2], [2, 2], [6]]


def reference_penalties(logits: torch.Tensor, prompt: list[int], generated: list[int], pen: Penalties) -> torch.Tensor:
    """One row as a plain decode would penalise it, token by token."""
    out = logits.clone()
    for t in range(out.shape[0]):
        n = generated.count(t)
        x = out[t]
        if pen.repetition != 1 and (n or t in prompt):
            x = x / pen.repetition if x > 0 else x * pen.repetition
        out[t] = x - pen.frequency * n - pen.presence * (n > 0)
    return out


@pytest.mark.parametrize("pen", [Penalties(0.5, 0.0, 1.0), Penalties(0.0, 0.7, 1.0), Penalties(0.0, 0.0, 1.3),
                                 Penalties(0.4, -0.3, 1.2)], ids=["presence", "frequency", "repetition", "all"])
def test_penalties_follow_each_rows_path(pen):
    prompt, generated = [4, 5], [0, 2, 2]
    proc = RowProcessor(GenerationConfig(penalties=pen), prompt, V)
    proc.commit(generated)
    tree = a_tree()
    logits = torch.randn(1 + len(tree), V, generator=torch.Generator().manual_seed(3))
    out = proc.process(logits, tree)
    for r, path in enumerate(path_tokens(tree)):
        assert torch.allclose(out[r], reference_penalties(logits[r], prompt, generated + path, pen), atol=1e-6), r
    assert not torch.equal(out, logits)


def test_logit_bias_is_added_to_every_row():
    proc = RowProcessor(GenerationConfig(logit_bias=((3, 5.0), (0, -100.0))), [1], V)
    logits = torch.zeros(3, V)
    out = proc.process(logits, DraftTree.chain([1, 2]))
    assert out[:, 3].tolist() == [5.0] * 3 and out[:, 0].tolist() == [-100.0] * 3 and out[:, 1].abs().sum() == 0


REGEX = "a[bc]|b[de]|[cdef][a-f]"  # the second letter depends on the first


def plain_mask(compiler: GrammarCompiler, spec: GrammarSpec, path: list[int]) -> list[bool]:
    """The allowed tokens after `path` from a fresh matcher (a plain decode's mask)."""
    m = compiler.matcher(spec)
    m.commit(path)
    bits = m.tree_masks(DraftTree())
    return [allowed(bits[0], t) for t in range(V)]


def test_tree_masks_are_each_paths_mask_and_the_matcher_rolls_back(compiler):
    spec = GrammarSpec("regex", REGEX)
    m = compiler.matcher(spec)
    tree = DraftTree([0, 1, 2, 4, 3, 6, 0], [-1, 0, 0, -1, 3, -1, 5])  # a->{b, c}; e->d; g (refused) -> a
    bits = m.tree_masks(tree)
    for r, path in enumerate(path_tokens(tree)):
        if r == 6 or r == 7:  # g is refused at the root: its row and its child's allow everything
            assert all(allowed(bits[r], t) for t in range(V))
        else:
            assert [allowed(bits[r], t) for t in range(V)] == plain_mask(compiler, spec, path), path
    assert [allowed(bits[0], t) for t in range(V)] == [True] * 6 + [False, False]
    assert [allowed(bits[1], t) for t in range(V)] == [False, True, True] + [False] * 5  # after a: b or c
    # the matcher is back at its start: the same masks again, and `b` then `d` still accepted
    assert torch.equal(m.tree_masks(tree), bits)
    m.commit([1, 3])
    assert m.done or [allowed(m.tree_masks(DraftTree())[0], t) for t in range(V)] == [False] * 7 + [True]


def test_masked_rows_never_choose_a_refused_token(compiler):
    spec = GrammarSpec("regex", REGEX)
    proc = RowProcessor(GenerationConfig(grammar=spec), [], V, compiler)
    tree = DraftTree.chain([0])
    logits = torch.zeros(2, V)
    logits[:, 6] = 50.0  # the raw argmax, g, is refused everywhere
    out = proc.process(logits, tree)
    assert out[0].argmax() != 6 and torch.isinf(out[0, 6]) and torch.isinf(out[1, 0])  # after a: not a
    assert torch.isfinite(out[1, 1]) and torch.isfinite(out[1, 2])


def test_forced_tokens_and_commit(compiler):
    m = compiler.matcher(GrammarSpec("lark", 'start: "abc" /[de]/ "f"'))
    assert m.forced() == [0, 1, 2]
    m.commit([0, 1, 2])
    assert m.forced() == []
    m.commit([3])
    assert m.forced() == [5]
    with pytest.raises(SpecstackError, match="refused"):
        m.commit([0])


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
    (GrammarSpec("json_schema", "[1]"), "JSON object"),
    (GrammarSpec("regex", "a(b"), "invalid regex"),
    (GrammarSpec("lark", "start: undefined_rule"), "invalid lark"),
])
def test_a_bad_grammar_is_a_clear_error(compiler, spec, message):
    with pytest.raises(SpecstackError, match=message):
        compiler.matcher(spec)


def test_json_schema_output_is_one_compact_line():
    """JSON_LAYOUT on the default model's tokenizer: no whitespace may open the object, so a schema's
    first key is forced, in the one-line layout (`{"name": `)."""
    from specstack.models.loading import load_tokenizer, model_cache_dir
    from specstack.models.registry import resolve

    src = resolve("smollm2-135m")
    tok = load_tokenizer(src, model_cache_dir(src))
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    m = GrammarCompiler(tok, len(tok), [tok.eos_token_id]).matcher(GrammarSpec("json_schema", json.dumps(schema)))
    assert tok.decode(m.forced()) == '{"name":'
    m.commit(tok.encode('{"name": "x"', add_special_tokens=False))
    assert tok.decode(m.forced()) == ', "n":'


def test_apply_masks_matches_the_bits():
    bits = torch.tensor([[0b101], [-1]], dtype=torch.int32)
    out = apply_masks(torch.zeros(2, 3), bits)
    assert out[0].tolist() == [0.0, float("-inf"), 0.0] and out[1].tolist() == [0.0, 0.0, 0.0]


def test_forced_tokens_are_a_chain_with_evidence_within_the_cap():
    chain = forced_chain([5, 6, 8, 1, 2, 3], cap=5)
    assert chain.tokens == [5, 6, 8, 1, 2] and chain.parent == [-1, 0, 1, 2, 3] and chain.origin == ["grammar"] * 5
    assert chain.evidence == [("grammar", 1), ("grammar", 2), ("grammar", 3), ("grammar", 4), ("grammar", 4)]
    assert chain.q == [None] * 5  # deterministic: verified by sample-walk under sampling
    assert len(forced_chain([5], cap=0)) == 0


def test_token_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    out = token_logprobs(logits, [2, 0, 7], top=3)
    ref = torch.log_softmax(logits, -1)
    for j, (t, lp) in enumerate(zip([2, 0, 7], out, strict=True)):
        assert lp.token == t and abs(lp.logprob - float(ref[j, t])) < 1e-6
        assert [i for i, _ in lp.top] == ref[j].topk(3).indices.tolist()
    assert token_logprobs(logits[:1], [4], top=0)[0].top == ()


def test_an_end_token_in_the_tree_leaves_the_matcher_where_it_was(compiler):
    """llguidance keeps no history of an end token: consuming one in the walk and rolling it back would
    undo the token before it. The walk never consumes it, and the text goes on as committed."""
    m = compiler.matcher(GrammarSpec("regex", "ab|abc"))
    m.commit([0, 1])
    tree = DraftTree([7, 2, 2, 7], [-1, 0, -1, 2])  # <eos> -> c (the draft goes on past the end); c -> <eos>
    bits = m.tree_masks(tree)
    assert [allowed(bits[0], t) for t in range(V)] == [False, False, True] + [False] * 4 + [True]
    assert [allowed(bits[3], t) for t in range(V)] == [False] * 7 + [True]  # after c: the end alone
    m.commit([2, 7])
    assert m.done


def test_trie_rows_are_the_paths_rows():
    tree, rows = trie([[], [0, 1], [0], [2, 2], [0, 1]])
    assert path_tokens(tree) == [[], [0], [0, 1], [2], [2, 2]]
    assert rows == [0, 2, 1, 4, 2]


@pytest.mark.parametrize("columns", [None, [6, 0, 3, 1]], ids=["whole", "reduced"])
def test_a_drafts_rows_get_the_rules_of_their_paths(compiler, columns):
    """`along` (a draft's rows, each after its own path, over the draft's columns) gives each row what
    `process` gives the target's row with the same path: penalties, bias and mask alike."""
    gen = GenerationConfig(penalties=Penalties(0.4, 0.3, 1.2), logit_bias=((3, 2.0),),
                           grammar=GrammarSpec("regex", REGEX))
    proc = RowProcessor(gen, [4, 5], V, compiler)
    tree = DraftTree([0, 1, 2, 4, 3], [-1, 0, 0, -1, 3])  # a->{b, c}; e->d
    paths = path_tokens(tree)
    raw = torch.randn(len(paths), V, generator=torch.Generator().manual_seed(5))
    ids = None if columns is None else torch.tensor(columns)
    rows = raw.flip(0)  # any order of rows: here the paths reversed
    out = proc.along(rows if ids is None else rows[:, ids], paths[::-1], ids)
    want = proc.process(raw, tree).flip(0)
    assert torch.equal(out, want if ids is None else want[:, ids])
    assert not torch.equal(out, rows if ids is None else rows[:, ids])  # the rules did something
    # the processor is back at its committed state
    assert torch.equal(proc.process(raw, tree), want.flip(0))
