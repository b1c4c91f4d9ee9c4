"""The engine thread: one BatchEngine driven step after step, fed by the HTTP handlers.

The event loop never runs a forward: handlers `submit` jobs (one per choice: a prompt's n samples are
n rows) and `cancel` them through a thread-safe inbox, and get their text back through a `Sink` (the
handler's own way into its event loop). The thread drains the inbox between steps, so a request joins
the running batch at the next step and a cancelled one (a client gone) leaves it at the next step too:
its row is free before the step after. When nothing runs the thread sleeps on the inbox.

Capacity is reserved at submit, under a lock, so a full server answers at once (503) instead of
queueing without bound: at most `capacity` jobs (the batch's rows plus the queue) are in flight.

Per-request methods: a job may ask for another method than the server's (`speculation` in the body).
`ar` opts the row out of drafting; any other method's rows are lent drafters by the engine's pool from
that method's factory, built by `build` on first use (`prepare`: the handler runs it off the event loop, so a
method that cannot run here is refused before the request is queued). All rows share
the server's draft-length rule, which sizes every drafting row's tree for the step's measured cost.
Clients may name any number of methods over a server's life, so at most MAX_METHODS factories are kept:
past that, the least recently used one that no job in flight uses is dropped with its idle drafters
(its draft model and trigram stay on the server's shelf, engine/draft_sources.py); a later request for
it builds it again.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from specstack.config import GenerationConfig
from specstack.engine.batched import BatchEngine, BatchRequest
from specstack.engine.rows import DrafterFactory
from specstack.engine.stats import GenerationResult
from specstack.engine.stopping import Span
from specstack.errors import SpecstackError
from specstack.processing import TokenLogprob
from specstack.server.metrics import ServerMetrics

MAX_METHODS = 8  # per-request methods whose drafter factories (and idle drafters) are kept


@dataclass(frozen=True)
class Event:
    """What a job sends its handler: new text (and its token count so far); the last event of a job
    carries its result, or an error."""

    text: str = ""
    tokens: int = 0
    result: GenerationResult | None = None
    error: str | None = None
    spans: tuple[Span, ...] = ()  # `text` cut at its tokens, each piece with their origin (jobs that asked)
    logprobs: tuple[TokenLogprob, ...] = ()  # the log-probabilities of the tokens emitted since the last event


Sink = Callable[[Event], None]


class Overloaded(Exception):
    """No room for the job: the batch and the queue are full."""


@dataclass
class Job:
    id: int
    prompt_ids: list[int]
    gen: GenerationConfig
    method: str | None  # None: the server's method; one whose factory is None (ar): no drafting
    sink: Sink
    arrived: float = field(default_factory=time.perf_counter)
    handle: int | None = None  # the engine's, once added
    pieces: list[str] = field(default_factory=list)  # text released in this step, sent after it
    tokens: int = 0  # tokens sent so far
    last: float | None = None  # when its tokens last arrived
    spans: list[Span] | None = None  # pieces with their origins released in this step (None: not asked)
    logprobs_sent: int = 0  # log-probabilities sent so far


class EngineWorker:
    def __init__(self, engine: BatchEngine, metrics: ServerMetrics, capacity: int, method: str,
                 build: Callable[[str], DrafterFactory | None]) -> None:
        """method: the server's method (its drafters are the engine's); build: a method name -> its drafter
        factory (None: autoregressive), for requests that pick another."""
        self.engine, self.metrics, self.capacity, self.method, self.build = engine, metrics, capacity, method, build
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._next_id = 0
        self._jobs: dict[int, Job] = {}  # by job id, on the engine thread
        self._by_handle: dict[int, Job] = {}
        self._factories: dict[str, DrafterFactory | None] = {}  # built by prepare(), before submit
        self._build_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="specstack-engine", daemon=True)
        if engine.prefix is not None:  # its series exist from the start, as a scraper expects
            metrics.prefix_cache(engine.prefix)

    # -- called from the event loop -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, jobs: list[tuple[list[int], GenerationConfig, Sink]], method: str | None,
               spans: bool = False) -> list[int]:
        """Queue the jobs of one request, all or none (Overloaded when there is no room for all). spans:
        their events carry the origins of their text."""
        with self._lock:
            if self._in_flight + len(jobs) > self.capacity:
                raise Overloaded()
            self._in_flight += len(jobs)
            ids = list(range(self._next_id, self._next_id + len(jobs)))
            self._next_id += len(jobs)
        for i, (prompt, gen, sink) in zip(ids, jobs, strict=True):
            self._inbox.put(("submit", Job(i, prompt, gen, None if method == self.method else method, sink,
                                           spans=[] if spans else None)))
        return ids

    def prepare(self, method: str) -> None:
        """Build `method`'s drafter factory (a draft model loads here) before a request that picks it is
        submitted, so a method that cannot run here is the request's error (400), not the engine's. Run
        it off the event loop: it may take seconds."""
        if method == self.method:
            return
        with self._build_lock:
            if method not in self._factories:
                self._factories[method] = self.build(method)
            self._factories[method] = self._factories.pop(method)  # the most recently used last

    def cancel(self, ids: list[int]) -> None:
        """Drop jobs that have not finished (a finished or unknown id is ignored)."""
        for i in ids:
            self._inbox.put(("cancel", i))

    @property
    def in_flight(self) -> int:
        """Jobs (rows) taken and not yet finished: decoding in the batch or waiting for a row."""
        with self._lock:
            return self._in_flight

    @property
    def alive(self) -> bool:
        """The engine thread runs (it ends only on stop)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        self._inbox.put(("stop", None))
        self._thread.join(timeout=30)

    # -- the engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if not self._drain(block=not self.engine.busy):
                self._fail_all("the server is shutting down")
                return
            if not self.engine.busy:
                continue
            try:
                finished = self.engine.step()
            except Exception:  # a bug: fail what runs, keep serving the next requests
                traceback.print_exc()
                self._fail_all("internal error in the engine (see the server's log)")
                continue
            self._after_step(finished)

    def _drain(self, block: bool) -> bool:
        """Take every message waiting (at least one when `block`); False on stop."""
        while True:
            try:
                kind, payload = self._inbox.get(block=block, timeout=None)
            except queue.Empty:
                break
            block = False
            if kind == "stop":
                return False
            if kind == "submit":
                self._add(payload)  # type: ignore[arg-type]
            else:
                self._cancel(payload)  # type: ignore[arg-type]
        self.metrics.queue(self.engine.running, self.engine.waiting)
        return True

    def _add(self, job: Job) -> None:
        try:
            drafters = None
            if job.method is not None:  # a factory of None: a method that does not draft (ar)
                self.prepare(job.method)  # done already by the handler; here for callers that did not
                drafters = self._factories[job.method]
                self._trim_methods(job.method)
            request = BatchRequest(job.prompt_ids, job.gen, on_text=job.pieces.append, drafter_factory=drafters,
                                   speculate=job.method is None or drafters is not None,
                                   on_spans=None if job.spans is None else job.spans.extend)
            job.handle = self.engine.add(request)
        except SpecstackError as e:  # a method whose draft cannot load, a prompt over the context
            self._release(job)
            job.sink(Event(error=str(e)))
            return
        self._jobs[job.id] = job
        self._by_handle[job.handle] = job
        self.metrics.admitted(len(job.prompt_ids))

    def _trim_methods(self, keep: str) -> None:
        """Drop the least recently used methods' factories past MAX_METHODS, each with its idle drafters,
        but never one that a job in flight (or `keep`, the job being added) uses: no row holds a drafter
        of a dropped factory, and none will (a later job rebuilds it in prepare)."""
        with self._build_lock:
            busy = {job.method for job in self._jobs.values()} | {keep}
            for name in list(self._factories):  # least recently used first
                if len(self._factories) <= MAX_METHODS:
                    break
                if name not in busy:
                    factory = self._factories.pop(name)
                    if factory is not None:
                        self.engine.pool.drop(factory)

    def _release(self, job: Job) -> None:
        self._jobs.pop(job.id, None)
        if job.handle is not None:
            self._by_handle.pop(job.handle, None)
        with self._lock:
            self._in_flight -= 1

    def _cancel(self, job_id: int) -> None:
        job = self._jobs.get(job_id)
        if job is None:
            return
        if job.handle is not None:
            self.engine.cancel(job.handle)
        self._release(job)
        self.metrics.cancelled()

    def _after_step(self, finished: list[tuple[int, GenerationResult]]) -> None:
        """Send every job the text its row released in the step; a finished job gets its result too."""
        now = time.perf_counter()
        last = self.engine.stats.last
        if last is not None:
            self.metrics.step(last.rows, last.drafted, last.accepted, last.drafting)
        if self.engine.prefix is not None:
            self.metrics.prefix_cache(self.engine.prefix)
        done = dict(finished)
        counts = self.engine.emitted() | {h: len(r.tokens) for h, r in finished}
        logprobs = self.engine.logprobs() | {h: r.logprobs or [] for h, r in finished}
        for handle, n in counts.items():
            job = self._by_handle[handle]
            new = n - job.tokens
            if new > 0:
                if job.tokens == 0:
                    self.metrics.first_token(now - job.arrived)
                self.metrics.tokens(new, None if job.last is None else now - job.last)
                job.last, job.tokens = now, n
            text = "".join(job.pieces)
            job.pieces.clear()
            spans: tuple[Span, ...] = ()
            if job.spans:
                spans = tuple(job.spans)
                job.spans.clear()
            lps = tuple(logprobs[handle][job.logprobs_sent:])
            job.logprobs_sent += len(lps)
            if handle in done:
                result = done[handle]
                self.engine.pop_result(handle)  # the engine keeps no result a caller took
                self.metrics.finished(result, finish_reason(result), now - job.arrived)
                self._release(job)
                job.sink(Event(text, n, result=result, spans=spans, logprobs=lps))
            elif new > 0 or text:
                job.sink(Event(text, n, spans=spans, logprobs=lps))
        self.metrics.queue(self.engine.running, self.engine.waiting)

    def _fail_all(self, message: str) -> None:
        for job in list(self._jobs.values()):
            if job.handle is not None:
                self.engine.cancel(job.handle)
            self._release(job)
            job.sink(Event(error=message))
        stop = False
        while True:  # jobs submitted but not yet taken
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._release(payload)  # type: ignore[arg-type]
                payload.sink(Event(error=message))  # type: ignore[attr-defined]
            stop = stop or kind == "stop"
        if stop:  # a stop that came while a step failed: the next drain ends the thread
            self._inbox.put(("stop", None))


def finish_reason(result: GenerationResult) -> str:
    """OpenAI's: EOS and a stop string are both `stop`."""
    return "length" if result.finish_reason == "length" else "stop"
