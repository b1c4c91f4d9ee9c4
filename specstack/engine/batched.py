"""The engine: rows of one KV cache decoding together, continuous batching, speculation per row (BASS;
DESIGN §6). One sequence is a batch of one (`generate`), so every method, one row or many, runs this loop.

Many sequences decode together, each in a *row* of one KV cache allocated once for `max_rows` rows
of `max_context` tokens. Requests wait in a queue and join between steps; a row that finishes (EOS,
stop string, length) or is cancelled frees its slot at once, and the next request takes it. Every row
keeps its own sampling parameters, generator, stop strings and stream, so its output is the output of
that prompt decoded alone.

A row's `pending` tokens are those not yet in the cache; the last one is the root (the last emitted
token, or the prompt's last token). Each step:
  1. plan (engine/plan.py, pure): which waiting requests take free rows, how many pending tokens each
     row reads, and how many draft nodes each decoding row may add, all under one token budget;
  2. every row builds its block (engine/propose.py): a prompt row the chunk the plan gave it; a decoding
     row its root plus its drafter's tree (empty without a drafter: plain autoregressive decoding), the
     trees limited by the plan and by the step's draft-length rule (drafting/batch_length.py), which cuts them after;
  3. one target forward scores all rows' blocks, ragged: PAD (padded to the longest block, masked)
     or SPLIT (packed, attention per run of equal-length rows; short blocks padded into one), see attention.py;
  4. each row whose block reached its root is verified on its own (engine/verify_rows.py; verify.verify_tree: greedy walk,
     sample-walk or RRS with the row's parameters);
  5. each row commits its own number of tokens (engine/commit.py, one function a job): the emitted
     tokens go to the row's stream, its drafter is told the verdict. Finished rows leave.

A row reads its root with its prompt's last chunk, whose forward gives its first token, as autoregressive
decoding's does; its drafter starts (`reset`) from the whole prompt then, and its first tree comes with
that token. A drafter that reads the target's activations of the prompt (SPIRe) starts from them, gathered
chunk by chunk: its row reads all but the root first, and its first tree comes with the root. Drafters
are lent to rows from one pool per factory: the engine's (a method's) for requests that bring none, or
the request's own.
"""
from __future__ import annotations

import itertools
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from specstack import interrupt
from specstack.attention import LAYOUTS, Layout, row_blocks_batch
from specstack.config import DEFAULT_MAX_CONTEXT, DEFAULT_STEP_TOKENS, GenerationConfig
from specstack.drafting.base import DraftContext, Drafter
from specstack.drafting.batch_length import AsProposed, BatchLength
from specstack.engine import commit
from specstack.engine.commit import Activations, Settled
from specstack.engine.plan import RowState, StepPlan, plan_step
from specstack.engine.prefix_rows import attach, look_up, publish
from specstack.engine.propose import propose_blocks
from specstack.engine.rows import BatchRequest, Block, DrafterFactory, DrafterPool, Row
from specstack.engine.stats import BatchStats, GenerationResult, RunStats, StepStats
from specstack.engine.stopping import TokenStream
from specstack.engine.verify_rows import Verdict, verify_rows
from specstack.errors import SpecstackError
from specstack.grammar import GrammarCompiler, compiler_for
from specstack.models.base import LoadedModel
from specstack.prefix_cache import PrefixCache
from specstack.processing import RowProcessor, TokenLogprob
from specstack.prompts import check_context
from specstack.sampling import make_generator
from specstack.tree import DraftTree
from specstack.validate import MAX_TREE

LayoutChoice = Literal["auto", "pad", "split"]
LAYOUT_CHOICES: tuple[LayoutChoice, ...] = ("auto", *LAYOUTS)


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


class BatchEngine:
    """Rows decode together; `add` queues a request, `step` runs one forward for all rows, `cancel`
    drops one. Single-threaded: the caller (a loop, the server's engine thread) drives it."""

    def __init__(self, lm: LoadedModel, max_rows: int = 8, max_context: int | None = None,
                 layout: LayoutChoice = "auto", step_tokens: int = DEFAULT_STEP_TOKENS, max_tree: int = MAX_TREE,
                 max_kv_bytes: int | None = None, length: BatchLength | None = None,
                 drafters: DrafterFactory | None = None, pool: DrafterPool | None = None,
                 prefix_cache: PrefixCache | None = None) -> None:
        """step_tokens: the one token budget of a step (engine/plan.py), prompt chunks and draft nodes
        together; a decoding row's root is never cut, so a step may exceed it by the roots it could not hold.
        max_kv_bytes: the most the KV cache may take (default: half the machine's memory); the cache is
        allocated here, once, and a batch that would not fit is refused rather than swapping or dying.
        length: the draft-length rule of every step (default: each row verifies what its drafter proposes).
        drafters: makes the drafter of a row whose request brings none (a method's factory: one per row at
        most, each reset as its next row joins), so every request speculates unless it opts out.
        pool: where rows' drafters are lent from (default: the engine's own; a caller running many engines
        one after another may share one, so drafters made for one batch serve the next).
        prefix_cache: keeps the keys/values of prompts read (prefix_cache.py) so that a request
        starting the same way reads only what is new; None: every request reads its whole prompt."""
        cfg = lm.config
        if max_rows < 1:
            raise SpecstackError(f"the batch needs at least one row, got {max_rows}")
        if layout not in LAYOUT_CHOICES:
            raise SpecstackError(f"unknown layout {layout!r}: choose from {', '.join(LAYOUT_CHOICES)}")
        if step_tokens < 1:
            raise SpecstackError(f"a step's token budget must be at least one token, got {step_tokens}")
        self.max_context = min(max_context or DEFAULT_MAX_CONTEXT, cfg.max_seq_len)
        if self.max_context < 2:
            raise SpecstackError(f"a row needs a context of at least 2 tokens, got {self.max_context}")
        self.lm, self.model = lm, lm.model
        self.layout, self.step_tokens, self.max_tree = layout, step_tokens, max_tree
        self.length: BatchLength = length if length is not None else AsProposed()
        self.make_drafter = drafters
        self.pool = pool if pool is not None else DrafterPool()
        # a block is written past its row's committed tokens: a tree past the context, and, padded (PAD
        # forced with several rows), any row's block as wide as the step's widest
        scratch = max(step_tokens, max_tree + 1) if layout == "pad" and max_rows > 1 else max_tree + 1
        need = kv_cache_bytes(lm, max_rows, self.max_context + scratch)
        budget = default_kv_budget() if max_kv_bytes is None else max_kv_bytes
        if need > budget:
            raise SpecstackError(
                f"the KV cache for {max_rows} rows of {self.max_context} tokens needs {need / 2**30:.2f} GiB, over "
                f"the budget of {budget / 2**30:.2f} GiB: use fewer rows or a shorter context per row")
        self.cache = self.model.new_cache(0, self.max_context + scratch, max_rows=max_rows)
        self.max_rows = max_rows
        self.kv_bytes = self.cache.k.nbytes + self.cache.v.nbytes  # allocated once, never grows
        self.rows: list[Row] = []  # row i of the cache
        self.queue: deque[Row] = deque()
        self.stats = BatchStats()
        self._next_handle = 0
        self._finished: dict[int, GenerationResult] = {}
        self.prefix = prefix_cache
        self._grammars: GrammarCompiler | None = None

    @property
    def grammars(self) -> GrammarCompiler:
        """The target's vocabulary as the grammar engine reads it, built at the first grammar (seconds)."""
        if self._grammars is None:
            lm = self.lm
            self._grammars = compiler_for(lm.tokenizer, lm.config.vocab_size, lm.eos_token_ids)
        return self._grammars

    # -- lifecycle ----------------------------------------------------------------------------------
    def add(self, request: BatchRequest) -> int:
        """Queue a request; returns its handle. A bad request is refused here, before it touches the
        batch: an empty prompt, one that leaves no room in a row's context."""
        prompt = list(request.prompt_ids)
        check_context(len(prompt), self.max_context)
        gen = request.gen
        max_new = min(gen.max_new_tokens, self.max_context - len(prompt))
        eos = (*self.lm.eos_token_ids, *gen.stop_ids) if gen.stop_on_eos else ()
        stream = TokenStream(self.lm.tokenizer, max_new, eos, gen.stop_strings, request.on_text, gen.editor,
                             request.on_spans)
        generator = make_generator(gen.sampling, self.model.device)
        processor = None
        if gen.processed:  # a grammar that does not compile is refused here
            processor = RowProcessor(gen, prompt, self.lm.config.vocab_size,
                                     self.grammars if gen.grammar is not None else None)
        factory = None
        if request.drafter is None and request.speculate:
            factory = request.drafter_factory if request.drafter_factory is not None else self.make_drafter
        row = Row(self._next_handle, request, stream, generator, prompt,
                   DraftContext(list(prompt), gen.sampling, generator,
                                rule=processor.along if processor is not None else None), RunStats(prompt_tokens=len(prompt)), factory,
                   processor=processor)
        self._next_handle += 1
        self.queue.append(row)
        return row.handle

    def cancel(self, handle: int) -> bool:
        """Drop a waiting or running request (its row is free for the next step); False if unknown or
        already finished."""
        for i, row in enumerate(self.rows):
            if row.handle == handle:
                row.move(RowState.CANCELLED)
                self._publish(i)  # what it read serves the next request (an editor cancels and resends)
                self._remove(i)
                return True
        for row in self.queue:
            if row.handle == handle:
                row.move(RowState.CANCELLED)
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

    def logprobs(self) -> dict[int, list[TokenLogprob]]:
        """Each running request's tokens' log-probabilities so far (handle -> a live list; empty when not
        asked for): what a server streams beside the text."""
        return {row.handle: row.stream.logprobs for row in self.rows}

    def pop_result(self, handle: int) -> GenerationResult | None:
        return self._finished.pop(handle, None)

    def plan(self) -> StepPlan:
        """The next step's plan (engine/plan.py) from the rows and the queue as they are (the rows that
        have read nothing yet counting their cached prefixes as read)."""
        positions = self.lm.config.max_seq_len
        free = self.max_rows - len(self.rows)
        self._look_up([*self.rows, *itertools.islice(self.queue, free)])
        return plan_step([r.view(positions, self.pool) for r in self.rows],
                         [r.view(positions, self.pool) for r in self.queue], free, self.step_tokens, self.max_tree)

    def _look_up(self, rows: Sequence[Row]) -> None:
        if self.prefix is not None:
            look_up(self.prefix, self.rows, rows)

    def _attach(self, plan: StepPlan) -> None:
        if self.prefix is not None:
            attach(self.prefix, self.cache, self.rows, plan)

    def _publish(self, i: int) -> None:
        if self.prefix is not None:
            publish(self.prefix, self.cache, i, self.rows[i])

    def _admit(self, n: int) -> None:
        now = time.perf_counter()
        for _ in range(n):
            row = self.queue.popleft()
            self.cache.add_row()
            row.added = now
            row.move(RowState.DECODING if len(row.pending) == 1 else RowState.PREFILLING)
            if row.factory is not None:
                row.lent = self.pool.lend(row.factory)
            self.rows.append(row)

    def _remove(self, i: int) -> None:
        row = self.rows[i]
        if row.lent is not None and row.factory is not None:
            self.pool.give_back(row.factory, row.lent)
            row.lent = None
        moved = self.cache.remove_row(i)
        last = self.rows.pop()
        if moved is not None:
            self.rows[i] = last

    # -- one step -----------------------------------------------------------------------------------
    def step(self) -> list[tuple[int, GenerationResult]]:
        """Run one forward for every row; returns the requests that finished in it (handle, result)."""
        interrupt.check()  # Ctrl-C stops the run here, between steps
        t0 = time.perf_counter()
        plan = self.plan()  # 1.
        self._admit(plan.admit)
        self._attach(plan)
        if not self.rows:
            return []
        t1 = time.perf_counter()
        blocks, draft_forwards = propose_blocks(self.rows, plan, self.length, self.lm.config.d_model, self.model.device)  # 2.
        t2 = time.perf_counter()
        layout, logits, seen = self._score(blocks)  # 3.
        t3 = time.perf_counter()
        verdicts = verify_rows(self.rows, blocks, logits)  # 4.
        t4 = time.perf_counter()
        finished = self._commit(blocks, verdicts, seen, (t2 - t1, t3 - t2, t4 - t3))  # 5.
        st = self.stats
        st.add(commit.step_record(blocks, verdicts, layout, draft_forwards))
        st.draft_seconds += t2 - t1
        st.target_seconds += t3 - t2
        st.verify_seconds += t4 - t3
        st.overhead_seconds += (t1 - t0) + (time.perf_counter() - t4)
        return finished

    def _score(self, blocks: Sequence[Block]) -> tuple[Layout, torch.Tensor, Activations]:
        """3. One target forward over every row's block; the logits of each block that reached its root,
        from the root on (rows of blocks in order), and the activations drafters read."""
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
        for row, b in zip(self.rows, blocks, strict=True):  # a prompt's log-probabilities: its chunk's rows
            b.scored = len(b.chain) - b.reaches_root if row.request.gen.prompt_logprobs and not row.first_token else 0
        index = torch.tensor([s + j for s, b in zip(starts, blocks, strict=True)
                              for j in [*range(b.scored), *(range(len(b.chain) - 1, len(b)) if b.reaches_root else ())]],
                             dtype=torch.long, device=dev)
        layers = sorted({layer for row in self.rows for layer in row.layers})
        out = self.model.forward(ids, batch, self.cache, layers, logit_rows=index)
        hidden = {layer: h.reshape(-1, h.shape[-1]) for layer, h in out.hidden.items()}
        return layout, out.logits[0], Activations(hidden, starts)

    def _commit(self, blocks: Sequence[Block], verdicts: dict[int, Verdict], seen: Activations,
                seconds: tuple[float, float, float]) -> list[tuple[int, GenerationResult]]:
        """5. Each row keeps what its forward gave it (engine/commit.py); the length rule learns from the
        rows that drafted; finished rows leave. seconds: the step's draft, target and verify time."""
        t0 = time.perf_counter()
        settled: list[tuple[int, Settled]] = []
        drafted: list[DraftTree] = []
        accepted: list[int] = []
        steps: list[StepStats] = []
        for i, (row, block) in enumerate(zip(self.rows, blocks, strict=True)):
            verdict = verdicts.get(i)
            if verdict is None:
                settled.append((i, commit.chunk(self.cache, i, row, block, seen)))
                continue
            result, lps = verdict
            commit.path(self.cache, i, block, result)
            if row.drafter is not None:
                commit.tell_drafter(i, row, block, result, seen)
                drafted.append(block.tree)
                accepted.append(len(result.accepted))
            step = commit.record_round(row, block, result, commit.emit(row, block, result, lps), seconds)
            steps += [step] if step is not None else []
            settled.append((i, commit.settle(row, self.max_context)))
        self.length.observe(drafted, accepted)
        end = time.perf_counter()
        for step in steps:
            step.overhead_seconds = end - t0
        return self._settle(settled, end)

    def _settle(self, settled: Sequence[tuple[int, Settled]], end: float) -> list[tuple[int, GenerationResult]]:
        """Rows whose prompt is read publish it; finished rows publish prompt and answer (a chat's next turn
        starts with both), return their results and leave (from the back: removing moves the last row)."""
        finished = []
        for i, how in sorted(settled, key=lambda s: -s[0]):
            if how is Settled.GOING:
                continue
            self._publish(i)
            if how is Settled.FINISHED:
                row = self.rows[i]
                out = self._result(row, end)
                self._finished[row.handle] = out
                finished.append((row.handle, out))
                self._remove(i)
        return finished

    def _layout(self, counts: Sequence[int]) -> Layout:
        if self.layout != "auto":
            return self.layout
        # equal blocks need no padding: one attention call (PAD) beats runs of them; ragged blocks
        # (a prompt chunk beside decoding rows, trees of different sizes) would pad every row
        return "pad" if min(counts) == max(counts) else "split"

    def _result(self, row: Row, end: float) -> GenerationResult:
        rs = row.stats
        rs.new_tokens = len(row.stream.tokens)
        prefilled = row.prefilled or end
        rs.prefill_seconds = prefilled - row.added
        rs.decode_seconds = end - prefilled
        return GenerationResult(list(row.request.prompt_ids), row.stream.tokens, row.stream.text,
                                row.stream.finish_reason or "length", rs, row.stream.origins, row.stream.stop_word,
                                row.stream.logprobs if row.request.gen.logprobs is not None else None,
                                row.prompt_logprobs if row.request.gen.prompt_logprobs else None)

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


def generate(lm: LoadedModel, prompt_ids: Sequence[int], gen: GenerationConfig,
             on_text: Callable[[str], None] | None = None, drafter: Drafter | None = None,
             length: BatchLength | None = None, max_tree: int = MAX_TREE) -> GenerationResult:
    """One sequence: the engine with one row, its cache sized for the prompt and its new tokens, its
    step budget wide enough to read the whole prompt in one forward. drafter: proposes its trees (None:
    autoregressive decoding); length: the draft-length rule of every step (None: as proposed)."""
    prompt = list(prompt_ids)
    cfg = lm.config
    check_context(len(prompt), cfg.max_seq_len)
    engine = BatchEngine(lm, max_rows=1, max_context=max(2, min(cfg.max_seq_len, len(prompt) + gen.max_new_tokens)),
                         step_tokens=max(DEFAULT_STEP_TOKENS, len(prompt)), max_tree=max_tree, length=length)
    return engine.run([BatchRequest(prompt, gen, on_text, drafter=drafter, speculate=drafter is not None)])[0]


def generate_batch(lm: LoadedModel, prompts: Sequence[Sequence[int]], gen: GenerationConfig | Sequence[GenerationConfig],
                   batch_size: int = 8, layout: LayoutChoice = "auto",
                   on_step: Callable[[BatchEngine, list[tuple[int, GenerationResult]]], None] | None = None,
                   drafters: DrafterFactory | None = None, length: BatchLength | None = None,
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
