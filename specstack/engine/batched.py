"""Batched decoding with a row lifecycle (continuous batching; DESIGN §6).

Many sequences decode together, each in a *row* of one KV cache allocated once for `max_rows` rows
of `max_context` tokens. Requests wait in a queue and join between steps; a row that finishes (EOS,
stop string, length) or is cancelled frees its slot at once, and the next request takes it. Every row
keeps its own sampling parameters, generator, stop strings and stream, so its output is the output of
that prompt decoded alone.

A row's `pending` tokens are those not yet in the cache; the last one is the root (the last emitted
token, or the prompt's last token). Each step:
  1. admit waiting requests into free rows;
  2. every row proposes its block: a prompt row the next chunk of its prompt (chunked prefill under a
     per-step token budget, so a long prompt never stalls the decoding rows for long); a decoding row
     its root plus its drafter's tree (empty without a drafter: plain autoregressive decoding). The
     step's draft-length rule (drafting/batch_length.py: BASS's shared length, a fixed one, or the
     cost-aware choice over the batch's measured forward cost) limits the trees before they are
     proposed and cuts them after;
  3. one target forward scores all rows' blocks, ragged: PAD (padded to the longest block, masked)
     or SPLIT (packed, attention per run of equal-length rows; short blocks padded into one), see attention.py;
  4. each row whose block reached its root is verified on its own (speculative.verify: greedy walk,
     sample-walk or RRS with the row's parameters) and commits its own number of tokens; the emitted
     tokens go to the row's stream, its drafter is told the verdict. Finished rows leave.

A row with a drafter reads its prompt but the root first, as one sequence does (speculative.py): the
drafter starts (`reset`) from the whole prompt, and from the target's activations of it when it
reads them (SPIRe), gathered chunk by chunk; its first tree then comes with the root.
"""
from __future__ import annotations

import itertools
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from specstack import interrupt
from specstack.attention import LAYOUTS, Layout, row_blocks_batch
from specstack.config import GenerationConfig
from specstack.drafting.base import DraftContext, Drafter
from specstack.drafting.batch_length import AsProposed, BatchLength
from specstack.engine.session import GenerationResult
from specstack.engine.speculative import verify
from specstack.engine.stats import RunStats, StepStats
from specstack.engine.stopping import TokenStream
from specstack.errors import SpecstackError
from specstack.models.base import LoadedModel
from specstack.prompts import check_context
from specstack.sampling import make_generator
from specstack.tree import DraftTree
from specstack.validate import MAX_TREE
from specstack.verify import VerifyResult

LayoutChoice = Literal["auto", "pad", "split"]
LAYOUT_CHOICES: tuple[LayoutChoice, ...] = ("auto", *LAYOUTS)
DEFAULT_PREFILL_CHUNK = 128  # prompt tokens per step over all joining rows (chunked prefill)
# tokens a row holds (prompt + output) unless the caller says otherwise: the cache is allocated up front
# for max_rows rows of this many tokens (the default model's full 8,192 would take 0.4 GB a row)
DEFAULT_MAX_CONTEXT = 2048


def kv_cache_bytes(lm: LoadedModel, rows: int, slots: int) -> int:
    """Bytes of a target KV cache of `rows` rows x `slots` slots (keys and values, every layer)."""
    cfg = lm.config
    probe = lm.model.new_cache(1, 1)  # the dtype the model keeps keys/values in
    return 2 * cfg.n_layers * rows * cfg.n_kv_heads * slots * cfg.head_dim * probe.k.element_size()


def default_kv_budget() -> int:
    """Half the machine's physical memory (the weights and activations need the rest)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no cap of our own
        return 1 << 62


@dataclass(frozen=True)
class BatchRequest:
    prompt_ids: Sequence[int]
    gen: GenerationConfig = field(default_factory=GenerationConfig)
    on_text: Callable[[str], None] | None = None  # this row's text as it becomes final (streaming)
    drafter: Drafter | None = None  # proposes this row's trees (None: the engine's, if it has drafters)
    speculate: bool = True  # False: this row decodes autoregressively even in a speculating engine


@dataclass
class BatchStats:
    """The engine's steps as data: where the time went and how full the batch was."""

    steps: int = 0
    rows: list[int] = field(default_factory=list)  # rows in each step's forward
    tokens: list[int] = field(default_factory=list)  # real tokens in each step's forward
    layouts: list[str] = field(default_factory=list)
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    verify_seconds: float = 0.0
    overhead_seconds: float = 0.0  # admitting, committing, streaming
    drafted: list[int] = field(default_factory=list)  # draft nodes verified in each step (over all rows)
    accepted: list[int] = field(default_factory=list)  # of them, accepted
    drafting: list[int] = field(default_factory=list)  # rows that verified a draft in each step

    def phase_seconds(self) -> dict[str, float]:
        return {"draft": self.draft_seconds, "target": self.target_seconds, "verify": self.verify_seconds,
                "overhead": self.overhead_seconds}


@dataclass
class _Block:
    """One row's part of a step's forward: `chain` (pending tokens, each continuing the last; a prompt
    chunk or the root alone) then `tree` hanging off the chain's last token when it is the root."""

    chain: list[int]
    tree: DraftTree
    reaches_root: bool  # the chain ends at the row's root: its logits are verified

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
class _Row:
    handle: int
    request: BatchRequest
    stream: TokenStream
    generator: torch.Generator | None
    pending: list[int]  # tokens not in the cache yet; the last is the root
    ctx: DraftContext
    stats: RunStats
    added: float  # when it joined the batch
    first_token: float | None = None
    started: bool = False  # its drafter has been reset with the prompt
    pooled: Drafter | None = None  # a drafter lent by the engine's pool for as long as the row runs
    # the target's activations of the prompt read so far ([1, T, L, d] chunks), for a drafter that reads them
    hidden: list[torch.Tensor] = field(default_factory=list)

    @property
    def drafter(self) -> Drafter | None:
        return self.request.drafter if self.request.drafter is not None else self.pooled

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.drafter.target_layers) if self.drafter is not None else ()


class BatchEngine:
    """Rows decode together; `add` queues a request, `step` runs one forward for all rows, `cancel`
    drops one. Single-threaded: the caller (a loop, the server's engine thread) drives it."""

    def __init__(self, lm: LoadedModel, max_rows: int = 8, max_context: int | None = None,
                 layout: LayoutChoice = "auto", prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 max_queue: int | None = None, max_tree: int = MAX_TREE, max_kv_bytes: int | None = None,
                 length: BatchLength | None = None, drafters: Callable[[], Drafter] | None = None) -> None:
        """max_kv_bytes: the most the KV cache may take (default: half the machine's memory); the cache is
        allocated here, once, and a batch that would not fit is refused rather than swapping or dying.
        length: the draft-length rule of every step (default: each row verifies what its drafter proposes).
        drafters: makes the drafter of a row whose request brings none (a method's factory: one per row at
        most, each reset as its next row joins), so every request speculates unless it opts out."""
        cfg = lm.config
        if max_rows < 1:
            raise SpecstackError(f"the batch needs at least one row, got {max_rows}")
        if layout not in LAYOUT_CHOICES:
            raise SpecstackError(f"unknown layout {layout!r}: choose from {', '.join(LAYOUT_CHOICES)}")
        if prefill_chunk < 1:
            raise SpecstackError(f"the prefill chunk must be at least one token, got {prefill_chunk}")
        self.max_context = min(max_context or DEFAULT_MAX_CONTEXT, cfg.max_seq_len)
        if self.max_context < 2:
            raise SpecstackError(f"a row needs a context of at least 2 tokens, got {self.max_context}")
        self.lm, self.model = lm, lm.model
        self.layout, self.prefill_chunk, self.max_queue, self.max_tree = layout, prefill_chunk, max_queue, max_tree
        self.length: BatchLength = length if length is not None else AsProposed()
        self.make_drafter = drafters
        self._pool: list[Drafter] = []  # drafters of rows that left, for the next ones
        # every row holds its context plus one block's scratch (a prompt chunk or root + tree)
        scratch = max(prefill_chunk, max_tree + 1)
        need = kv_cache_bytes(lm, max_rows, self.max_context + scratch)
        budget = default_kv_budget() if max_kv_bytes is None else max_kv_bytes
        if need > budget:
            raise SpecstackError(
                f"the KV cache for {max_rows} rows of {self.max_context} tokens needs {need / 2**30:.2f} GiB, over "
                f"the budget of {budget / 2**30:.2f} GiB: use fewer rows or a shorter context per row")
        self.cache = self.model.new_cache(0, self.max_context + scratch, max_rows=max_rows)
        self.max_rows = max_rows
        self.kv_bytes = self.cache.k.nbytes + self.cache.v.nbytes  # allocated once, never grows
        self.rows: list[_Row] = []  # row i of the cache
        self._starts: list[int] = []  # this step's flat index of each row's first token (_score)
        self.queue: deque[_Row] = deque()
        self.stats = BatchStats()
        self._next_handle = 0
        self._finished: dict[int, GenerationResult] = {}

    # -- lifecycle ----------------------------------------------------------------------------------
    def add(self, request: BatchRequest) -> int:
        """Queue a request; returns its handle. Bad requests are refused here, before they touch the
        batch: an empty prompt, one that leaves no room in a row's context, a full queue."""
        prompt = list(request.prompt_ids)
        check_context(len(prompt), self.max_context)
        if self.max_queue is not None and len(self.queue) >= self.max_queue:
            raise SpecstackError(f"the queue is full ({self.max_queue} requests waiting)")
        gen = request.gen
        max_new = min(gen.max_new_tokens, self.max_context - len(prompt))
        stream = TokenStream(self.lm.tokenizer, max_new, self.lm.eos_token_ids if gen.stop_on_eos else (),
                             gen.stop_strings, request.on_text)
        generator = make_generator(gen.sampling, self.model.device)
        row = _Row(self._next_handle, request, stream, generator, prompt,
                   DraftContext(list(prompt), gen.sampling, generator), RunStats(prompt_tokens=len(prompt)),
                   added=0.0)
        self._next_handle += 1
        self.queue.append(row)
        return row.handle

    def cancel(self, handle: int) -> bool:
        """Drop a waiting or running request (its row is free for the next step); False if unknown or
        already finished."""
        for i, row in enumerate(self.rows):
            if row.handle == handle:
                self._remove(i)
                return True
        for row in self.queue:
            if row.handle == handle:
                self.queue.remove(row)
                return True
        return False

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.queue)

    @property
    def running(self) -> int:
        return len(self.rows)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def emitted(self) -> dict[int, int]:
        """Tokens each running request has emitted so far (handle -> count): what a server streams and
        counts between steps."""
        return {row.handle: len(row.stream.tokens) for row in self.rows}

    def pop_result(self, handle: int) -> GenerationResult | None:
        return self._finished.pop(handle, None)

    def _admit(self) -> None:
        now = time.perf_counter()
        while self.queue and len(self.rows) < self.max_rows:
            row = self.queue.popleft()
            self.cache.add_row()
            row.added = now
            if row.request.drafter is None and row.request.speculate and self.make_drafter is not None:
                row.pooled = self._pool.pop() if self._pool else self.make_drafter()
            self.rows.append(row)

    def _remove(self, i: int) -> None:
        if self.rows[i].pooled is not None:
            self._pool.append(self.rows[i].pooled)
        moved = self.cache.remove_row(i)
        last = self.rows.pop()
        if moved is not None:
            self.rows[i] = last

    # -- one step -----------------------------------------------------------------------------------
    def step(self) -> list[tuple[int, GenerationResult]]:
        """Run one forward for every row; returns the requests that finished in it (handle, result)."""
        interrupt.check()  # Ctrl-C stops the run here, between steps
        t0 = time.perf_counter()
        self._admit()
        if not self.rows:
            return []
        t1 = time.perf_counter()
        blocks = self._propose()  # 1.
        t2 = time.perf_counter()
        layout, logits, hidden = self._score(blocks)  # 2.
        t3 = time.perf_counter()
        verdicts = self._verify(blocks, logits)  # 3.
        t4 = time.perf_counter()
        finished = self._commit(blocks, verdicts, hidden)  # 4.
        st = self.stats
        st.steps += 1
        st.rows.append(len(blocks))
        st.tokens.append(sum(len(b) for b in blocks))
        st.layouts.append(layout)
        st.drafted.append(sum(len(b.tree) for b in blocks))
        st.accepted.append(sum(len(v.accepted) for v in verdicts.values()))
        st.drafting.append(sum(1 for b in blocks if len(b.tree)))
        st.draft_seconds += t2 - t1
        st.target_seconds += t3 - t2
        st.verify_seconds += t4 - t3
        st.overhead_seconds += (t1 - t0) + (time.perf_counter() - t4)
        return finished

    def _propose(self) -> list[_Block]:
        """1. Each row's block: the pending tokens it reads this step (a prompt row: a chunk within the
        step's prefill budget; a row with a drafter reads its root only with its first tree), then, once
        the chunk reaches the root, its drafter's tree (drafters of one group propose together: one
        draft forward per draft step for all their rows), sized by the step's length rule."""
        limit = self.length.limit()
        takes = self._prefill_takes()
        blocks, drafting = [], []
        for i, (row, take) in enumerate(zip(self.rows, takes, strict=True)):
            n = len(row.pending)
            blocks.append(_Block(row.pending[:take], DraftTree(), reaches_root=take == n))
            if take == n and row.drafter is not None:  # a tree off the root, as for one row
                if not row.started:
                    row.drafter.reset(row.request.prompt_ids, self._prompt_hidden(row))
                    row.started, row.hidden = True, []
                row.ctx.limit = limit
                drafting.append(i)
        groups: dict[int, list[int]] = {}
        for i in drafting:
            group = getattr(self.rows[i].drafter, "group", None)
            if group is None:
                blocks[i].tree = self.rows[i].drafter.propose(self.rows[i].ctx)
            else:
                groups.setdefault(id(group), []).append(i)
        for members in groups.values():
            drafters = [self.rows[i].drafter for i in members]
            trees = drafters[0].group.propose_rows(drafters, [self.rows[i].ctx for i in members])
            for i, tree in zip(members, trees, strict=True):
                blocks[i].tree = tree
        for i in drafting:  # the tree may not outgrow the room left in the row's context
            room = min(self.max_tree, self.max_context - len(self.rows[i].ctx.tokens) - 1)
            blocks[i].tree = blocks[i].tree.truncated(max(0, room))
        # the step's draft length: rows with a drafter keep a prefix of their tree
        if drafting:
            keep = self.length.choose([blocks[i].tree for i in drafting], len(blocks),
                                      sum(len(b.chain) for b in blocks))
            for i, k in zip(drafting, keep, strict=True):
                blocks[i].tree = blocks[i].tree.truncated(k)
        return blocks

    def _prefill_takes(self) -> list[int]:
        """How many pending tokens each row reads this step: a decoding row its root; rows still reading
        their prompt share the step's prefill budget oldest request first (handles count up in arrival
        order). In slot order, a new request moved into a freed slot would go ahead of older ones still
        reading theirs, and under steady load an old one could wait many steps for its first token. A
        row with a drafter holds its root back for its first tree."""
        takes = [1 if len(row.pending) == 1 else 0 for row in self.rows]
        budget = self.prefill_chunk
        for i in sorted((i for i, t in enumerate(takes) if not t), key=lambda i: self.rows[i].handle):
            row = self.rows[i]
            takes[i] = min(len(row.pending) - (row.drafter is not None), budget)
            budget -= takes[i]
        return takes

    def _prompt_hidden(self, row: _Row) -> torch.Tensor | None:
        """[1, len(prompt) - 1, L, d]: the target's activations of the prompt but its root, for a drafter
        that reads them (None for one that does not)."""
        if not row.layers:
            return None
        if row.hidden:
            return torch.cat(row.hidden, 1)
        return torch.zeros(1, 0, len(row.layers), self.lm.config.d_model, device=self.model.device)

    def _score(self, blocks: Sequence[_Block]) -> tuple[Layout, torch.Tensor, dict[int, torch.Tensor]]:
        """2. One target forward over every row's block; the logits of each block that reached its root,
        from the root on (rows of blocks in order), and the activations drafters read ({layer: [N, d]},
        a token of row i's block at position j at flat index starts[i] + j, see _rows_of)."""
        counts = [len(b) for b in blocks]
        layout = self._layout(counts)
        batch = row_blocks_batch(self.cache, [b.parents for b in blocks], layout)
        width = max(counts)
        dev = self.model.device
        if layout == "split":  # packed: row i's tokens start after rows 0..i-1's
            ids = torch.tensor([[x for b in blocks for x in b.tokens]], device=dev)
            starts = [0, *itertools.accumulate(counts[:-1])]
        else:  # padded to the widest block
            ids = torch.tensor([b.tokens + [0] * (width - len(b)) for b in blocks], device=dev)
            starts = [i * width for i in range(len(blocks))]
        self._starts = starts
        index = torch.tensor([s + j for s, b in zip(starts, blocks, strict=True) if b.reaches_root
                              for j in range(len(b.chain) - 1, len(b))], dtype=torch.long, device=dev)
        layers = sorted({layer for row in self.rows for layer in row.layers})
        out = self.model.forward(ids, batch, self.cache, layers, logit_rows=index)
        hidden = {layer: h.reshape(-1, h.shape[-1]) for layer, h in out.hidden.items()}
        return layout, out.logits[0], hidden

    def _rows_of(self, i: int, row: _Row, hidden: dict[int, torch.Tensor], first: int, n: int) -> torch.Tensor:
        """[1, n, L, d]: the activations row i's drafter reads, of its block's tokens first .. first + n - 1."""
        at = self._starts[i] + first
        return torch.stack([hidden[layer][at : at + n] for layer in row.layers], 1).unsqueeze(0)

    def _verify(self, blocks: Sequence[_Block], logits: torch.Tensor) -> dict[int, VerifyResult]:
        """3. Each row that reached its root, verified on its own (its sampling, its generator)."""
        verdicts, at = {}, 0
        for i, (row, block) in enumerate(zip(self.rows, blocks, strict=True)):
            if block.reaches_root:
                k = 1 + len(block.tree)  # root + tree
                verdicts[i] = verify(block.tree, logits[at : at + k], row.request.gen.sampling, row.generator)
                at += k
        return verdicts

    def _commit(self, blocks: Sequence[_Block], verdicts: dict[int, VerifyResult],
                hidden: dict[int, torch.Tensor]) -> list[tuple[int, GenerationResult]]:
        """4. Each row commits its chain and accepted path, streams its tokens, tells its drafter; the
        length rule learns from the rows that drafted; finished rows leave."""
        done: list[int] = []
        drafted: list[DraftTree] = []
        accepted: list[int] = []
        for i, (row, block) in enumerate(zip(self.rows, blocks, strict=True)):
            chain = len(block.chain)
            result = verdicts.get(i)
            if result is None:  # a prompt chunk: all of it is context
                self.cache.commit_nodes(i, list(range(chain)))
                row.pending = row.pending[chain:]
                if row.layers and chain:  # the drafter will start from these activations
                    row.hidden.append(self._rows_of(i, row, hidden, 0, chain))
                continue
            self.cache.commit_nodes(i, list(range(chain)) + [chain + a for a in result.accepted])
            if row.drafter is not None:  # its block is the root and the tree (the root was held back)
                seen = self._rows_of(i, row, hidden, 0, 1 + len(block.tree)) if row.layers else None
                row.drafter.observe(block.tree, result, seen)
                drafted.append(block.tree)
                accepted.append(len(result.accepted))
            taken = row.stream.push(result.tokens)
            row.ctx.tokens.extend(result.tokens)
            row.pending = [result.tokens[-1]]
            if row.drafter is not None:  # every forward with a tree is a step (as for one row)
                step = StepStats()
                step.record(block.tree, result, taken)
                row.stats.add_step(step)
            elif row.first_token is not None:  # without: the forward that read the prompt's end is prefill
                row.stats.target_forwards += 1
            if row.first_token is None:
                row.first_token = time.perf_counter()
            if row.stream.done or len(row.ctx.tokens) >= self.max_context:
                done.append(i)
        self.length.observe(drafted, accepted)
        finished = []
        end = time.perf_counter()
        for i in sorted(done, reverse=True):  # removing moves the last row: go from the back
            row = self.rows[i]
            result = self._result(row, end)
            self._finished[row.handle] = result
            finished.append((row.handle, result))
            self._remove(i)
        return finished

    def _layout(self, counts: Sequence[int]) -> Layout:
        if self.layout != "auto":
            return self.layout
        # equal blocks need no padding: one attention call (PAD) beats runs of them; ragged blocks
        # (a prompt chunk beside decoding rows, trees of different sizes) would pad every row
        return "pad" if min(counts) == max(counts) else "split"

    def _result(self, row: _Row, end: float) -> GenerationResult:
        rs = row.stats
        rs.new_tokens = len(row.stream.tokens)
        first = row.first_token or end
        rs.prefill_seconds = first - row.added
        rs.decode_seconds = end - first
        return GenerationResult(list(row.request.prompt_ids), row.stream.tokens, row.stream.text,
                                row.stream.finish_reason or "length", rs)

    # -- convenience --------------------------------------------------------------------------------
    def run(self, requests: Sequence[BatchRequest],
            on_step: Callable[[BatchEngine, list[tuple[int, GenerationResult]]], None] | None = None,
            ) -> list[GenerationResult]:
        """Decode every request (at most max_rows at once, the rest queued) and return the results in
        request order."""
        handles = [self.add(r) for r in requests]
        while self.busy:
            finished = self.step()
            if on_step is not None:
                on_step(self, finished)
        return [self._finished.pop(h) for h in handles]


def generate_batch(lm: LoadedModel, prompts: Sequence[Sequence[int]], gen: GenerationConfig | Sequence[GenerationConfig],
                   batch_size: int = 8, layout: LayoutChoice = "auto",
                   on_step: Callable[[BatchEngine, list[tuple[int, GenerationResult]]], None] | None = None,
                   drafters: Callable[[], Drafter] | None = None, length: BatchLength | None = None,
                   ) -> list[GenerationResult]:
    """Decode prompts `batch_size` rows at a time (continuous batching: a finished row's slot takes the
    next prompt at once). One GenerationConfig for all, or one per prompt. drafters, length: a method's
    drafter factory and draft-length rule (engine/methods.py: drafter_factory, length_rule); None: `ar`."""
    gens = [gen] * len(prompts) if isinstance(gen, GenerationConfig) else list(gen)
    if len(gens) != len(prompts):
        raise SpecstackError(f"{len(gens)} generation settings for {len(prompts)} prompts")
    longest = max((len(p) + g.max_new_tokens for p, g in zip(prompts, gens, strict=True)), default=2)
    engine = BatchEngine(lm, max_rows=min(batch_size, max(1, len(prompts))),
                         max_context=min(lm.config.max_seq_len, longest), layout=layout, length=length,
                         drafters=drafters)
    return engine.run([BatchRequest(p, g) for p, g in zip(prompts, gens, strict=True)], on_step)
