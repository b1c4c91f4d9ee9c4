"""DraftTree as data (DESIGN §4); the candidate tree the model drafters share (drafting/candidates.py),
worked by hand; and the model drafter's best-first tree builder checked against an independent
oracle: the `budget` nodes of highest cumulative draft probability in the full top-`width` tree of
depth `depth`, computed here with from-scratch forwards of every path."""
from __future__ import annotations

import heapq
import random

import pytest
import torch

from specstack.attention import ancestor_mask
from specstack.config import SamplingParams
from specstack.drafting.base import DraftContext
from specstack.drafting.candidates import CandidateTree, ChildPicker, Columns, NextTokens, children_of
from specstack.drafting.model import ModelDrafter, TreeParams
from specstack.models.base import ModelOutput
from specstack.sampling import warp
from specstack.tree import DraftTree
from specstack.verify import VerifyResult


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def example() -> DraftTree:
    # root -> n0 -> {n2, n3}; root -> n1 -> n4 -> n5
    return DraftTree([3, 1, 2, 4, 0, 6], [-1, -1, 0, 0, 1, 4])


# -- DraftTree ------------------------------------------------------------------------------------
@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 2, 0], [-2], [-1, 0, 5]])
def test_parents_must_precede_their_children(parents):
    with pytest.raises(ValueError):
        DraftTree(list(range(len(parents))), parents)


def test_fields_need_one_entry_per_node_and_default_sensibly():
    with pytest.raises(ValueError):
        DraftTree([1, 2], [-1])
    with pytest.raises(ValueError):
        DraftTree([1, 2], [-1, 0], origin=["draft"])
    with pytest.raises(ValueError):
        DraftTree([1, 2], [-1, 0], q=[None])
    t = DraftTree([1, 2], [-1, 0])
    assert t.origin == ["draft", "draft"] and t.q == [None, None] and len(t) == 2
    with pytest.raises(ValueError):
        t.add(5, 2)  # node 2 does not exist yet
    assert t.add(5, 1, "draft2") == 2 and t.parent == [-1, 0, 1] and t.origin[2] == "draft2"
    assert t.add(7, -1) == 3


def test_paths_children_depth_and_mask():
    t = example()
    assert t.depth == [1, 1, 2, 2, 2, 3]
    assert t.children(-1) == [0, 1] and t.children(0) == [2, 3] and t.children(5) == []
    assert t.path_to(-1) == [] and t.path_to(3) == [0, 3] and t.path_to(5) == [1, 4, 5]
    assert t.paths() == [[0, 2], [0, 3], [1, 4, 5]]
    assert torch.equal(t.mask(), ancestor_mask(t.parent))
    assert DraftTree().paths() == [] and len(DraftTree()) == 0


def test_truncated_is_a_prefix_closed_tree():
    rnd = random.Random(3)
    for _ in range(50):
        n = rnd.randint(0, 15)
        parents = [rnd.randint(-1, i - 1) for i in range(n)]
        q = [torch.rand(4) for _ in range(n)]
        t = DraftTree([rnd.randrange(9) for _ in range(n)], parents, ["draft"] * n, q)
        for m in range(n + 2):
            s = t.truncated(m)
            k = min(m, n)
            assert len(s) == k
            assert s.tokens == t.tokens[:k] and s.parent == t.parent[:k] and s.q[:k] == t.q[:k]
            kept = set(range(k))
            for i in range(k):  # every kept node's whole path is kept
                assert set(s.path_to(i)) <= kept
                assert s.path_to(i) == t.path_to(i)
    assert example().truncated(0).tokens == []


def test_chain():
    t = DraftTree.chain([5, 6, 7], origin="context")
    assert t.tokens == [5, 6, 7] and t.parent == [-1, 0, 1] and t.depth == [1, 2, 3]
    assert t.paths() == [[0, 1, 2]] and t.origin == ["context"] * 3
    assert DraftTree.chain([]).tokens == []


# -- the candidate tree ---------------------------------------------------------------------------
def test_candidates_are_scored_by_their_path_and_selected_best_first():
    cands = CandidateTree()
    cands.add_children(-1, [(5, 0.5), (7, 0.25)], None)  # 0: 5 (0.5), 1: 7 (0.25)
    cands.add_children(0, [(8, 0.5), (5, 0.25)], None)  # 2: 8 (0.25), 3: 5 (0.125)
    cands.add_children(-1, [(7, 0.75), (9, 0.125)], None)  # 7 is kept as it was; 4: 9 (0.125)
    assert [c.token for c in cands.nodes] == [5, 7, 8, 5, 9]
    assert [c.score for c in cands.nodes] == [0.5, 0.25, 0.25, 0.125, 0.125]
    assert [c.parent for c in cands.nodes] == [-1, -1, 0, 0, -1] and not any(c.expanded for c in cands.nodes)
    assert cands.child(0, 5) == 3 and cands.child(-1, 7) == 1 and cands.child(-1, 8) is None
    assert cands.path(3) == [0, 3] and cands.path(-1) == [] and cands.depth(3) == 2 and cands.depth(-1) == 0
    assert cands.score(-1) == 1.0 and cands.score(2) == 0.25
    assert cands.best(3) == [0, 1, 2] and cands.best(9) == [0, 1, 2, 3, 4]  # ties: older first
    tree = cands.draft_tree([0, 2, 3])
    assert tree.tokens == [5, 8, 5] and tree.parent == [-1, 0, 0] and tree.q == [None] * 3


def test_sampled_candidates_rank_by_their_parent_in_draw_order():
    """A node carrying q is kept or dropped by its parent's score and its draw order, never by its own
    drawn token's probability (that would bias recursive rejection sampling)."""
    q = torch.tensor([0.875, 0.125])
    cands = CandidateTree()
    cands.add_children(-1, [(1, 0.125), (0, 0.875)], q)  # drawn first: the unlikely token
    cands.add_children(1, [(1, 0.125)], q)
    assert [cands.rank(i) for i in range(3)] == [1.0, 1.0, 0.875]
    assert cands.best(1) == [0] and cands.best(2) == [0, 1]
    assert cands.draft_tree([0, 1, 2]).q == [q, q, q]


def test_next_tokens_map_a_reduced_vocabulary():
    cols = Columns.of(torch.tensor([3, 7, 9]), 10)
    probs = torch.tensor([[0.125, 0.5, 0.375], [0.5, 0.0, 0.5]])
    nt = NextTokens(probs, cols, children_of(probs, 2, SamplingParams(), None))
    assert nt.children(0) == [(7, 0.5), (9, 0.375)] and nt.best(0) == 7
    assert nt.prob(0, 9) == 0.375 and nt.prob(0, 4) == 0.0  # 4: not a draft token
    assert torch.equal(nt.q(1), torch.tensor([0, 0, 0, 0.5, 0, 0, 0, 0, 0, 0.5]))
    assert len(NextTokens(probs, cols, children_of(probs, 3, SamplingParams(), None)).children(1)) == 2  # no p = 0
    picker = ChildPicker(2, 10)
    out = ModelOutput(probs.log()[None], vocab_ids=cols.id_tensor)
    first, second = (picker.pick(out, DraftContext([], SamplingParams())) for _ in range(2))
    assert first.columns is second.columns and first.columns.ids == [3, 7, 9]  # mapped once
    assert first.children(0) == [(7, 0.5), (9, 0.375)]


# -- the model drafter's tree ---------------------------------------------------------------------
PROMPTS = [[17, 4, 250, 9, 33, 61, 2, 118], [5], [100, 101, 102, 100, 101]]


def draft_probs(lm, context: list[int], sampling: SamplingParams | None = None) -> torch.Tensor:
    """The draft's next-token distribution after `context`, from one plain causal forward."""
    model = lm.model
    logits = model.extend(torch.tensor([context]), model.new_cache(1)).logits[0, -1]
    return torch.softmax(logits, -1) if sampling is None else warp(logits, sampling)


def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    return [tuple(tree.tokens[j] for j in tree.path_to(i)) for i in range(len(tree))]


def oracle_best_first(lm, prompt: list[int], params: TreeParams) -> set[tuple[int, ...]]:
    """Top-`budget` token paths by cumulative probability in the full tree where every node of depth
    < D has its top-`width` tokens as children (a child never outscores its parent, so popping a heap
    `budget` times finds them)."""
    heap: list[tuple[float, tuple[int, ...]]] = []

    def push_children(path: tuple[int, ...], score: float) -> None:
        probs = draft_probs(lm, prompt + list(path))
        for tok in torch.topk(probs, params.width).indices.tolist():
            heapq.heappush(heap, (-score * float(probs[tok]), path + (tok,)))

    push_children((), 1.0)
    chosen = set()
    while heap and len(chosen) < params.budget:
        neg, path = heapq.heappop(heap)
        chosen.add(path)
        if len(path) < params.depth:
            push_children(path, -neg)
    return chosen


def check_shape(tree: DraftTree, params: TreeParams) -> None:
    assert 1 <= len(tree) <= params.budget
    assert max(tree.depth) <= params.depth
    for node in [-1] + list(range(len(tree))):
        kids = tree.children(node)
        assert len(kids) <= params.width
        assert len({tree.tokens[k] for k in kids}) == len(kids), "duplicate sibling tokens"


def propose(drafter: ModelDrafter, prompt: list[int], sampling: SamplingParams,
            g: torch.Generator | None = None) -> DraftTree:
    drafter.reset(prompt)
    return drafter.propose(DraftContext(list(prompt), sampling, g))


@pytest.mark.parametrize("params", [TreeParams(4, 36, 8, 4), TreeParams(2, 10, 5, 1), TreeParams(3, 20, 4, 2),
                                    TreeParams(3, 7, 8, 1)], ids=str)
def test_greedy_tree_is_the_best_first_oracle(tiny_llama, params):
    lm = tiny_llama.lm
    drafter = ModelDrafter(lm, params)
    for prompt in PROMPTS:
        tree = propose(drafter, prompt, SamplingParams())
        check_shape(tree, params)
        assert all(q is None for q in tree.q)
        assert set(node_paths(tree)) == oracle_best_first(lm, prompt, params)
        assert len(tree) == params.budget  # the full tree is larger than the budget here
        # the first path (first child at every level) is the draft's greedy continuation
        node, ctx = -1, list(prompt)
        while tree.children(node):
            node = tree.children(node)[0]
            assert tree.tokens[node] == int(draft_probs(lm, ctx).argmax())
            ctx.append(tree.tokens[node])
        assert len(ctx) > len(prompt)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_chain_is_the_drafts_greedy_decoding(tiny_gpt2, k):
    lm = tiny_gpt2.lm
    drafter = ModelDrafter(lm, TreeParams.chain(k))
    prompt = PROMPTS[0]
    tree = propose(drafter, prompt, SamplingParams())
    assert tree.parent == list(range(-1, k - 1))
    ctx = list(prompt)
    for tok in tree.tokens:
        assert tok == int(draft_probs(lm, ctx).argmax())
        ctx.append(tok)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=20, top_p=0.9)],
                         ids=["t1", "t0.8-k20-p0.9"])
@pytest.mark.parametrize("params", [TreeParams(4, 12, 4, 2), TreeParams.chain(4)], ids=str)
def test_sampled_tree_carries_the_warped_draft_q(tiny_llama, sampling, params):
    """Each node carries q = warp(draft logits at its parent's context) (the one warp), with q > 0 for
    its token, and siblings are distinct draws (without replacement)."""
    lm = tiny_llama.lm
    drafter = ModelDrafter(lm, params)
    g = torch.Generator().manual_seed(0)
    for prompt in PROMPTS[:2]:
        tree = propose(drafter, prompt, sampling, g)
        check_shape(tree, params)
        for i, path in enumerate(node_paths(tree)):
            q = tree.q[i]
            assert q is not None and q[tree.tokens[i]] > 0
            torch.testing.assert_close(q, draft_probs(lm, prompt + list(path[:-1]), sampling), atol=1e-5, rtol=1e-4)
        for node in [-1] + list(range(len(tree))):  # siblings share their parent's q
            kids = tree.children(node)
            assert all(tree.q[k] is tree.q[kids[0]] for k in kids)


@pytest.mark.parametrize("params", [TreeParams(3, 15, 5, 2), TreeParams.chain(3)], ids=str)
def test_observe_keeps_the_draft_cache_exact(tiny_gpt2, params):
    """After observe(), the next proposal equals a fresh drafter's proposal on the whole context: the
    draft's cache holds exactly the accepted tokens (DESIGN §2.4), whatever path was accepted."""
    lm = tiny_gpt2.lm
    drafter = ModelDrafter(lm, params)
    fresh = ModelDrafter(lm, params)
    sp = SamplingParams()
    ctx = list(PROMPTS[0])
    drafter.reset(ctx)
    rnd = random.Random(1)
    for _ in range(6):
        tree = drafter.propose(DraftContext(list(ctx), sp))
        assert [node_paths(tree), tree.parent] == [node_paths(f := propose(fresh, ctx, sp)), f.parent]
        # accept a random root-to-node path (possibly empty), then one "target" token
        path = tree.path_to(rnd.randrange(len(tree)))[: rnd.randint(0, 3)]
        result = VerifyResult(path, [tree.tokens[i] for i in path] + [rnd.randrange(257)])
        drafter.observe(tree, result)
        ctx += result.tokens


class Successors:
    """draft2 stand-in: proposals that are a fixed function of the context (widths as asked)."""

    def reset(self, prompt_ids) -> None:
        pass

    def proposal_tree(self, context, widths) -> DraftTree:
        tree, parent = DraftTree(), -1
        for d, w in enumerate(widths):
            first = tree.add((context[-1] * 7 + d) % 257, parent, "draft2")
            for j in range(1, w):
                tree.add((context[-1] * 7 + d + 31 * j) % 257, parent, "draft2")
            parent = first
        return tree


@pytest.mark.parametrize("kind, sampling", [("tree", SamplingParams()), ("tree", SamplingParams(temperature=1.0)),
                                            ("staged", SamplingParams())], ids=["tree", "tree-sampled", "staged"])
def test_a_groups_members_propose_what_lone_drafters_propose(tiny_llama, kind, sampling):
    """Members of a TreeGroup drafting together (one packed catch-up with the long prompts read ahead, one
    packed forward a level, a mask per row) propose the trees lone drafters of the same draft propose: the
    same nodes, path probabilities and q, round after round, whatever paths were accepted. A row seeing
    another row's slots, its padding, or the wrong positions changes the probabilities."""
    from specstack.drafting.batched_tree import TreeGroup
    from specstack.drafting.staged import StagedDrafter

    lm = tiny_llama.lm
    params = TreeParams(3, 15, 5, 2)  # a pending chain over depth + 2 = 7 tokens is read ahead in a group

    def make(group=None):
        if kind == "staged":
            return StagedDrafter(lm, Successors(), params, widths=(3, 2, 1), group=group)
        return ModelDrafter(lm, params, group=group)

    group = TreeGroup(lm)
    tokens_run: list[tuple[int, int]] = []  # (tokens the draft forward read, real tokens among them)
    forward = group.state.forward

    def counting(ids, batch, logit_rows):
        tokens_run.append((ids.numel(), sum(batch.n_valid)))
        return forward(ids, batch, logit_rows)

    group.state.forward = counting
    prompts = [PROMPTS[0], PROMPTS[1], [(7 * i) % 251 + 3 for i in range(20)], PROMPTS[2]]
    members, lones = [make(group) for _ in prompts], [make() for _ in prompts]
    ctxs = [list(p) for p in prompts]
    for d, p in zip(members + lones, prompts + prompts, strict=True):
        d.reset(p)
    seeds = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    again = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    rnd = random.Random(3)
    for _ in range(5):
        trees = group.propose_rows(members, [DraftContext(list(c), sampling, g) for c, g in zip(ctxs, seeds, strict=True)])
        for i, (lone, ctx, tree) in enumerate(zip(lones, ctxs, trees, strict=True)):
            ref = lone.propose(DraftContext(list(ctx), sampling, again[i]))
            assert (tree.tokens, tree.parent, tree.origin) == (ref.tokens, ref.parent, ref.origin), f"row {i}"
            assert tree.confidence == pytest.approx(ref.confidence, abs=1e-5)
            for q, q_ref in zip(tree.q, ref.q, strict=True):
                assert (q is None) == (q_ref is None)
                if q is not None:
                    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-4)
            path = tree.path_to(rnd.randrange(len(tree)))[: rnd.randint(0, 4)]
            result = VerifyResult(path, [tree.tokens[a] for a in path] + [rnd.randrange(257)])
            members[i].observe(tree, result)
            lone.observe(ref, result)
            ctx += result.tokens
    assert group.draft_forwards() < sum(lone.group.draft_forwards() for lone in lones)
    # rows' levels and pending chains are packed: no forward reads a padding token (rows' levels differ in
    # width, and a row whose tree is grown takes none)
    assert tokens_run and all(read == real for read, real in tokens_run), tokens_run


def ordered_draw_probability(p: list[float], draws: tuple[int, ...]) -> float:
    """The probability that sampling without replacement from p draws `draws`, in that order."""
    left, prob = 1.0, 1.0
    for c in draws:
        prob *= p[c] / left
        left -= p[c]
    return prob


@pytest.mark.parametrize("vocab", [5, 60])  # every column positive; 5 positive of 60 (behind top-k / top-p)
def test_sampled_children_are_draws_without_replacement_in_draw_order(vocab):
    """children_of under sampling: each row's `width` children are ordered draws without replacement from
    its row (chi-square over every ordered triple), never a zero-probability column, the rows of a block
    drawn apart (a row with fewer positive columns than the width, next to a wider one)."""
    from scipy.stats import chisquare

    p = [0.4, 0.25, 0.2, 0.1, 0.05]
    probs = torch.zeros(2, vocab)
    cols = [0, 1, 2, 3, 4] if vocab == 5 else [3, 17, 0, 42, 59]
    probs[0, cols] = torch.tensor(p)
    probs[1, [7 % vocab, 0]] = torch.tensor([0.7, 0.3])  # two positive columns, one of them column 0 (the
    # race pads a short row with column 0): two children, not three
    if vocab == 5:
        probs[1] = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2])
    g = torch.Generator().manual_seed(11)
    counts: dict[tuple[int, ...], int] = {}
    n = 6000
    for _ in range(n):
        kids = children_of(probs, 3, SamplingParams(temperature=1.0), g)
        draws = tuple(cols.index(c) for c, _ in kids[0])
        assert [v for _, v in kids[0]] == pytest.approx([p[d] for d in draws])
        counts[draws] = counts.get(draws, 0) + 1
        second = [c for c, _ in kids[1]]
        assert len(set(second)) == len(second) and all(probs[1, c] > 0 for c in second)
        assert len(second) == (3 if vocab == 5 else 2)
    triples = [(a, b, c) for a in range(5) for b in range(5) for c in range(5) if len({a, b, c}) == 3]
    assert set(counts) <= set(triples)
    expected = [n * ordered_draw_probability(p, t) for t in triples]
    _, pvalue = chisquare([counts.get(t, 0) for t in triples], expected)
    assert pvalue > 1e-3, pvalue
