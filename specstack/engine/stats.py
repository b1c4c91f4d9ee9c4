"""Run statistics as data (DESIGN §2.7); reports are built from these.

A request's `RunStats` live as long as its result (its steps are bounded by its tokens); the engine's
`BatchStats` live as long as a server, so they keep totals and the last `HISTORY` steps only.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from specstack.engine.stopping import FinishReason
from specstack.processing import TokenLogprob
from specstack.tree import DraftTree
from specstack.verify import VerifyResult

# steps an engine remembers one by one (a window for reports and tests; totals cover every step)
HISTORY = 256


@dataclass
class StepStats:
    """One speculative step: what was proposed, what was kept, where the time went."""

    tree_size: int = 0
    accepted: int = 0  # draft nodes accepted (the emitted count is accepted + 1, unless stopped)
    emitted: int = 0
    origins: list[str] = field(default_factory=list)  # origin of every emitted token, in order
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    verify_seconds: float = 0.0
    overhead_seconds: float = 0.0

    def record(self, tree: DraftTree, result: VerifyResult, taken: int) -> None:
        self.tree_size = len(tree)
        self.accepted = len(result.accepted)
        self.origins = emitted_origins(tree, result)[:taken]
        self.emitted = taken


def emitted_origins(tree: DraftTree, result: VerifyResult) -> list[str]:
    """Who proposed each token a verification emits: its accepted path's nodes, then the target's own."""
    return [tree.origin[i] for i in result.accepted] + ["target"]


@dataclass
class RunStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of read
    new_tokens: int = 0
    target_forwards: int = 0  # forwards of the target after prefill
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: list[StepStats] = field(default_factory=list)

    def add_step(self, step: StepStats) -> None:
        self.steps.append(step)
        self.target_forwards += 1

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tau(self) -> float:
        """Tokens emitted per target forward that produced tokens (τ; 1.0 for autoregressive)."""
        return self.new_tokens / max(1, self.target_forwards + (0 if self.steps else 1))

    @property
    def origins(self) -> Counter[str]:
        c: Counter[str] = Counter()
        for s in self.steps:
            c.update(s.origins)
        return c

    def phase_seconds(self) -> dict[str, float]:
        return {
            "draft": sum(s.draft_seconds for s in self.steps),
            "target": sum(s.target_seconds for s in self.steps),
            "verify": sum(s.verify_seconds for s in self.steps),
            "overhead": sum(s.overhead_seconds for s in self.steps),
        }

    def line(self) -> str:
        s = (f"{self.new_tokens} tokens in {self.seconds:.2f} s ({self.tokens_per_s:.1f} tokens/s; "
             f"prefill {self.prompt_tokens} tokens {self.prefill_seconds:.2f} s)")
        if self.steps:
            s += f"; tau {self.tau:.2f} tokens/forward over {self.target_forwards} target forwards"
        return s


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]
    text: str
    finish_reason: FinishReason
    stats: RunStats = field(default_factory=RunStats)
    origins: list[str] = field(default_factory=list)  # who proposed each token (target, draft, draft2, context, grammar)
    stop_word: str | None = None  # the stop string that ended the text, if one did
    logprobs: list[TokenLogprob] | None = None  # each token's, when asked for (GenerationConfig.logprobs)
    prompt_logprobs: list[TokenLogprob] | None = None  # each prompt token's but the first, when asked for


@dataclass(frozen=True)
class BatchStep:
    """One engine step: how full its forward was and what its rows drafted."""

    rows: int  # rows in the forward
    tokens: int  # real tokens in the forward
    layout: str
    drafted: int  # draft nodes verified (over all rows)
    accepted: int  # of them, accepted
    drafting: int  # rows that verified a draft
    verified: int = 0  # rows verified (each a round: it emits 1 + its accepted tokens)
    emitted: int = 0  # tokens their verifications emitted
    draft_forwards: int = 0  # the draft models' forwards proposing the step's trees (a group's serve all its rows)


@dataclass
class BatchStats:
    """The engine's steps: totals since it started, the last HISTORY steps, and where the time went.
    Bounded: a server's engine steps for days."""

    steps: int = 0
    rows: int = 0  # totals over every step
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verified: int = 0
    emitted: int = 0
    draft_forwards: int = 0
    layouts: Counter[str] = field(default_factory=Counter)
    recent: deque[BatchStep] = field(default_factory=lambda: deque(maxlen=HISTORY))
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    verify_seconds: float = 0.0
    overhead_seconds: float = 0.0  # planning, admitting, committing, streaming

    def add(self, step: BatchStep) -> None:
        self.steps += 1
        self.rows += step.rows
        self.tokens += step.tokens
        self.drafted += step.drafted
        self.accepted += step.accepted
        self.verified += step.verified
        self.emitted += step.emitted
        self.draft_forwards += step.draft_forwards
        self.layouts[step.layout] += 1
        self.recent.append(step)

    @property
    def tau(self) -> float:
        """τ: tokens a row gains per round (verification), over every step; whatever the rounds drafted
        (a length rule that drafts fewer nodes, or none, still makes a round of each). A prompt's last chunk
        is prefill, not a round (engine/commit.py step_record)."""
        return self.emitted / self.verified if self.verified else 0.0

    @property
    def last(self) -> BatchStep | None:
        return self.recent[-1] if self.recent else None

    def phase_seconds(self) -> dict[str, float]:
        return {"draft": self.draft_seconds, "target": self.target_seconds, "verify": self.verify_seconds,
                "overhead": self.overhead_seconds}
