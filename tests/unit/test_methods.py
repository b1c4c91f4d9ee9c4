"""The method registry (engine/methods.py), draft specs (models/drafts.py), the per-model registry entry
(models/registry.py) and the self-draft constructor (Transformer.first_layers)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import specstack.engine.methods as methods
from specstack.config import GenerationConfig
from specstack.drafting.model import ModelDrafter, TreeParams
from specstack.engine.batched import generate
from specstack.engine.methods import (
    MAX_MATCH,
    METHODS,
    DraftSources,
    Method,
    MethodSpec,
    Param,
    build_drafter,
    check_fits,
    ignored_sources,
    parse_method,
    register,
    resolve_draft,
)
from specstack.errors import SpecstackError
from specstack.models.drafts import DraftKind, DraftSpec, choose_draft, fallback_draft, shipped_draft
from specstack.models.registry import DATA_DIR, MODELS, default_draft_path, default_ngram_path, resolve
from specstack.validate import MAX_TREE


# ---------------------------------------------------------------------------------------------------
# parse_method: every entry is checked by the same generic code
# ---------------------------------------------------------------------------------------------------
def test_defaults_are_filled_in_and_given_values_kept():
    assert parse_method("ar") == MethodSpec("ar", {})
    assert parse_method(" chain ") == MethodSpec("chain", {"k": 4, "max": 0, "cost": 0})
    assert parse_method("tree:budget=12, depth=4") == MethodSpec(
        "tree", {"width": 4, "budget": 12, "depth": 4, "expand": 4, "cost": 0, "shared": 1})
    assert str(parse_method("staged:d2=3")) == "staged:width=4,budget=36,depth=8,cost=0,d2=3,shared=1"
    assert list(METHODS) == ["ar", "chain", "tree", "ngram", "staged", "auto"]


@pytest.mark.parametrize("text, message", [
    ("nope", "unknown method 'nope'; choose from ar, chain, tree, ngram, staged, auto"),
    ("ar:k=1", "method 'ar': bad parameter 'k=1' (parameters: none)"),
    ("chain:q=1", "method 'chain': bad parameter 'q=1' (parameters: k, max, cost)"),
    ("chain:k", "method 'chain': bad parameter 'k' (parameters: k, max, cost)"),
    ("chain:k=8,max=4", "method 'chain': BASS's length starts at k and grows to max: need k <= max"),
    ("chain:k=two", "method 'chain': k must be an integer, got 'two'"),
    ("chain:k=0", "method 'chain': k must be >= 1, got 0"),
    ("ngram:depth=0", "method 'ngram': depth must be >= 1, got 0"),
    ("ngram:max=-1", "method 'ngram': max must be >= 0, got -1"),
    ("tree:cost=2", "method 'tree': cost is 0 or 1, got 2"),
    ("ngram:max=8,cost=2", "method 'ngram': cost is 0 or 1, got 2"),
    ("staged:cost=2", "method 'staged': cost is 0 or 1, got 2"),
    ("ngram:width=4,max=8", "method 'ngram': a dynamic chain (max=8) needs width=1 and depth <= max"),
    ("ngram:depth=9,max=8", "depth <= max, got width=1, depth=9"),
    ("ngram:cost=1", "method 'ngram': cost=1 chooses each chain's length up to max=M: give max=M"),
    ("chain:k=65", "method 'chain': k must be <= 64, got 65 (the target verifies at most 64 draft tokens per step)"),
    ("tree:budget=100000", "method 'tree': budget must be <= 64, got 100000"),
    ("ngram:max=10000,cost=1", "method 'ngram': max must be <= 64, got 10000"),
    ("ngram:match=17", "method 'ngram': match must be <= 16, got 17 (longer suffixes cost match² per token to index)"),
    ("chain:k=1" + "0" * 4400, "method 'chain': k is far too large (4401 digits)"),
    ("chain:k=4.0", "method 'chain': k must be an integer, got '4.0'"),
])
def test_bad_methods_are_rejected_with_their_message(text, message):
    with pytest.raises(SpecstackError) as e:
        parse_method(text)
    assert message in str(e.value)


def test_a_parameter_must_say_what_zero_means_and_fit_its_bounds():
    with pytest.raises(ValueError, match="what 0 means"):
        Param("off", 0, "zero allowed, meaning undeclared", low=0, high=1)
    with pytest.raises(ValueError, match="within the bounds"):
        Param("k", 0, "default below the bound", high=4)
    with pytest.raises(ValueError, match="within the bounds"):
        Param("k", 8, "default above the bound", high=4)
    with pytest.raises(TypeError, match="high"):
        Param("k", 1, "no upper bound")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="registered twice"):
        register(Method("chain", "again", build_drafter))


def test_every_draft_size_is_bounded_by_what_the_engine_verifies():
    """No registered parameter can ask for more than MAX_TREE draft tokens per step (the engine
    verifies no more), except match, which sizes the context index, not the proposal."""
    for method in METHODS.values():
        for p in method.params:
            assert p.high <= (MAX_MATCH if p.name == "match" else MAX_TREE), (method.name, p.name)
            assert p.high == 1 or p.why, (method.name, p.name)  # the error says why


@pytest.mark.parametrize("text, widest", [
    ("ar", 0), ("chain:k=64", 0), ("tree:budget=20", 0), ("tree:budget=20,cost=1", 21),
    ("staged:budget=64,cost=1", 65), ("ngram:max=8", 0), ("ngram:max=8,cost=1", 9),
])
def test_a_cost_curve_must_fit_the_context(text, widest):
    method = parse_method(text)
    assert METHODS[method.name].measures(method.params) == widest
    check_fits(method, widest + 1)  # one token of context, then the widest forward
    if widest:
        with pytest.raises(SpecstackError, match=f"up to {widest} tokens after one token of context: "
                                                 f"{widest + 1} positions, over the model's context of {widest}"):
            check_fits(method, widest)


def test_build_drafter_checks_the_context_before_it_builds(registry, tiny_llama):
    register(Method("wide", "measures a curve", lambda *a: pytest.fail("built"), (Param("n", 1, "n", high=1000),),
                    measures=lambda p: p["n"]))
    with pytest.raises(SpecstackError, match="over the model's context of 256 tokens"):
        build_drafter(parse_method("wide:n=256"), tiny_llama.lm, DraftSources())


@pytest.mark.parametrize("text, ignored", [
    ("ar", ["draft", "draft_dtype", "ngram"]), ("chain", ["ngram"]), ("tree", ["ngram"]),
    ("ngram", ["draft", "draft_dtype"]), ("staged", []),
])
def test_ignored_sources_are_the_given_ones_a_method_does_not_read(text, ignored):
    given = DraftSources("self:1", "fp32", "t.npz")
    assert ignored_sources(parse_method(text), given) == ignored
    assert ignored_sources(parse_method(text), DraftSources()) == []  # nothing given, nothing ignored


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry for one test: whatever it registers is gone afterwards."""
    monkeypatch.setattr(methods, "METHODS", dict(METHODS))
    return methods.METHODS


def test_a_new_method_is_one_registered_entry(registry, tiny_llama):
    """A toy method (the target drafting for itself in chains of even length) needs only a builder
    and its entry: parse_method checks it, build_drafter builds it, and it decodes losslessly."""
    built = []

    def build(target, p, sources, device):
        built.append((p["k"], sources, device))
        return lambda: ModelDrafter(target, TreeParams.chain(p["k"]))

    register(Method("mirror", "the target drafts for itself", build, (Param("k", 2, "draft tokens", high=6),),
                    check=lambda p: f"k must be even, got {p['k']}" if p["k"] % 2 else None))
    assert "mirror" not in METHODS  # registered in the test's copy only
    spec = parse_method("mirror:k=4")
    assert spec == MethodSpec("mirror", {"k": 4})
    for text, message in (("mirror:k=3", "method 'mirror': k must be even, got 3"),
                          ("mirror:k=8", "method 'mirror': k must be <= 6, got 8"),
                          ("mirror:j=2", "(parameters: k)")):
        with pytest.raises(SpecstackError) as e:
            parse_method(text)
        assert message in str(e.value)
    drafter = build_drafter(spec, tiny_llama.lm, DraftSources(), "cpu")
    assert built == [(4, DraftSources(), "cpu")]
    gen = GenerationConfig(max_new_tokens=12, stop_on_eos=False)
    ids = [5, 9, 3, 7]
    out = generate(tiny_llama.lm, ids, gen, drafter=drafter)
    assert out.tokens == generate(tiny_llama.lm, ids, gen).tokens
    assert [st.accepted for st in out.stats.steps][:2] == [4, 4]  # a perfect draft: whole chains accepted


def test_an_unregistered_spec_cannot_be_built(tiny_llama):
    with pytest.raises(SpecstackError, match="unknown method 'mirror'"):
        build_drafter(MethodSpec("mirror", {}), tiny_llama.lm, DraftSources())


# ---------------------------------------------------------------------------------------------------
# Draft specs
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, spec", [
    ("default", DraftSpec(DraftKind.DEFAULT)),
    ("self:3", DraftSpec(DraftKind.SELF, size=3)),
    ("magicdec:64", DraftSpec(DraftKind.MAGICDEC, size=64)),
    ("out/draft.safetensors", DraftSpec(DraftKind.FILE, source="out/draft.safetensors")),
    ("HuggingFaceTB/SmolLM2-135M", DraftSpec(DraftKind.MODEL, source="HuggingFaceTB/SmolLM2-135M")),
    ("self", DraftSpec(DraftKind.MODEL, source="self")),  # no colon: a model named so
])
def test_draft_specs_parse_and_print_back(text, spec):
    assert DraftSpec.parse(text) == spec
    assert str(spec) == text


@pytest.mark.parametrize("text, message", [
    ("self:x", "--draft 'self:x': expected self:N with N >= 1 layers"),
    ("self:0", "--draft 'self:0': expected self:N with N >= 1 layers"),
    ("magicdec:", "--draft 'magicdec:': expected magicdec:W with a window of W >= 1 tokens"),
    ("magicdec:-4", "expected magicdec:W"),
    (" ", "--draft is empty"),
])
def test_bad_draft_specs_are_rejected(text, message):
    with pytest.raises(SpecstackError) as e:
        DraftSpec.parse(text)
    assert message in str(e.value)


def test_default_resolves_to_the_shipped_file_only():
    spec = DraftSpec.parse("default").resolved("smollm2-135m")
    assert spec == DraftSpec(DraftKind.FILE, source=str(DATA_DIR / MODELS["smollm2-135m"].draft))
    assert DraftSpec.parse("self:2").resolved("smollm2-135m") == DraftSpec(DraftKind.SELF, size=2)
    with pytest.raises(SpecstackError, match="no trained draft ships for tiny"):
        DraftSpec.parse("default").resolved("tiny")


def test_a_named_draft_resolves_to_the_file_its_model_ships():
    """`--draft spire`: the draft the target's registry entry names, a clear error for a target naming none."""
    assert DraftSpec.parse("spire") == DraftSpec(DraftKind.NAMED, source="spire") and str(DraftSpec.parse("spire")) == "spire"
    spec = DraftSpec.parse("spire").resolved("smollm2-135m")
    assert spec == DraftSpec(DraftKind.FILE, source=str(DATA_DIR / MODELS["smollm2-135m"].drafts["spire"]))
    assert Path(spec.source).is_file()
    with pytest.raises(SpecstackError, match="no draft named 'spire' ships for qwen2.5-coder-1.5b \\(its named drafts: none\\)"):
        DraftSpec.parse("spire").resolved("qwen2.5-coder-1.5b")
    with pytest.raises(SpecstackError, match="no draft named 'spire' ships for some/model"):
        DraftSpec.parse("spire").resolved("some/model")
    assert DraftSpec.parse("./spire") == DraftSpec(DraftKind.MODEL, source="./spire")  # a folder so named


def test_the_fallback_is_the_first_eighth_of_the_blocks():
    assert [fallback_draft(n).size for n in (1, 7, 8, 16, 30)] == [1, 1, 1, 2, 3]
    assert choose_draft("magicdec:8", 30, "smollm2-135m") == DraftSpec(DraftKind.MAGICDEC, size=8)
    assert choose_draft(None, 30, "smollm2-135m") == DraftSpec(DraftKind.DEFAULT)  # it ships one
    assert choose_draft(None, 30, "some/other-model") == DraftSpec(DraftKind.SELF, size=3)
    assert choose_draft(None, 30) == DraftSpec(DraftKind.SELF, size=3)  # no model: no registry look-up
    assert shipped_draft("some/other-model") is None


def test_sources_merge_what_was_given_with_the_registry():
    assert DraftSources.for_model("smollm2-135m") == DraftSources(draft="default")
    assert DraftSources.for_model("smollm2-135m", "self:2", "bf16", "t.npz") == DraftSources("self:2", "bf16", "t.npz")
    assert DraftSources.for_model("some/other-model") == DraftSources()
    # the pair's drafts take FR-Spec's head by default (RegisteredModel.draft_vocab), 0 the full one
    qwen = DraftSources.for_model("qwen2.5-coder-1.5b")
    assert (qwen.draft_vocab, qwen.vocab_by_default) == (32768, True)
    assert DraftSources.for_model("qwen2.5-coder-1.5b", draft_vocab=0).draft_vocab is None
    asked = DraftSources.for_model("qwen2.5-coder-1.5b", draft_vocab=100)
    assert (asked.draft_vocab, asked.vocab_by_default) == (100, False)


def test_sources_load_the_spec_they_name(tiny_llama, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))  # self-drafts load through the on-disk cache
    target = tiny_llama.lm  # 3 blocks
    fallback = resolve_draft(target, DraftSources(draft_dtype="fp32"), "cpu")
    assert fallback.window is None and fallback.lm.config.n_layers == 1 and fallback.lm.name.endswith("[:1]")
    two = resolve_draft(target, DraftSources(draft="self:2", draft_dtype="fp32"), "cpu")
    assert two.lm.config.n_layers == 2 and two.lm.fmt == "fp32"
    from specstack.models.quant import default_format

    # a self-draft's default: the device's default format
    assert resolve_draft(target, DraftSources(draft="self:1"), "cpu").lm.fmt == default_format("cpu")
    with pytest.raises(SpecstackError, match="self-draft: 4 layers requested, the model has 3"):
        resolve_draft(target, DraftSources(draft="self:4", draft_dtype="fp32"), "cpu")


# ---------------------------------------------------------------------------------------------------
# The per-model registry
# ---------------------------------------------------------------------------------------------------
def test_the_default_model_entry_points_at_files_that_exist():
    entry = MODELS["smollm2-135m"]
    assert default_draft_path("smollm2-135m") == DATA_DIR / entry.draft and (DATA_DIR / entry.draft).is_file()
    assert default_ngram_path("smollm2-135m") == DATA_DIR / entry.trigram and (DATA_DIR / entry.trigram).is_file()
    assert resolve("smollm2-135m").path == entry.weights() and entry.weights().is_file()
    assert default_draft_path("no-such-model") is None and default_ngram_path("no-such-model") is None


# ---------------------------------------------------------------------------------------------------
# Transformer.first_layers
# ---------------------------------------------------------------------------------------------------
def _truncated_hf(hf: torch.nn.Module, n: int) -> torch.nn.Module:
    """The transformers model built with n layers, holding the first n of `hf`'s weights."""
    cfg = copy.deepcopy(hf.config)
    cfg.num_hidden_layers = n  # (GPT2Config maps it to n_layer)
    small = type(hf)(cfg).float().eval()
    missing, unexpected = small.load_state_dict(hf.state_dict(), strict=False)
    assert not missing and unexpected and all(".1." in k or ".2." in k for k in unexpected)
    return small


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_first_layers_is_the_model_cut_after_n_blocks(tiny_models, arch):
    tiny = tiny_models[arch]
    full = tiny.lm.model
    n_full = full.config.n_layers
    draft = full.first_layers(1)
    assert draft.config.n_layers == 1 and len(draft.layers) == 1 and full.config.n_layers == n_full
    assert draft.layers[0] is full.layers[0] and draft.norm is full.norm and draft.head is full.head
    assert draft.embed is full.embed and draft.device == full.device
    ids = torch.tensor([[3, 17, 99, 5, 250, 42, 8]])
    # the full model's own hidden state after block 1, through its final norm and head: exact
    hidden = full.extend(ids, full.new_cache(1, 16), hidden_layers=(1,)).hidden[1]
    cut = full.head.forward(full.norm.forward(hidden.reshape(-1, hidden.shape[-1]))).float().view(1, 7, -1)
    logits = draft.extend(ids, draft.new_cache(1, 16)).logits
    assert torch.equal(logits, cut)
    # and transformers' own model of one layer with the same weights (another implementation)
    with torch.no_grad():
        ref = _truncated_hf(tiny.hf, 1)(ids).logits.float()
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits, full.extend(ids, full.new_cache(1, 16)).logits, atol=1e-2)  # n matters


def test_first_layers_bounds(tiny_llama):
    for n in (0, 4):
        with pytest.raises(SpecstackError, match=f"self-draft: {n} layers requested, the model has 3"):
            tiny_llama.lm.model.first_layers(n)


def test_auto_runs_what_the_models_entry_names(monkeypatch):
    """`auto` follows the registry: a model whose entry names its measured fastest method runs that
    (and the stats line says so); any other model runs the default AUTO."""
    from specstack.engine import methods
    from specstack.models.registry import MODELS, RegisteredModel

    monkeypatch.setitem(MODELS, "pair", RegisteredModel("", "", "", auto="chain:k=3"))
    auto = methods.parse_method("auto")
    assert methods.resolved_auto(auto, "pair") == methods.parse_method("chain:k=3")
    assert methods.describe(auto, "pair") == "auto (chain:k=3)"
    assert methods.resolved_auto(auto, "smollm2-135m") is auto
    assert methods.describe(auto, "smollm2-135m") == f"auto ({methods.AUTO})"
    chain = methods.parse_method("chain:k=2")
    assert methods.resolved_auto(chain, "pair") is chain


def test_a_draft_model_takes_the_cpus_default_format_unless_told():
    """A model or self:N draft runs in the format a target gets by default on the device (w4a8 where its
    kernels build: its one-token step is the fastest there), a trained draft in int8; --draft-dtype wins."""
    from specstack.engine.draft_sources import DraftSources
    from specstack.models.drafts import DraftSpec
    from specstack.models.quant import default_format

    model, own, trained = DraftSpec.parse("qwen2.5-coder-0.5b"), DraftSpec.parse("self:2"), DraftSpec.parse("d.safetensors")
    assert default_format("cpu") in ("w4a8", "int4")
    assert DraftSources().draft_format(model, "cpu") == DraftSources().draft_format(own, "cpu") == default_format("cpu")
    assert DraftSources().draft_format(trained, "cpu") == "int8"
    assert DraftSources(draft_dtype="bf16").draft_format(model, "cpu") == "bf16"


# ---------------------------------------------------------------------------------------------------
# DraftShelf: a server's methods load each draft once and share its prefix cache
# ---------------------------------------------------------------------------------------------------
def test_a_shelf_loads_each_draft_once_and_its_methods_share_its_prefix_cache(tiny_llama):
    """With a shelf (the server's sources) two methods drafting with one draft load it once and share one
    prefix cache of its keys; without one (a bench, the CLI) each method loads its own. Rows of both
    methods in one batch, drafting through the shared cache, emit what the target alone does."""
    import dataclasses

    from specstack.engine.batched import BatchEngine, BatchRequest
    from specstack.engine.draft_sources import DraftShelf
    from specstack.engine.methods import drafter_factory

    lm = tiny_llama.lm
    plain = DraftSources("self:1", "fp32", prefix_cache_bytes=1 << 20)
    assert resolve_draft(lm, plain, "cpu").lm is not resolve_draft(lm, plain, "cpu").lm
    shelf = DraftShelf()
    shared = dataclasses.replace(plain, shelf=shelf)
    assert shared == plain  # the shelf is no part of what the sources are
    first = resolve_draft(lm, shared, "cpu")
    assert resolve_draft(lm, dataclasses.replace(shared), "cpu") is first
    other = resolve_draft(lm, dataclasses.replace(shared, draft="self:2"), "cpu")  # the same shelf, another draft
    assert other is not first and other.lm.config.n_layers == 2 and first.lm.config.n_layers == 1
    assert shared.draft_prefix(first.lm) is shared.draft_prefix(first.lm) is not None
    assert plain.draft_prefix(first.lm) is not plain.draft_prefix(first.lm)
    chain = drafter_factory(parse_method("chain:k=3"), lm, shared)
    tree = drafter_factory(parse_method("tree:budget=6"), lm, shared)
    assert len(shelf) == 3  # two drafts, one prefix cache: nothing more for the second method
    gen = GenerationConfig(max_new_tokens=12, stop_on_eos=False)
    prompts = [[5, 6, 7, 8] * 12, [5, 6, 7, 8] * 12 + [9, 10], [3, 1, 4, 1, 5, 9] * 6]
    eng = BatchEngine(lm, max_rows=3, max_context=128)
    outs = eng.run([BatchRequest(p, gen, drafter_factory=f) for p, f in zip(prompts, [chain, tree, chain], strict=True)])
    outs += eng.run([BatchRequest(p, gen, drafter_factory=f) for p, f in zip(prompts, [tree, chain, tree], strict=True)])
    prefix = shared.draft_prefix(first.lm)
    assert prefix is not None and prefix.stats.hits > 0  # the second round's drafts read the first's prompts
    for p, out in zip(prompts * 2, outs, strict=True):
        assert out.tokens == generate(lm, p, gen).tokens
