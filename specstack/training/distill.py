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
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specstack import interrupt
from specstack.files import atomic_output
from specstack.models.spire_draft import SpireDraft
from specstack.training.teacher import TeacherData, hidden_for

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
    contexts: tuple[int, ...] = ()  # held-out acceptance also by context (Acceptance.by_context)
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
    # the same by context: chains whose first query sees (c // 2, c] tokens, for each c asked for
    by_context: dict[int, Acceptance] = field(default_factory=dict)
    # tokens per round of decoding walked along the text: a round starts where the previous one ended
    # (after its bonus token), as in the engine, where rounds start right after a rejection
    walk_tau: float | None = None

    @property
    def tau(self) -> float:
        """Tokens per target forward of a k-chain: 1 + sum_j prod_{i<=j} alpha_i."""
        tau, run = 1.0, 1.0
        for a in self.alpha:
            run *= a
            tau += run
        return tau

    def to_json(self) -> dict:
        out: dict = {"alpha": self.alpha, "tau": self.tau}
        if self.walk_tau is not None:
            out["walk_tau"] = self.walk_tau
        if self.by_context:
            out["by_context"] = {str(c): a.to_json() for c, a in self.by_context.items()}
        return out


class ChainCounts:
    """Greedy chain acceptance counted over teacher-forced text (DESIGN §7's held-out measure), for
    any drafter whose step-j guesses at every position are known: step j at chain start t0 counts
    where steps < j were accepted and the text followed the target's greedy choice up to the step's
    query (so the drafter saw exactly the accepted chain).

    tau = 1 + sum_j prod_{i<=j} alpha_i counts every position alike; decoding starts its rounds right
    after a rejection, where drafting is harder, so the walk (rounds laid end to end along the text,
    each starting after the previous one's bonus token) is the figure the engine's τ compares with.
    On the target's own greedy text the walk is exactly what the engine does."""

    def __init__(self, k: int, contexts: Sequence[int] = (), device: torch.device | str = "cpu") -> None:
        self.k, self.contexts = k, tuple(contexts)
        # row 0: all chains; row 1 + i: chains in context bucket i
        self.accepted = torch.zeros(1 + len(self.contexts), k, device=device)
        self.eligible = torch.zeros_like(self.accepted)
        self.walk_tokens = [0] * (1 + len(self.contexts))
        self.walk_rounds = [0] * (1 + len(self.contexts))
        self.rounds: list[int] = []  # draft tokens accepted in each walked round, in order

    def add(self, text: torch.Tensor, greedy: torch.Tensor, guesses: Sequence[torch.Tensor]) -> None:
        """text [T] token ids, greedy [T] the target's greedy next token after each position, guesses[j - 1]
        [T] the drafter's step-j guess with its query at each position."""
        k, t = self.k, len(text)
        n0 = t - k  # chain starts with all k steps inside the sequence
        if n0 <= 0:
            return
        start = torch.arange(n0, device=text.device)
        rows = [torch.ones(n0, dtype=torch.bool, device=text.device)]
        rows += [(start + 1 > c // 2) & (start + 1 <= c) for c in self.contexts]  # start + 1 tokens seen
        rows_t = torch.stack(rows).float()  # [1 + C, n0]
        ok_chain = torch.ones(n0, dtype=torch.bool, device=text.device)
        run = torch.zeros(n0, dtype=torch.long, device=text.device)  # steps accepted by the chain at t0
        for j in range(1, k + 1):
            if j >= 2:  # the query of step j is the text token at t0 + j - 1
                ok_chain &= text[j - 1:j - 1 + n0] == greedy[j - 2:j - 2 + n0]
            self.eligible[:, j - 1] += rows_t @ ok_chain.float().to(rows_t.device)
            ok_chain &= guesses[j - 1][j - 1:j - 1 + n0] == greedy[j - 1:j - 1 + n0]
            self.accepted[:, j - 1] += rows_t @ ok_chain.float().to(rows_t.device)
            run += ok_chain
        runs, in_row = run.tolist(), rows_t.bool().cpu()
        t0 = 0
        while t0 < n0:  # the walk: each round emits its accepted steps and the bonus token
            self.rounds.append(runs[t0])
            for r in range(len(self.walk_tokens)):
                if in_row[r, t0]:
                    self.walk_tokens[r] += runs[t0] + 1
                    self.walk_rounds[r] += 1
            t0 += runs[t0] + 1

    def result(self) -> Acceptance:
        rates = (self.accepted / self.eligible.clamp(min=1)).cpu().tolist()
        walks = [tok / rounds if rounds else None for tok, rounds in zip(self.walk_tokens, self.walk_rounds, strict=True)]
        return Acceptance(rates[0], {c: Acceptance(r, walk_tau=w) for c, r, w in zip(self.contexts, rates[1:], walks[1:], strict=True)},
                          walk_tau=walks[0])


@torch.no_grad()
def acceptance(model: SpireDraft, batches: Iterable[dict[str, torch.Tensor]], k: int, n_sequences: int,
               contexts: Sequence[int] = ()) -> Acceptance:
    """Held-out greedy acceptance per chain position of a draft (ChainCounts), over the first
    `n_sequences` batches of one sequence each."""
    model.eval()
    counts = ChainCounts(k, contexts, model.vocab_ids.device)
    for seen, batch in enumerate(batches, start=1):
        hidden = hidden_for(batch, model.spire.target_layers) if model.spire.target_layers else None
        outs = model.train_forward(batch["tokens"].long(), hidden, k)
        counts.add(batch["tokens"][0].long(), batch["topk_ids"][0, :, 0].long(),
                   [model.vocab_ids[o[0].argmax(-1)] for o in outs])
        if seen >= n_sequences:
            break
    model.train()
    return counts.result()


def lr_at(step: int, params: TrainParams) -> float:
    if step < params.warmup:
        return params.lr * (step + 1) / params.warmup
    frac = (step - params.warmup) / max(1, params.steps - params.warmup)
    return params.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def train(model: SpireDraft, data: TeacherData, params: TrainParams, out: Path, resume: bool = False,
          log=print) -> Acceptance:
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
    # the same data order as an uninterrupted run
    batches = data.train_batches(params.batch_size, params.seed, skip=start * params.accumulate)

    def held_out() -> Acceptance:
        return acceptance(model, data.heldout_batches(), params.eval_k, params.eval_sequences, params.contexts)

    model.train()
    acc = held_out() if start == 0 else None
    if acc is not None:
        log(f"step 0: held-out alpha {[round(a, 3) for a in acc.alpha]} tau {acc.tau:.3f}")
    bar = tqdm(range(start, params.steps), desc="train-draft", unit="step", file=sys.stderr,
               initial=start, total=params.steps)
    began = time.perf_counter()
    for step in bar:
        interrupt.check()  # Ctrl-C stops here; the last checkpoint resumes the run
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
            acc = held_out()
            log(f"step {done}: loss {total:.4f} held-out alpha {[round(a, 3) for a in acc.alpha]} tau {acc.tau:.3f} "
                f"({time.perf_counter() - began:.0f} s)")
        if done % params.checkpoint_every == 0 or done == params.steps:
            with atomic_output(ckpt) as tmp:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": done}, tmp)
    bar.close()
    return acc or held_out()
