"""The layer order of DESIGN §1, written once: data flows down, never up.

A module may import modules of its own layer or of any layer below it, never above; and the import
graph has no circles (tests/unit/test_layers.py walks every import, top-level and inside functions,
and fails on either). Layers are listed bottom first; each names the modules and packages it owns.
"""
from __future__ import annotations

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # errors, frozen configuration, the weight formats' table, the machine a measurement ran on, Ctrl-C as a per-step stop request,
    # files in and out (writable outputs checked up front, atomic writes, strict UTF-8 reads)
    ("foundation", ("specstack.errors", "specstack.config", "specstack.machine", "specstack.layers",
                    "specstack.interrupt", "specstack.files", "specstack.validate", "specstack.weight_formats")),
    # the data structures and pure functions every layer above shares: prompt encoding, the one mask
    # builder, the preallocated KV cache and the prefix cache of prompts read, the draft tree as data,
    # fill-in-the-middle prompts from a model's special tokens,
    # logits -> warped probabilities, a request's logits rules (penalties, bias, a grammar's masks) along a tree
    ("primitives", ("specstack.prompts", "specstack.fim", "specstack.attention", "specstack.cache", "specstack.prefix_cache",
                    "specstack.tree", "specstack.sampling", "specstack.grammar", "specstack.processing")),
    # decoders behind one protocol, weight formats, loading, the registry of named models
    ("models", ("specstack.models",)),
    # drafters build DraftTrees; verifiers are pure functions over (tree, target probabilities)
    ("drafting", ("specstack.verify", "specstack.drafting")),
    # generation loops (propose -> score -> verify -> commit), the method registry, cost curves
    ("engine", ("specstack.engine",)),
    # tools built on the engine, never imported by it: reports, benchmarks, draft training, the
    # analytic throughput model, the machine's report (`specstack doctor`: it reads every layer below)
    ("tools", ("specstack.report", "specstack.bench", "specstack.training", "specstack.throughput",
               "specstack.doctor")),
    # thin adapters: the command line (and, to come, the server and the cluster deployment)
    ("adapters", ("specstack.cli", "specstack.server", "specstack.cluster")),
)


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer owning `module` (its longest listed prefix)."""
    best, best_len = -1, -1
    for i, (_, owned) in enumerate(LAYERS):
        for prefix in owned:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    if best < 0:
        raise KeyError(f"{module} belongs to no layer in specstack/layers.py")
    return best
