"""Damaged copies of the fixtures, each the value of an option that names an input: a checkpoint folder,
a GGUF, a model or draft spec, a draft, trigram or sequences file, a bench run folder, a prompt file."""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from fuzz.case import Builder
from fuzz.damage import (
    bad_json_value,
    damage_json,
    damaged_copy,
    damaged_json_file,
    damaged_jsonl_copy,
    input_file,
    random_bytes,
)
from fuzz.values import HUGE


def _safetensors_parts(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def _safetensors_bytes(tensors: dict[str, Any], meta: dict[str, str]) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)


def model_folder(b: Builder) -> str:
    """A copy of the tiny checkpoint with one file damaged, removed or replaced."""
    rel = b.name("model")
    b.put(rel, source=b.fx.model)
    target = b.pick(("config.json", "config.json", "config.json", "model.safetensors", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"))
    kind = b.pick(("structure", "structure", "bytes", "remove", "random"))
    source = b.fx.model / target
    if kind == "remove":
        b.put(f"{rel}/{target}", remove=True)
        b.note(f"checkpoint: {target} removed")
    elif kind == "random":
        b.put(f"{rel}/{target}", data=random_bytes(b.rng))
        b.note(f"checkpoint: {target} = random bytes")
    elif kind == "structure" and target.endswith(".json"):
        damaged_json_file(b, source, f"{rel}/{target}")
    elif kind == "structure":
        import torch

        tensors, meta = _safetensors_parts(source)
        name = b.pick(sorted(tensors))
        how = b.pick(("drop", "shape", "dtype"))
        if how == "drop":
            del tensors[name]
        elif how == "shape":
            tensors[name] = tensors[name].flatten()[: max(1, tensors[name].numel() // 2)]
        else:
            tensors[name] = tensors[name].to(torch.int8)
        b.note(f"checkpoint: tensor {name} {how}")
        b.put(f"{rel}/{target}", data=_safetensors_bytes(tensors, meta))
    elif target == "model.safetensors":  # blind damage to 12 MB: a cut or flips in the header
        size = source.stat().st_size
        if b.rng.random() < 0.5:
            cut = b.rng.randrange(size)
            b.put(f"{rel}/{target}", source=source, cut=cut)
            b.note(f"checkpoint: model.safetensors cut to {cut} bytes")
        else:
            flips = tuple((b.rng.randrange(min(size, 400)), b.rng.randrange(1, 256)) for _ in range(b.rng.randint(1, 4)))
            b.put(f"{rel}/{target}", source=source, flips=flips)
            b.note("checkpoint: model.safetensors header bytes flipped")
    else:
        damaged_copy(b, source, f"{rel}/{target}")
    return b.path(rel)


def gguf_file(b: Builder) -> str:
    """The tiny GGUF missing or breaking metadata, cut, or with flipped bytes."""
    kind = b.pick(("variant", "variant", "cut", "flip"))
    if kind == "variant":
        v = b.pick(b.fx.gguf_variants)
        b.note(f"GGUF: {v.stem}")
        return str(v)
    size = b.fx.gguf.stat().st_size
    rel = b.name("m") + ".gguf"
    if kind == "cut":
        cut = b.rng.choice((0, 3, 4, 8, 24, b.rng.randrange(size)))
        b.note(f"GGUF cut to {cut} bytes")
        return b.put(rel, source=b.fx.gguf, cut=cut)
    flips = tuple((b.rng.randrange(min(size, 8000)), b.rng.randrange(1, 256)) for _ in range(b.rng.randint(1, 3)))
    b.note(f"GGUF: bytes flipped at {[o for o, _ in flips]}")
    return b.put(rel, source=b.fx.gguf, flips=flips)


def model_spec(b: Builder) -> str:
    """A --model / --target value that is not a loadable model."""
    kind = b.pick(("folder", "folder", "folder", "gguf", "gguf", "gguf-valid", "missing", "file", "empty-folder",
                   "name", "hub", "empty"))
    if kind == "folder":
        return model_folder(b)
    if kind == "gguf":
        return gguf_file(b)
    b.note(f"model -> {kind}")
    if kind == "gguf-valid":
        return str(b.fx.gguf)
    if kind == "missing":
        return b.path("no-model")
    if kind == "file":
        return b.put(b.name("f") + ".bin", data=random_bytes(b.rng))
    if kind == "empty-folder":
        return b.put(b.name("m"), folder=True)
    if kind == "hub":
        return b.pick(("org/model", "a/b/c", "~/nope"))
    if kind == "name":
        return b.pick(("smollm2-1.7b", "SMOLLM2-135M", "gpt2", "x.gguf"))
    return b.pick(("", " "))


def draft_file(b: Builder) -> str:
    """A copy of the tiny draft damaged blindly or in its tensors and metadata."""
    rel = b.name("d") + ".safetensors"
    if b.rng.random() < 0.4:
        return damaged_copy(b, b.fx.draft, rel)
    tensors, meta = _safetensors_parts(b.fx.draft)
    how = b.pick(("format", "config", "config", "drop", "vocab", "shape"))
    if how == "format":
        meta["format"] = b.pick(("", "specstack-sequences", "x"))
    elif how == "config":
        doc, what = damage_json(b.rng, json.loads(meta["config"]))
        meta["config"] = json.dumps(doc)
        how = f"config {what}"
    elif how == "drop":
        name = b.pick(sorted(tensors))
        del tensors[name]
        how = f"tensor {name} dropped"
    elif how == "vocab":
        import torch

        tensors["vocab_ids"] = torch.full_like(tensors["vocab_ids"], b.pick((-1, 10**6)))
        how = "vocab ids out of range"
    else:
        name = b.pick(sorted(tensors))
        tensors[name] = tensors[name].flatten()[:3]
        how = f"tensor {name} reshaped"
    b.note(f"draft file: {how}")
    return b.put(rel, data=_safetensors_bytes(tensors, meta))


def draft_spec(b: Builder) -> str:
    """A --draft value: a damaged file, a bad self:N / magicdec:W, a damaged model, ..."""
    kind = b.pick(("file", "file", "self", "magicdec", "model", "missing", "odd"))
    if kind == "file":
        return draft_file(b)
    if kind == "model":
        return model_spec(b)
    b.note(f"draft -> {kind}")
    if kind == "self":
        return "self:" + b.pick(("0", "-1", "3", "x", "", *HUGE))
    if kind == "magicdec":
        return "magicdec:" + b.pick(("0", "-1", "x", "", "1", *HUGE))
    if kind == "missing":
        return b.path("no-draft.safetensors")
    return b.pick(("default", "self", "magicdec", "self:1:2", ":", "", str(b.fx.trigram)))


def trigram_file(b: Builder) -> str:
    """A damaged copy of the tiny trigram (.npz): blind, an array missing or changed, or its meta."""
    import numpy as np

    rel = b.name("t") + ".npz"
    if b.rng.random() < 0.4:
        return damaged_copy(b, b.fx.trigram, rel)
    with np.load(b.fx.trigram, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    name = b.pick(sorted(arrays))
    how = b.pick(("drop", "meta", "shape", "dtype"))
    if how == "drop":
        del arrays[name]
    elif how == "meta":
        doc, what = damage_json(b.rng, json.loads(str(arrays["meta"])))
        arrays["meta"] = np.array(json.dumps(doc))
        name = f"meta {what}"
    elif how == "shape":
        arrays[name] = arrays[name].reshape(-1)[: max(0, arrays[name].size - 1)]
    else:
        arrays[name] = arrays[name].astype(np.float64) * 1.5
    b.note(f"trigram: {name} {how}")
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return b.put(rel, data=buf.getvalue())


def sequences_file(b: Builder) -> str:
    """A damaged copy of the sequences file: blind, ids out of the vocabulary, odd shapes or types."""
    import torch

    rel = b.name("s") + ".safetensors"
    if b.rng.random() < 0.3:
        return damaged_copy(b, b.fx.sequences, rel)
    tensors, meta = _safetensors_parts(b.fx.sequences)
    part = b.pick(("train", "heldout"))
    how = b.pick(("ids", "empty", "1-d", "float", "short", "drop", "format"))
    t = tensors[part]
    if how == "ids":
        t = t.to(torch.int32)
        t[0, 3] = b.pick((60000, -5, 2**31 - 1))
    elif how == "empty":
        t = t[:0]
    elif how == "1-d":
        t = t.flatten()
    elif how == "float":
        t = t.float() + 0.5
    elif how == "short":
        t = t[:, :1]
    elif how == "format":
        meta["format"] = "specstack-spire-draft"
    if how == "drop":
        del tensors[part]
    else:
        tensors[part] = t
    b.note(f"sequences: {part} {how}")
    return b.put(rel, data=_safetensors_bytes(tensors, meta))


def run_folder(b: Builder, positional: bool = False) -> str:
    """A copy of the finished bench run with one of its files damaged, removed or replaced."""
    rel = b.name("run")
    b.put(rel, source=b.fx.run)
    target = b.pick(("results.jsonl", "results.jsonl", "results.jsonl", "run.json", "run.json", "summary.json"))
    kind = b.pick(("damage", "damage", "damage", "remove", "random", "identical"))
    if kind == "identical" and target == "results.jsonl":  # make bench-ties recheck a row
        lines = (b.fx.run / target).read_text().splitlines()
        i = b.rng.randrange(len(lines))
        row = json.loads(lines[i])
        row["identical_to_ar"] = False
        if b.rng.random() < 0.5:
            row[b.pick(sorted(row))] = bad_json_value(b.rng)
        lines[i] = json.dumps(row)
        b.note(f"run: results.jsonl line {i + 1} not identical to ar")
        b.put(f"{rel}/{target}", data=("\n".join(lines) + "\n").encode("utf-8", "surrogatepass"))
    elif kind == "remove":
        b.put(f"{rel}/{target}", remove=True)
        b.note(f"run: {target} removed")
    elif kind == "random":
        b.put(f"{rel}/{target}", data=random_bytes(b.rng))
        b.note(f"run: {target} = random bytes")
    elif target == "results.jsonl":
        damaged_jsonl_copy(b, b.fx.run / target, f"{rel}/{target}")
    else:
        damaged_json_file(b, b.fx.run / target, f"{rel}/{target}")
    return b.path(rel)


def prompts_file(b: Builder) -> str:
    """A prompt JSONL damaged, or with a prompt longer than the tiny context, or not a file."""
    def damage(b: Builder, source: Path, rel: str) -> str:
        if b.rng.random() < 0.25:
            b.note("prompts: a prompt longer than the context")
            row = {"task_id": "long", "prompt": "hello world " * 100}
            return b.put(rel, data=source.read_bytes() + json.dumps(row).encode() + b"\n")
        return damaged_jsonl_copy(b, source, rel)

    if b.rng.random() < 0.1:
        b.note("prompts -> a set name")
        return b.pick(("humaneval:3", "HumanEval", "sharegpt.jsonl", "", "-"))
    return input_file(b, b.fx.prompts, damage, ".jsonl")
