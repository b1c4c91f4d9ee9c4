"""The teacher runs once: the target's top-k log-probabilities and the hidden states the draft reads
(target activations) for every training token, written to disk in shards.

A shard holds `tokens` [n, S] int32, `topk_ids` [n, S, K] int32, `topk_logp` [n, S, K] fp16 (true
log-probabilities: log-softmax over the full vocabulary, so sum(exp) <= 1) and `hidden` [n, S, L, d]
bf16. Shards already on disk are kept, so an interrupted run resumes where it stopped."""
from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specstack.attention import build_batch
from specstack.errors import SpecstackError
from specstack.models.transformer import Transformer


@dataclass(frozen=True)
class TeacherSpec:
    layers: tuple[int, ...]  # target hidden layers stored (1-based block outputs)
    topk: int = 32
    shard_size: int = 64  # sequences per shard
    batch_size: int = 2  # sequences per teacher forward


@torch.inference_mode()
def teacher_batch(target: Transformer, tokens: torch.Tensor, spec: TeacherSpec) -> dict[str, torch.Tensor]:
    b, s = tokens.shape
    cache = target.new_cache(b, s)
    out = target.forward(tokens.long().to(target.device), build_batch(cache, s), cache, hidden_layers=spec.layers)
    logp = torch.log_softmax(out.logits.float(), -1)
    top = logp.topk(spec.topk, dim=-1)
    hidden = torch.stack([out.hidden[i] for i in spec.layers], 2) if spec.layers else torch.zeros(b, s, 0, 0)
    return {"tokens": tokens.to(torch.int32), "topk_ids": top.indices.to(torch.int32).cpu(),
            "topk_logp": top.values.to(torch.float16).cpu(), "hidden": hidden.to(torch.bfloat16).cpu()}


def build_cache(target: Transformer, sequences: torch.Tensor, out: Path, spec: TeacherSpec, desc: str) -> None:
    from safetensors.torch import save_file
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    meta = {"layers": list(spec.layers), "topk": spec.topk, "n": len(sequences), "seq_len": sequences.shape[1]}
    meta_path = out / "meta.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()) != meta:
        raise SpecstackError(f"{out} holds a teacher cache made with other settings; use a new --out")
    meta_path.write_text(json.dumps(meta))
    n_shards = -(-len(sequences) // spec.shard_size)
    with tqdm(total=len(sequences), desc=f"teacher {desc}", unit="seq", file=sys.stderr) as bar:
        for k in range(n_shards):
            path = out / f"shard_{k:05d}.safetensors"
            seqs = sequences[k * spec.shard_size:(k + 1) * spec.shard_size]
            if path.is_file():
                bar.update(len(seqs))
                continue
            parts = []
            for i in range(0, len(seqs), spec.batch_size):
                parts.append(teacher_batch(target, seqs[i:i + spec.batch_size], spec))
                bar.update(len(parts[-1]["tokens"]))
            shard = {key: torch.cat([p[key] for p in parts]).contiguous() for key in parts[0]}
            tmp = path.with_suffix(".tmp")
            save_file(shard, str(tmp))
            tmp.replace(path)  # atomic: a killed run never leaves half a shard


def shard_paths(folder: Path) -> list[Path]:
    paths = sorted(folder.glob("shard_*.safetensors"))
    if not paths:
        raise SpecstackError(f"no teacher shards in {folder}")
    return paths


def iter_batches(paths: Sequence[Path], batch_size: int, epochs: int | None = 1, seed: int = 0,
                 device: torch.device | str = "cpu") -> Iterator[dict[str, torch.Tensor]]:
    """Mini-batches of sequences on `device`, shard by shard (one shard in memory at a time), shuffled
    within it; epochs=None cycles for ever. The order depends on the seed only, not on the device."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    epoch = 0
    while epochs is None or epoch < epochs:
        epoch += 1
        for k in torch.randperm(len(paths), generator=g).tolist():
            shard = load_file(str(paths[k]))
            layers = torch.tensor(json.loads((paths[k].parent / "meta.json").read_text())["layers"])
            order = torch.randperm(len(shard["tokens"]), generator=g)
            for i in range(0, len(order) - batch_size + 1, batch_size):
                idx = order[i:i + batch_size]
                yield {"layers": layers} | {key: v[idx].to(device) for key, v in shard.items()}


def hidden_for(batch: dict[str, torch.Tensor], layers: Sequence[int]) -> torch.Tensor:
    """The batch's hidden states [B, S, L, d] of the target `layers` a draft reads, in its order."""
    stored = batch["layers"].tolist()
    missing = [i for i in layers if i not in stored]
    if missing:
        raise SpecstackError(f"the teacher cache holds target layers {stored}, the draft reads {list(layers)}")
    return batch["hidden"][:, :, [stored.index(i) for i in layers]]
