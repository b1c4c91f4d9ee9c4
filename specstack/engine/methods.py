"""Decoding methods by name, with parameters: `ar`, `chain:k=4`, `tree:width=4,budget=36,depth=8`,
`ngram`, `staged:budget=36,depth=8`.

A method is one entry of the registry METHODS: a `Method` declaring its name, its integer parameters
(`Param`: default, bounds, what 0 means, a one-line doc), its own check across parameters, the draft
sources it reads, the widest target forward it measures before it runs, its builder
`(target, params, sources, device) -> DrafterFactory | None` (None: autoregressive decoding; the factory
makes one drafter per row, all sharing the draft model and trigram loaded once), and its draft-length
rule for a step of `rows` rows (`length`, drafting/batch_length.py; one row as many). Every parameter
has an upper bound, checked with the others before any model is loaded: a draft size is bounded by
MAX_TREE (validate.py), the most draft tokens the engine verifies per step.
`parse_method` and `build_drafter` only look entries up: nothing here or in the engine branches on a
method's or a drafter's name. To add a method, write its builder and `register` a Method for it.

Draft sources (`DraftSources`, engine/draft_sources.py): where a method's drafts come from.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from specstack.drafting.base import Drafter
from specstack.drafting.batch_length import AsProposed, BassLength, BatchLength, CostAwareLength, ForwardCost
from specstack.drafting.batched_tree import TreeGroup
from specstack.drafting.model import ModelDrafter, TreeParams, chain_members
from specstack.drafting.ngram import STAGED_WIDTHS, NgramDrafter
from specstack.drafting.staged import StagedDrafter
from specstack.engine.batch_cost import batch_costs, width_costs
from specstack.engine.draft_sources import (
    DraftSources,
    load_ngram,
    resolve_draft,
)
from specstack.engine.rows import DrafterFactory
from specstack.errors import SpecstackError
from specstack.models.base import LoadedModel
from specstack.models.registry import MODELS, default_ngram_path
from specstack.validate import MAX_TREE, VERIFIED, bounded_int, fits_context

# ---------------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------------
Params = Mapping[str, int]  # parameter name -> value, every declared parameter present
Builder = Callable[[LoadedModel, Params, DraftSources, str], DrafterFactory | None]  # (target, params, sources, device)
# (target, params, rows) -> the rule sizing each step's drafts (rows: the most rows a step holds)
LengthRule = Callable[[LoadedModel, Params, int], BatchLength]


@dataclass(frozen=True)
class Param:
    """An integer parameter of a method, in [low, high]: every parameter is bounded (a size without a
    bound once ran a drafter for minutes on proposals the engine could never verify)."""

    name: str
    default: int
    doc: str
    low: int = 1  # the smallest value accepted
    high: int = field(kw_only=True)  # the largest
    why: str = ""  # what makes `high` the limit (the error says it)
    zero: str = ""  # what 0 means, where 0 is accepted

    def __post_init__(self) -> None:
        if (self.low <= 0) != bool(self.zero) or not self.low <= self.default <= self.high:
            raise ValueError(f"parameter {self.name}: say what 0 means iff 0 is accepted, and keep the "
                             "default within the bounds")

    def check(self, method: str, text: str) -> int:
        """The value `text` gives this parameter of `method`, checked against the bounds."""
        return bounded_int(f"method {method!r}: {self.name}", text, self.low, self.high, self.why)


def _no_check(_params: Params) -> str | None:
    return None


def _no_measure(_params: Params) -> int:
    return 0


def as_proposed(_target: LoadedModel, _params: Params, _rows: int) -> BatchLength:
    return AsProposed()


@dataclass(frozen=True)
class Method:
    name: str
    doc: str
    build: Builder
    params: tuple[Param, ...] = ()
    # what is wrong with a combination of (each valid) parameters, or None
    check: Callable[[Params], str | None] = _no_check
    # the DraftSources fields the method reads (a source given to a method that reads none is ignored)
    sources: frozenset[str] = frozenset()
    # n > 0: before it runs, the method measures target forwards of widths 1 .. n (its cost curve,
    # engine/batch_cost.py), which must fit the target's context after one token of it
    measures: Callable[[Params], int] = _no_measure
    length: LengthRule = as_proposed
    per_model: bool = False  # True: stands for what the model's registry entry measured fastest (`auto`)

    def defaults(self) -> dict[str, int]:
        return {p.name: p.default for p in self.params}


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is registered twice")
    METHODS[method.name] = method
    return method


@dataclass(frozen=True)
class MethodSpec:
    name: str
    params: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.name + (":" + ",".join(f"{k}={v}" for k, v in self.params.items()) if self.params else "")


def lookup(name: str) -> Method:
    if name not in METHODS:
        raise SpecstackError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return METHODS[name]


def parse_method(text: str) -> MethodSpec:
    """`name[:key=value,...]` -> the method with every parameter (defaults filled in), checked."""
    name, _, rest = text.strip().partition(":")
    entry = lookup(name)
    declared = {p.name: p for p in entry.params}
    params = entry.defaults()
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in declared:
            raise SpecstackError(f"method {name!r}: bad parameter {item!r} (parameters: {', '.join(declared) or 'none'})")
        params[key] = declared[key].check(name, value)
    problem = entry.check(params)
    if problem:
        raise SpecstackError(f"method {name!r}: {problem}")
    return MethodSpec(name, params)


def ignored_sources(method: MethodSpec, sources: DraftSources) -> list[str]:
    """The DraftSources fields given (not None) that `method` does not read: a caller warns of them
    (a script may pass --draft to every method it runs)."""
    reads = lookup(method.name).sources
    return [name for name in ("draft", "draft_dtype", "draft_vocab", "ngram")
            if getattr(sources, name) is not None and name not in reads]


def check_fits(method: MethodSpec, max_seq_len: int) -> None:
    """The widths `method` measures before it runs fit a model of context max_seq_len (one token of
    context, then the widest forward): checked before any draft is loaded or forward timed."""
    widest = lookup(method.name).measures(method.params)
    if widest:
        fits_context(f"method {str(method)!r}: cost=1 measures target forwards of up to {widest} tokens after one "
                     "token of context", widest + 1, max_seq_len)


def drafter_factory(method: MethodSpec, target: LoadedModel, sources: DraftSources,
                    device: str = "cpu") -> DrafterFactory | None:
    """What makes `method`'s drafters (None: autoregressive): its draft model and trigram are loaded
    here, once; each call of the factory makes one more drafter (one per row of a batch) sharing them."""
    method = resolved_auto(method, target.name)
    check_fits(method, target.config.max_seq_len)
    return lookup(method.name).build(target, method.params, sources, device)


def build_drafter(method: MethodSpec, target: LoadedModel, sources: DraftSources,
                  device: str = "cpu") -> Drafter | None:
    make = drafter_factory(method, target, sources, device)
    return None if make is None else make()


def length_rule(method: MethodSpec, target: LoadedModel, rows: int = 1) -> BatchLength:
    """The rule sizing each step's drafts for `method` in steps of up to `rows` rows (a fresh one per
    engine: it learns acceptance rates as it goes)."""
    method = resolved_auto(method, target.name)
    check_fits(method, target.config.max_seq_len)
    return lookup(method.name).length(target, method.params, rows)


# ---------------------------------------------------------------------------------------------------
# The methods
# ---------------------------------------------------------------------------------------------------
# tree and n-gram drafting pauses while the step has this many rows or more and no draft token pays (a
# row alone keeps proposing: its next context match, or a sure tree node, pays); a chain pauses even alone
PAUSE_ROWS = 2
# while a draft model's drafting has not paid in a batch, one row tries it (CostAwareLength.trial_rows): its
# forwards and each row's prompt read into it cost the whole batch
DRAFT_MODEL_TRIAL = 1


def forward_cost(target: LoadedModel, rows: int, widths: int = 0) -> ForwardCost:
    """The target's forward cost per (rows, tokens) for steps of up to `rows` rows, every grid row count
    it needs measured now, and the one-row curve at every width 1 .. `widths` (the widths a lone row's
    rule chooses between; interpolation would blur their steps): once per machine, then stored
    (engine/batch_cost.py), so that no step of a timed run stops to measure."""
    if widths:
        width_costs(target, widths)
    costs = batch_costs(target)
    r = 1
    while True:
        costs.cost(r, r)
        if r >= rows:
            return costs.cost
        r *= 2


def tree_measures(p: Params) -> int:
    """cost=1: the forward costs of widths 1 .. budget + 1 (the root and up to `budget` nodes)."""
    return p["budget"] + 1 if p["cost"] else 0


def build_chain(target: LoadedModel, p: Params, sources: DraftSources, device: str) -> DrafterFactory:
    """Every drafter of the factory is a member of one TreeGroup: in a batch, one draft forward per
    draft step for all rows (drafting/batched_tree.py)."""
    d = resolve_draft(target, sources, device)
    k = max(p["k"], p["max"])  # with BASS's rule the drafter grows up to max, the rule's l limits it
    return chain_members(d.lm, k, d.window, sources.draft_prefix(d.lm))


def chain_length(target: LoadedModel, p: Params, rows: int) -> BatchLength:
    if p["cost"]:  # each draft token costs a draft forward: drafting pauses while none pays (and a greedy chain
        # stops growing where the rule would cut it)
        return CostAwareLength(forward_cost(target, rows), pause=True, trial_rows=DRAFT_MODEL_TRIAL)
    if p["max"]:
        return BassLength(start=p["k"], cap=p["max"])
    return AsProposed()


def check_chain(p: Params) -> str | None:
    if p["max"] and p["max"] < p["k"]:
        return f"BASS's length starts at k and grows to max: need k <= max, got k={p['k']}, max={p['max']}"
    return None


def build_tree(target: LoadedModel, p: Params, sources: DraftSources, device: str) -> DrafterFactory:
    """Every drafter of the factory is a member of one TreeGroup: in a batch, one draft forward per level
    of all rows' trees (drafting/batched_tree.py); shared=0: each its own group (row by row)."""
    d = resolve_draft(target, sources, device)
    shape = TreeParams(p["width"], p["budget"], p["depth"], p["expand"])
    prefix = sources.draft_prefix(d.lm)
    if not p["shared"]:
        return lambda: ModelDrafter(d.lm, shape, window=d.window, prefix=prefix)
    group = TreeGroup(d.lm, d.window, prefix)
    return lambda: ModelDrafter(d.lm, shape, group=group)


def tree_length(target: LoadedModel, p: Params, rows: int) -> BatchLength:
    """cost=1: each step's nodes by their calibrated draft probabilities and the forward's measured cost;
    the rule also sizes each tree while it grows (ctx.size), so a lone row whose nodes do not pay costs a
    catch-up forward, and only a batch's rows pause their drafting while none pays."""
    if p["cost"]:
        return CostAwareLength(forward_cost(target, rows, tree_measures(p)), pause=PAUSE_ROWS,
                               trial_rows=DRAFT_MODEL_TRIAL)
    return AsProposed()


def ngram_measures(p: Params) -> int:
    """cost=1: the forward costs of widths 1 .. max + 1 (the root and a chain of up to `max`)."""
    return p["max"] + 1 if p["cost"] else 0


def build_ngram(target: LoadedModel, p: Params, sources: DraftSources, device: str) -> DrafterFactory:
    trigram = load_ngram(target, sources)
    widths = (1,) * p["max"] if p["max"] else (p["width"],) + (1,) * (p["depth"] - 1)  # max: a chain, cut by the rule
    return lambda: NgramDrafter(trigram, widths=widths, max_n=p["match"])


def ngram_length(target: LoadedModel, p: Params, rows: int) -> BatchLength:
    """cost=1: the chain's length (up to max) by the acceptance rates learned per evidence class and the
    forward's measured cost; max alone: BASS's length from depth up. Proposals cost no target time but are
    not free (lookups for every row add up in a batch): in a batch, while none pays, drafting pauses
    between probes; a lone row keeps looking (its next context match pays)."""
    if p["cost"]:
        return CostAwareLength(forward_cost(target, rows, ngram_measures(p)), longest=p["max"], pause=PAUSE_ROWS)
    if p["max"]:
        return BassLength(start=p["depth"], cap=p["max"])
    return AsProposed()


def check_ngram(p: Params) -> str | None:
    if p["max"] and (p["width"] != 1 or p["depth"] > p["max"]):
        return (f"a dynamic chain (max={p['max']}) needs width=1 and depth <= max, got width={p['width']}, "
                f"depth={p['depth']}")
    if p["cost"] and not p["max"]:
        return f"cost=1 chooses each chain's length up to max=M: give max=M, got cost={p['cost']}, max={p['max']}"
    return None


def build_staged(target: LoadedModel, p: Params, sources: DraftSources, device: str) -> DrafterFactory:
    """As build_tree: the rows' spines share each draft forward (shared=0: row by row); each drafter has
    its own draft2 (the trigram, loaded once, with its row's context)."""
    d = resolve_draft(target, sources, device)
    trigram = load_ngram(target, sources)
    shape = TreeParams(p["width"], p["budget"], p["depth"])
    widths = (1,) * p["d2"] if p["d2"] else STAGED_WIDTHS
    prefix = sources.draft_prefix(d.lm)
    if not p["shared"]:
        return lambda: StagedDrafter(d.lm, NgramDrafter(trigram), shape, widths, d.window, prefix)
    group = TreeGroup(d.lm, d.window, prefix)
    return lambda: StagedDrafter(d.lm, NgramDrafter(trigram), shape, widths, group=group)


# a draft size: no more than MAX_TREE draft tokens are ever verified in one step
def size(name: str, default: int, doc: str, low: int = 1, zero: str = "") -> Param:
    return Param(name, default, doc, low, high=MAX_TREE, why=VERIFIED, zero=zero)


# Index time and memory grow with match² per context token (match=64 takes seconds to index an 8k
# prompt), and a suffix longer than this seldom recurs exactly.
MAX_MATCH = 16
WIDTH = size("width", 4, "c: children per expanded node")
BUDGET = size("budget", 36, "n: nodes the target verifies per step")
DEPTH = size("depth", 8, "D: the tree's maximum depth")
# a tree method's rows share their draft forwards; 0 runs them row by row (the baseline it is measured against)
SHARED = Param("shared", 1, "1: the rows of a step share each draft forward (one a tree level for all rows)", low=0,
               high=1, zero="each row runs its own draft forwards (row by row)")
COST = Param("cost", 0, "1: verify each step only the best nodes that pay for their width, by the draft's path "
             "probabilities and the target's measured forward cost per width", low=0, high=1, zero="all n nodes")
DRAFT = frozenset({"draft", "draft_dtype", "draft_vocab"})  # the DraftSources fields of a draft model
TRIGRAM = frozenset({"ngram"})

register(Method("ar", "autoregressive decoding: the target alone", lambda target, p, sources, device: None))
register(Method("chain", "a chain of k draft tokens, verified in one target forward", build_chain, (
    size("k", 4, "draft tokens per step (with max: the first step's)"),
    size("max", 0, "M: the chain's length follows BASS's rule, shared by the batch, from k up to M", low=0,
         zero="a fixed length"),
    Param("cost", 0, "1: each step verifies the draft tokens that pay for their width, from the batch's measured "
          "forward cost and the draft's probabilities; drafting pauses while none pays", low=0, high=1,
          zero="no cost model"),
), check_chain, sources=DRAFT, length=chain_length))
register(Method("tree", "a best-first tree from the draft model (Spector & Ré 2023)", build_tree,
                (WIDTH, BUDGET, DEPTH, size("expand", 4, "nodes the draft expands in one forward"), COST, SHARED),
                sources=DRAFT, measures=tree_measures, length=tree_length))
# a 3-token chain suits the default int4 target, whose forward cost grows with every token; on a bf16
# target (wide forwards nearly free) width=12,depth=6 accepts more (docs/bench-history)
register(Method("ngram", "proposals from the trigram and the context (prompt lookup), no draft model", build_ngram, (
    size("width", 1, "candidates at the first level (a chain below it)"),
    size("depth", 3, "the proposal's length"),
    size("max", 0, "M: a chain whose length follows BASS's dynamic rule, from depth up to M", low=0,
         zero="a fixed length"),
    Param("cost", 0, "1: the length (up to max) that maximises expected tokens per second, from the target's "
          "measured forward cost per width and acceptance learned per evidence class", low=0, high=1,
          zero="no cost model"),
    # a longer match is both a surer proposal and, for cost=1, sharper evidence
    Param("match", 3, "the longest suffix the context lookup matches", high=MAX_MATCH,
          why="longer suffixes cost match² per token to index"),
), check_ngram, sources=TRIGRAM, measures=ngram_measures, length=ngram_length))
# `auto`, the default: the fastest lossless choice measured on these CPUs, for one row and many
# (docs/bench-history): the cost-aware n-gram chain. Its drafts cost no target time, and its rules verify only
# the tokens that pay (CostAwareLength over the forward's measured cost, one row's width curve or a batch's),
# so it falls back to plain decoding by itself where speculation does not pay. The
# draft-model methods run below `ar` at one row here (docs/bench-history) and are not chosen.
AUTO = "ngram:max=8,cost=1,match=6"


def build_auto(target: LoadedModel, p: Params, sources: DraftSources, device: str) -> DrafterFactory:
    spec = parse_method(AUTO)
    if sources.ngram is None and default_ngram_path(target.name) is None:  # no trigram: the context alone
        return lambda: NgramDrafter(None, widths=(1,) * spec.params["max"], max_n=spec.params["match"])
    return build_ngram(target, spec.params, sources, device)


def auto_text(model_name: str | None) -> str:
    """What `auto` runs for a model: its registry entry's measured choice, else AUTO."""
    entry = MODELS.get(model_name or "")
    return entry.auto if entry is not None and entry.auto else AUTO


def resolved_auto(method: MethodSpec, model_name: str | None) -> MethodSpec:
    """`auto` as the method measured fastest for this model when its registry entry names one (else
    `auto` itself: AUTO, with its fallback for a model without a trigram); any other method as it is."""
    entry = MODELS.get(model_name or "")
    if lookup(method.name).per_model and entry is not None and entry.auto:
        return parse_method(entry.auto)
    return method


def describe(method: MethodSpec, model_name: str | None = None) -> str:
    """The method as the stats line names it: `auto` says what it runs."""
    return f"{method.name} ({auto_text(model_name)})" if lookup(method.name).per_model else str(method)


register(Method("staged", "the draft's tree with draft2 (the trigram) speculating the draft (Spector & Ré 2023)",
                build_staged, (WIDTH, BUDGET, DEPTH, COST, size(
                    "d2", 0, "N: draft2's proposal under each spine token is a chain of N tokens (a narrower "
                    "draft forward: on the 2-core CPU it pays, docs/bench-history)", low=0,
                    zero="the paper's tree (widths 12, 7, 4, 1, 1, 1)"), SHARED),
                sources=DRAFT | TRIGRAM, measures=tree_measures, length=tree_length))
register(Method("auto", f"the fastest lossless choice measured here: {AUTO} (the trigram and context lookup, "
                "each step's length by the measured forward cost)", build_auto, sources=TRIGRAM,
                measures=lambda p: ngram_measures(parse_method(AUTO).params),
                length=lambda target, p, rows: ngram_length(target, parse_method(AUTO).params, rows), per_model=True))
