"""The teacher: the target's top-k log-probabilities and the hidden states the draft reads (target
activations) for every training token. Two sources give training the same batches:
- `CachedTeacher`: the teacher runs once and is written to disk in shards (CPU: the target's forward
  would cost as much as the draft's training step, every epoch);
- `OnlineTeacher`: the target runs inside the training loop on each batch (a GPU, where the forward
  is cheap and the cache, about 2.3 KB per token, would outgrow the disk before the data does).

A shard holds `tokens` [n, S] int32, `topk_ids` [n, S, K] int32, `topk_logp` [n, S, K] fp16 (true
log-probabilities: log-softmax over the full vocabulary, so sum(exp) <= 1) and `hidden` [n, S, L, d]
bf16. Shards already on disk are kept, so an interrupted run resumes where it stopped."""
from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from specstack import interrupt
from specstack.attention import build_batch
from specstack.errors import SpecstackError
from specstack.files import atomic_output
from specstack.models.transformer import Transformer


@dataclass(frozen=True)
class TeacherSpec:
    layers: tuple[int, ...]  # target hidden layers stored (1-based block outputs)
    topk: int = 32
    shard_size: int = 64  # sequences per shard
    batch_size: int = 2  # sequences per teacher forward


def teacher_batch(target: Transformer, tokens: torch.Tensor, spec: TeacherSpec,
                  device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """One teacher batch on `device`. The outputs are ordinary tensors (made outside inference mode),
    so the draft's autograd may save them."""
    interrupt.check()  # Ctrl-C stops between batches: cached or online, in training or held-out
    with torch.inference_mode():
        out = _teacher_forward(target, tokens, spec)
    return {key: v.to(device).clone() for key, v in out.items()}


def _teacher_forward(target: Transformer, tokens: torch.Tensor, spec: TeacherSpec) -> dict[str, torch.Tensor]:
    b, s = tokens.shape
    cache = target.new_cache(b, s)
    out = target.forward(tokens.long().to(target.device), build_batch(cache, s), cache, hidden_layers=spec.layers)
    logp = torch.log_softmax(out.logits.float(), -1)
    top = logp.topk(spec.topk, dim=-1)
    hidden = torch.stack([out.hidden[i] for i in spec.layers], 2) if spec.layers else torch.zeros(b, s, 0, 0)
    return {"tokens": tokens.to(torch.int32), "topk_ids": top.indices.to(torch.int32),
            "topk_logp": top.values.to(torch.float16), "hidden": hidden.to(torch.bfloat16)}


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
            with atomic_output(path) as tmp:  # a killed run never leaves half a shard
                save_file(shard, str(tmp))


def shard_paths(folder: Path) -> list[Path]:
    paths = sorted(folder.glob("shard_*.safetensors"))
    if not paths:
        raise SpecstackError(f"no teacher shards in {folder}")
    return paths


def iter_batches(paths: Sequence[Path], batch_size: int, epochs: int | None = 1, seed: int = 0,
                 device: torch.device | str = "cpu", skip: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Mini-batches of sequences on `device`, shard by shard (one shard in memory at a time), shuffled
    within it; epochs=None cycles for ever; the first `skip` batches are passed over (a resumed run).
    The order depends on the seed only, not on the device."""
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
                if skip > 0:
                    skip -= 1
                    continue
                idx = order[i:i + batch_size]
                yield {"layers": layers} | {key: v[idx].to(device) for key, v in shard.items()}


class TeacherData(Protocol):
    """Where distillation reads its batches: dicts of `tokens`, `topk_ids`, `topk_logp`, `hidden`
    (see the module docstring) and `layers` (the target layers `hidden` holds)."""

    def train_batches(self, batch_size: int, seed: int, skip: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Training batches, cycling for ever, after passing over the first `skip`."""
        ...

    def heldout_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """The held-out sequences, one per batch, once."""
        ...


@dataclass(frozen=True)
class CachedTeacher:
    train_paths: Sequence[Path]
    heldout_paths: Sequence[Path]
    device: torch.device | str = "cpu"

    def train_batches(self, batch_size: int, seed: int, skip: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        return iter_batches(self.train_paths, batch_size, epochs=None, seed=seed, device=self.device, skip=skip)

    def heldout_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        return iter_batches(self.heldout_paths, 1, device=self.device)


@dataclass(frozen=True)
class OnlineTeacher:
    """The target run on each batch where it is used; the same batches, in the same order for a seed,
    as a cache of these sequences would give up to the shard shuffle (no disk, no shards)."""
    target: Transformer
    train: torch.Tensor  # [N, S] token ids
    heldout: torch.Tensor  # [M, S]
    spec: TeacherSpec

    def _batch(self, seqs: torch.Tensor) -> dict[str, torch.Tensor]:
        dev = self.target.device
        return {"layers": torch.tensor(self.spec.layers, device=dev)} | teacher_batch(self.target, seqs, self.spec, dev)

    def train_batches(self, batch_size: int, seed: int, skip: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        if len(self.train) < batch_size:
            raise SpecstackError(f"{len(self.train)} training sequences cannot fill a batch of {batch_size}")
        g = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(len(self.train), generator=g)
            for i in range(0, len(order) - batch_size + 1, batch_size):
                if skip > 0:  # passed over without running the target
                    skip -= 1
                    continue
                yield self._batch(self.train[order[i:i + batch_size]])

    def heldout_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(len(self.heldout)):
            yield self._batch(self.heldout[i:i + 1])


def hidden_for(batch: dict[str, torch.Tensor], layers: Sequence[int]) -> torch.Tensor:
    """The batch's hidden states [B, S, L, d] of the target `layers` a draft reads, in its order."""
    stored = batch["layers"].tolist()
    missing = [i for i in layers if i not in stored]
    if missing:
        raise SpecstackError(f"the teacher cache holds target layers {stored}, the draft reads {list(layers)}")
    return batch["hidden"][:, :, [stored.index(i) for i in layers]]
