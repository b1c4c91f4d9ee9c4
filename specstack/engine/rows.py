"""What the engine keeps per request: the request as given, its row (stream, generator, pending tokens,
drafter, state), its block of a step's forward, and the pool its drafter is lent from."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specstack.config import GenerationConfig
from specstack.drafting.base import DraftContext, Drafter
from specstack.engine.plan import RowState, RowView, transition
from specstack.engine.stats import RunStats
from specstack.engine.stopping import Span, TokenStream
from specstack.prefix_cache import Match
from specstack.processing import RowProcessor, TokenLogprob
from specstack.tree import DraftTree

DrafterFactory = Callable[[], Drafter]  # a new drafter (one per row), sharing what its method loaded


@dataclass(frozen=True)
class BatchRequest:
    prompt_ids: Sequence[int]
    gen: GenerationConfig = field(default_factory=GenerationConfig)
    on_text: Callable[[str], None] | None = None  # this row's text as it becomes final (streaming)
    drafter: Drafter | None = None  # proposes this row's trees, for this request alone
    # lends this row a drafter from the engine's pool of this factory (None: the engine's own factory)
    drafter_factory: DrafterFactory | None = None
    speculate: bool = True  # False: this row decodes autoregressively even in a speculating engine
    # this row's released text in pieces, each with the origin of the token that added it (a live view)
    on_spans: Callable[[list[Span]], None] | None = None


class DrafterPool:
    """Drafters lent to rows, one pool per factory: a drafter made for a row that left serves the next
    (its model and trigram are shared; it is reset with the next row's prompt)."""

    def __init__(self) -> None:
        self._free: dict[DrafterFactory, list[Drafter]] = {}
        self._reads: dict[DrafterFactory, bool] = {}  # whether a factory's drafters read target activations
        self.lent = 0  # drafters out with rows now: 0 whenever no row runs (a server's leak check)

    def lend(self, factory: DrafterFactory) -> Drafter:
        free = self._free.get(factory)
        self.lent += 1
        return free.pop() if free else factory()

    def give_back(self, factory: DrafterFactory, drafter: Drafter) -> None:
        self._free.setdefault(factory, []).append(drafter)
        self.lent -= 1

    def reads_activations(self, factory: DrafterFactory) -> bool:
        """Whether the factory's drafters read the target's activations (asked of one, made for the pool if
        none is: the plan needs it before a waiting row is lent one)."""
        if factory not in self._reads:
            free = self._free.setdefault(factory, [])
            if not free:
                free.append(factory())
            self._reads[factory] = bool(free[-1].target_layers)
        return self._reads[factory]

    def drop(self, factory: DrafterFactory) -> None:
        """Forget a factory's idle drafters (a server keeping a bounded set of methods); call it only when
        no row holds one of its drafters."""
        self._free.pop(factory, None)
        self._reads.pop(factory, None)

    @property
    def idle(self) -> int:
        """Drafters made and back in the pool (at most the most rows that ever ran at once, per factory)."""
        return sum(len(free) for free in self._free.values())


@dataclass
class Block:
    """One row's part of a step's forward: `chain` (pending tokens, each continuing the last; a prompt
    chunk or the root alone) then `tree` hanging off the chain's last token when it is the root."""

    chain: list[int]
    tree: DraftTree
    reaches_root: bool  # the chain ends at the row's root: its logits are verified
    own: int = -1  # the tree's first nodes that are its drafter's (the rest a grammar's forced tokens); -1: all
    scored: int = 0  # rows of the chain (but its root) whose logits the forward keeps (prompt log-probabilities)

    @property
    def decodes(self) -> bool:
        """A decoding round: the chain is the root alone (a longer one that reaches the root is the prompt's
        end, whose first token is prefill's)."""
        return len(self.chain) == 1

    @property
    def drafted(self) -> DraftTree:
        """The part of the tree the row's drafter proposed (and the engine kept)."""
        return self.tree if self.own < 0 else self.tree.truncated(self.own)

    @property
    def tokens(self) -> list[int]:
        return self.chain + self.tree.tokens

    @property
    def parents(self) -> list[int]:
        c = len(self.chain)
        return list(range(-1, c - 1)) + [p + c for p in self.tree.parent]

    def __len__(self) -> int:
        return len(self.chain) + len(self.tree)


@dataclass
class Row:
    handle: int
    request: BatchRequest
    stream: TokenStream
    generator: torch.Generator | None
    pending: list[int]  # tokens not in the cache yet; the last is the root
    ctx: DraftContext
    stats: RunStats
    factory: DrafterFactory | None  # where its lent drafter comes from (None: its request's own or none)
    state: RowState = RowState.WAITING
    added: float = 0.0  # when it joined the batch
    first_token: float | None = None
    # when its prompt was read: when its first token came (as autoregressive decoding counts it), or for a
    # row that holds its root (RowView.holds_root), when all but its root is in the cache (its steps then
    # are decoding)
    prefilled: float | None = None
    started: bool = False  # its drafter has been reset with the prompt
    lent: Drafter | None = None  # lent by the engine's pool for as long as the row runs
    # the target's activations of the prompt read so far ([1, T, L, d] chunks), for a drafter that reads them
    hidden: list[torch.Tensor] = field(default_factory=list)
    # the prefix cache (prefix_cache.py): until a row reads its first token it is `fresh`, and
    # each plan looks up the longest cached prefix of its prompt (`match`), which it then copies instead
    # of reading; `held`: it waits for an older row reading the same prompt to finish reading it
    fresh: bool = True
    match: Match = field(default_factory=Match)
    held: bool = False
    # the request's logits rules (penalties, bias, grammar; processing.py), None without any
    processor: RowProcessor | None = None
    # with prompt log-probabilities asked for: each prompt token's but the first, as the prompt is read
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def drafter(self) -> Drafter | None:
        return self.request.drafter if self.request.drafter is not None else self.lent

    @property
    def drafts(self) -> bool:
        return self.request.drafter is not None or self.factory is not None

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.drafter.target_layers) if self.drafter is not None else ()

    @property
    def reads_whole_prompt(self) -> bool:
        """It takes no cached prefix: its drafter reads the target's activations of the prompt, or it asked
        for the prompt's log-probabilities (neither is in the prefix cache)."""
        return bool(self.layers) or self.request.gen.prompt_logprobs

    def move(self, to: RowState) -> None:
        self.state = transition(self.state, to)

    def holds_root(self, pool: DrafterPool) -> bool:
        """Its drafter (the one it will be lent, while it waits) reads the target's activations of the prompt:
        it starts from all of them but the root's, so the row reads its root only with its first tree."""
        drafter = self.drafter
        if drafter is None and self.factory is not None:
            return pool.reads_activations(self.factory)
        return drafter is not None and bool(drafter.target_layers)

    def view(self, max_seq_len: int, pool: DrafterPool) -> RowView:
        """room: a tree's nodes sit past the row's tokens, within the model's positions (the cache's
        scratch holds a tree past the row's context: the row then finishes)."""
        cached = self.match.tokens if self.fresh else 0
        return RowView(self.handle, self.state, len(self.pending) - cached, self.drafts,
                       room=max(0, max_seq_len - len(self.ctx.tokens) - 1), held=self.held,
                       holds_root=self.holds_root(pool))
