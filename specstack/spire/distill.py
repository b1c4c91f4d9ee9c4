"""Distillation of a draft from the cached teacher (DESIGN §7): losses, held-out acceptance, the
training loop (AdamW, warm-up + cosine, gradient accumulation, bf16 autocast, checkpoints). Training
runs on the device of the draft's parameters (CPU or CUDA); the cached teacher is read from disk.

Losses over the teacher's top-k (p: true probabilities of its K likeliest tokens; q: the draft's):
- `kl`: forward KL(p || q), up to the teacher's entropy: -sum_k p_k log q_k;
- `ce`: cross-entropy on the hard next token of the text;
- `mixed`: MixedLoss(w) = w * CE(p, q) - (1 - w) * sum_k min(p_k, q_k); the second term is the
  acceptance probability of speculative sampling, the quantity drafting is paid by.
Tokens outside the draft vocabulary have q = 0 and are left out of every term.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specstack.spire.draft_model import SpireDraft
from specstack.spire.teacher import hidden_for, iter_batches

LOSSES = ("kl", "ce", "mixed")


@dataclass(frozen=True)
class TrainParams:
    steps: int = 1000  # optimizer steps
    batch_size: int = 4  # sequences per micro-batch
    accumulate: int = 1  # micro-batches per optimizer step
    lr: float = 3e-4
    warmup: int = 50
    weight_decay: float = 0.01
    loss: str = "mixed"
    omega: float = 0.5
    draft_steps: int = 3  # unrolled draft steps trained (chain positions)
    eval_k: int = 4  # chain length of the held-out acceptance
    eval_every: int = 200
    eval_sequences: int = 32
    checkpoint_every: int = 100
    seed: int = 0


def draft_index(model: SpireDraft) -> torch.Tensor:
    """full vocabulary id -> draft index (-1: outside the draft vocabulary)."""
    idx = torch.full((model.config.vocab_size,), -1, dtype=torch.long, device=model.vocab_ids.device)
    idx[model.vocab_ids] = torch.arange(len(model.vocab_ids), device=idx.device)
    return idx


def step_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor], index: torch.Tensor, loss: str,
              omega: float) -> torch.Tensor:
    logq = torch.log_softmax(logits.float(), -1)  # [B, T, V']
    if loss == "ce":
        labels = index[batch["tokens"][:, 1:].long()]
        ok = labels >= 0
        picked = logq[:, :-1].gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return -(picked * ok).sum() / ok.sum().clamp(min=1)
    ids = index[batch["topk_ids"].long()]  # [B, T, K]
    ok = ids >= 0
    p = batch["topk_logp"].float().exp() * ok
    logq_k = logq.gather(-1, ids.clamp(min=0)) * ok
    n = p.shape[0] * p.shape[1]
    ce = -(p * logq_k).sum() / n
    if loss == "kl":
        return ce
    overlap = torch.minimum(p, logq_k.exp() * ok).sum() / n
    return omega * ce - (1 - omega) * overlap


def train_loss(model: SpireDraft, batch: dict[str, torch.Tensor], index: torch.Tensor, params: TrainParams) -> torch.Tensor:
    hidden = hidden_for(batch, model.spire.target_layers) if model.spire.target_layers else None
    outs = model.train_forward(batch["tokens"].long(), hidden, params.draft_steps)
    return sum(step_loss(o, batch, index, params.loss, params.omega) for o in outs) / len(outs)


@dataclass
class Acceptance:
    alpha: list[float]  # greedy acceptance of draft step j given steps < j were accepted

    @property
    def tau(self) -> float:
        """Tokens per target forward of a k-chain: 1 + sum_j prod_{i<=j} alpha_i."""
        tau, run = 1.0, 1.0
        for a in self.alpha:
            run *= a
            tau += run
        return tau


@torch.no_grad()
def acceptance(model: SpireDraft, paths: Sequence[Path], k: int, n_sequences: int) -> Acceptance:
    """Held-out greedy acceptance per chain position, teacher-forced on the text: step j at start t0
    counts where steps < j were accepted and the text followed the target's greedy choice up to the
    step's query (so the draft saw exactly the accepted chain)."""
    model.eval()
    device = model.vocab_ids.device
    accepted = torch.zeros(k, device=device)
    eligible = torch.zeros(k, device=device)
    for seen, batch in enumerate(iter_batches(paths, batch_size=1, device=device), start=1):
        hidden = hidden_for(batch, model.spire.target_layers) if model.spire.target_layers else None
        outs = model.train_forward(batch["tokens"].long(), hidden, k)
        x = batch["tokens"][0].long()
        g = batch["topk_ids"][0, :, 0].long()  # the target's greedy next token at each position
        t = len(x)
        n0 = t - k  # chain starts with all k steps inside the sequence
        ok_chain = torch.ones(n0, dtype=torch.bool, device=device)
        for j in range(1, k + 1):
            if j >= 2:  # the query of step j is the text token at t0 + j - 1
                ok_chain &= x[j - 1:j - 1 + n0] == g[j - 2:j - 2 + n0]
            draft_tok = model.vocab_ids[outs[j - 1][0].argmax(-1)]
            match = draft_tok[j - 1:j - 1 + n0] == g[j - 1:j - 1 + n0]
            eligible[j - 1] += ok_chain.sum()
            ok_chain &= match
            accepted[j - 1] += ok_chain.sum()
        if seen >= n_sequences:
            break
    model.train()
    return Acceptance((accepted / eligible.clamp(min=1)).cpu().tolist())


def lr_at(step: int, params: TrainParams) -> float:
    if step < params.warmup:
        return params.lr * (step + 1) / params.warmup
    frac = (step - params.warmup) / max(1, params.steps - params.warmup)
    return params.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def train(model: SpireDraft, train_paths: Sequence[Path], held_paths: Sequence[Path], params: TrainParams,
          out: Path, resume: bool = False, log=print) -> Acceptance:
    """Train in place; checkpoints to out/checkpoint.pt (resumable); returns the final acceptance."""
    from tqdm import tqdm

    torch.manual_seed(params.seed)
    device = model.vocab_ids.device
    index = draft_index(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=params.lr,
                            weight_decay=params.weight_decay, betas=(0.9, 0.95))
    ckpt = out / "checkpoint.pt"
    start = 0
    if resume and ckpt.is_file():
        state = torch.load(ckpt, weights_only=True, map_location=device)
        model.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        start = state["step"]
        log(f"resumed at step {start}")
    batches = iter_batches(train_paths, params.batch_size, epochs=None, seed=params.seed, device=device)
    for _ in range(start * params.accumulate):  # the same data order as an uninterrupted run
        next(batches)
    model.train()
    acc = acceptance(model, held_paths, params.eval_k, params.eval_sequences) if start == 0 else None
    if acc is not None:
        log(f"step 0: held-out alpha {[round(a, 3) for a in acc.alpha]} tau {acc.tau:.3f}")
    bar = tqdm(range(start, params.steps), desc="train-draft", unit="step", file=sys.stderr,
               initial=start, total=params.steps)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, params)
        total = 0.0
        for _ in range(params.accumulate):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = train_loss(model, next(batches), index, params) / params.accumulate
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        post = {"loss": f"{total:.4f}"}
        if acc is not None:
            post["tau"] = f"{acc.tau:.3f}"
        bar.set_postfix(post)
        done = step + 1
        if done % params.eval_every == 0 or done == params.steps:
            acc = acceptance(model, held_paths, params.eval_k, params.eval_sequences)
            log(f"step {done}: loss {total:.4f} held-out alpha {[round(a, 3) for a in acc.alpha]} tau {acc.tau:.3f}")
        if done % params.checkpoint_every == 0 or done == params.steps:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": done}, tmp)
            tmp.replace(ckpt)
    bar.close()
    return acc or acceptance(model, held_paths, params.eval_k, params.eval_sequences)
