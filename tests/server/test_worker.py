"""The server's engine thread (server/worker.py) in this process, with a real tiny BatchEngine and no
HTTP: jobs go in through `submit` and `cancel`, text and results come out through each job's sink;
capacity is reserved at submit (all of a request's jobs or none); an engine step that raises fails the
jobs it ran with an error event and the thread goes on serving the next request as if alone."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from specstack.config import GenerationConfig
from specstack.engine.batched import BatchEngine, BatchRequest
from specstack.server.metrics import ServerMetrics
from specstack.server.worker import EngineWorker, Event, Overloaded
from specstack.tree import DraftTree

CONTEXT = 256
WAIT = 60  # seconds a test waits for an event before it fails (the tiny model answers in milliseconds)
PROMPTS = [[9707, 11, 1879, 0], [785, 6722, 315, 9625, 374], [750]]  # token ids of the default tokenizer
LONG = GenerationConfig(max_new_tokens=200, stop_on_eos=False)
SHORT = GenerationConfig(max_new_tokens=12, stop_on_eos=False)


@pytest.fixture(scope="module")
def lm(server_model_dir: Path):
    """The servers' tiny random Llama (the default model's tokenizer), fp32."""
    from specstack.models.loading import load_model

    return load_model(str(server_model_dir), dtype="fp32", use_cache=False)


def alone(lm, prompt: list[int], gen: GenerationConfig):
    """The result of `prompt` decoded by itself, in an engine of its own."""
    return BatchEngine(lm, max_rows=1, max_context=CONTEXT).run([BatchRequest(prompt, gen)])[0]


class Sink:
    """A job's events as the engine thread sends them; `final` once its last event (a result or an error)."""

    def __init__(self, on_event=None) -> None:
        self.events: list[Event] = []
        self.late: list[Event] = []  # events after the last one (there must be none)
        self.final = threading.Event()
        self.on_event = on_event

    def __call__(self, event: Event) -> None:
        if self.final.is_set():
            self.late.append(event)
            return
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)
        if event.result is not None or event.error is not None:
            self.final.set()

    def last(self) -> Event:
        assert self.final.wait(WAIT), "the job never ended"
        assert self.late == []
        return self.events[-1]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)


def make_worker(lm, capacity: int, rows: int = 2, build=lambda name: None) -> tuple[EngineWorker, ServerMetrics]:
    """A worker over a fresh engine, not started (jobs submitted before `start` are all taken in its first
    drain). Its method is `ar`: the engine itself drafts nothing."""
    metrics = ServerMetrics("tiny")
    engine = BatchEngine(lm, max_rows=rows, max_context=CONTEXT)
    return EngineWorker(engine, metrics, capacity, "ar", build), metrics


@pytest.fixture
def workers() -> Iterator[list[EngineWorker]]:
    """Workers a test started, stopped after it."""
    started: list[EngineWorker] = []
    yield started
    for w in started:
        w.stop()
        assert not w.alive


def start(worker: EngineWorker, workers: list[EngineWorker]) -> EngineWorker:
    worker.start()
    workers.append(worker)
    return worker


def sample(metrics: ServerMetrics, name: str) -> float:
    return metrics.registry.get_sample_value("specstack:" + name, {"model_name": "tiny"}) or 0.0


def wait_idle(worker: EngineWorker) -> None:
    """Until every job taken has ended (a cancelled one ends without an event)."""
    done = threading.Event()
    for _ in range(WAIT * 100):
        if worker.in_flight == 0:
            return
        done.wait(0.01)
    raise AssertionError(f"{worker.in_flight} jobs still in flight")


# ---------------------------------------------------------------------------------------------------
# Events: each job's own text, then its result
# ---------------------------------------------------------------------------------------------------
def test_each_job_streams_its_own_text_then_its_result(lm, workers) -> None:
    """Three jobs on two rows (the third waits for a row): each sink gets its own text piece by piece, token
    counts that only grow, then one last event with the result, the same as the prompt decoded alone."""
    worker, metrics = make_worker(lm, capacity=3)
    sinks = [Sink() for _ in PROMPTS]
    ids = worker.submit([(p, SHORT, s) for p, s in zip(PROMPTS, sinks, strict=True)], None)
    assert ids == [0, 1, 2] and worker.in_flight == 3
    start(worker, workers)
    for prompt, sink in zip(PROMPTS, sinks, strict=True):
        last, expected = sink.last(), alone(lm, prompt, SHORT)
        assert last.error is None and last.result is not None
        assert last.result.tokens == expected.tokens and last.result.text == expected.text
        assert sink.text == expected.text  # the pieces, in order, are the whole text
        counts = [e.tokens for e in sink.events]
        assert counts == sorted(counts) and counts[-1] == len(expected.tokens) == SHORT.max_new_tokens
        assert all(e.result is None for e in sink.events[:-1])
        assert len(sink.events) > 1  # streamed as it was decoded, not only at the end
    assert worker.in_flight == 0
    assert metrics.registry.get_sample_value("specstack:request_success_total",
                                             {"model_name": "tiny", "finished_reason": "length"}) == 3
    assert sample(metrics, "generation_tokens_total") == 3 * SHORT.max_new_tokens


# ---------------------------------------------------------------------------------------------------
# Capacity: reserved at submit, a request's jobs all or none
# ---------------------------------------------------------------------------------------------------
def test_a_request_over_capacity_is_refused_whole_and_capacity_returns_as_jobs_end(lm, workers) -> None:
    worker, _ = make_worker(lm, capacity=3)
    first = [Sink(), Sink()]
    worker.submit([(PROMPTS[0], SHORT, s) for s in first], None)
    refused = [Sink(), Sink()]
    with pytest.raises(Overloaded):  # 2 + 2 > 3: neither job is taken
        worker.submit([(PROMPTS[1], SHORT, s) for s in refused], None)
    assert worker.in_flight == 2
    third = Sink()
    assert worker.submit([(PROMPTS[2], SHORT, third)], None) == [2]  # one more fits
    with pytest.raises(Overloaded):
        worker.submit([(PROMPTS[2], SHORT, Sink())], None)
    start(worker, workers)
    for sink in [*first, third]:
        assert sink.last().result is not None
    wait_idle(worker)
    assert refused[0].events == refused[1].events == []  # the refused request never ran
    again = [Sink() for _ in range(3)]  # the room is back: three jobs at once
    worker.submit([(PROMPTS[i], SHORT, s) for i, s in enumerate(again)], None)
    assert [s.last().result.tokens for s in again] == [alone(lm, p, SHORT).tokens for p in PROMPTS]


def test_a_job_the_engine_refuses_gets_an_error_and_gives_its_room_back(lm, workers) -> None:
    """A prompt longer than a row's context is refused by the engine: that job's error, not the thread's."""
    worker, _ = make_worker(lm, capacity=1)
    start(worker, workers)
    bad = Sink()
    worker.submit([([5] * (CONTEXT + 1), SHORT, bad)], None)
    assert bad.last().error and bad.last().result is None
    wait_idle(worker)
    good = Sink()
    worker.submit([(PROMPTS[0], SHORT, good)], None)  # capacity 1: possible only if the room came back
    assert good.last().result.tokens == alone(lm, PROMPTS[0], SHORT).tokens


# ---------------------------------------------------------------------------------------------------
# Cancel
# ---------------------------------------------------------------------------------------------------
def test_cancel_drops_a_waiting_job_and_a_running_one(lm, workers) -> None:
    """A job cancelled before it ran never sends an event; a job cancelled while it decodes (its sink
    cancels it on its first text, from the engine thread, so before the next step) sends nothing more.
    Both leave the batch: their room is free and the next job decodes as it would alone."""
    worker, metrics = make_worker(lm, capacity=2)
    waiting = Sink()
    [w] = worker.submit([(PROMPTS[0], LONG, waiting)], None)
    worker.cancel([w])
    ids: list[int] = []
    running = Sink(on_event=lambda e: worker.cancel(ids))
    ids += worker.submit([(PROMPTS[1], LONG, running)], None)
    start(worker, workers)
    wait_idle(worker)
    assert waiting.events == []
    assert len(running.events) == 1 and running.events[0].result is None and running.events[0].error is None
    assert 0 < running.events[0].tokens < LONG.max_new_tokens
    after = [Sink(), Sink()]
    worker.submit([(PROMPTS[i], SHORT, s) for i, s in enumerate(after)], None)
    assert [s.last().result.tokens for s in after] == [alone(lm, p, SHORT).tokens for p in PROMPTS[:2]]
    assert sample(metrics, "request_aborted_total") == 2  # (counted in drains before `after` was taken)
    finished = Sink()
    done = worker.submit([(PROMPTS[2], SHORT, finished)], None)
    assert finished.last().result is not None
    worker.cancel([w, *ids, *done, 12345])  # cancelled already, finished or unknown: ignored
    last = Sink()
    worker.submit([(PROMPTS[2], SHORT, last)], None)  # taken after those cancels
    assert last.last().result is not None
    assert sample(metrics, "request_aborted_total") == 2


class Guess:
    """A drafter that guesses the last token again (one node): rows lent it hold a drafter of the pool."""

    target_layers = ()
    group = None

    def reset(self, prompt_ids, target_hidden=None) -> None:
        pass

    def propose(self, ctx) -> DraftTree:
        return DraftTree(tokens=[ctx.tokens[-1]], parent=[-1])

    def observe(self, tree, result, target_hidden=None) -> None:
        pass


def test_cancelled_refused_and_failed_jobs_give_back_everything_they_held(lm, workers) -> None:
    """A server's long life in small: jobs that finish, are cancelled waiting or decoding, are refused by
    the engine, or die in a step that raises (a drafter's bug), on an engine with a prefix cache and lent
    drafters. Once all have ended nothing is held: no job in the worker's tables, no row, queue entry or
    unread result in the engine, no KV row, every drafter back in its pool, the prefix cache's pool
    accounting exact and within its budget; and the next requests decode as they would alone."""
    from specstack.prefix_cache import PrefixCache

    def build(name: str):
        return (lambda: Broken("observe")) if name == "broken" else Guess

    metrics = ServerMetrics("tiny")
    engine = BatchEngine(lm, max_rows=2, max_context=CONTEXT, prefix_cache=PrefixCache(64 << 10, block_size=4))
    worker = EngineWorker(engine, metrics, 8, "ar", build)
    worker.prepare("guess")
    worker.prepare("broken")
    sinks = [Sink() for _ in range(3)]
    worker.submit([(PROMPTS[i], SHORT, s) for i, s in enumerate(sinks)], "guess")  # finish
    waiting = Sink()
    [w] = worker.submit([(PROMPTS[0] * 3, LONG, waiting)], "guess")
    worker.cancel([w])  # cancelled before it ran
    ids: list[int] = []
    running = Sink(on_event=lambda e: worker.cancel(ids))
    ids += worker.submit([(PROMPTS[1] * 3, LONG, running)], "guess")  # cancelled decoding
    refused = Sink()
    worker.submit([([5] * (CONTEXT + 1), SHORT, refused)], "guess")
    start(worker, workers)
    for s in sinks:
        assert s.last().result is not None
    assert refused.last().error
    wait_idle(worker)
    failed = Sink()
    worker.submit([(PROMPTS[2] * 2, LONG, failed)], "broken")  # its step raises: it fails
    assert "internal error" in (failed.last().error or "")
    wait_idle(worker)
    after = [Sink(), Sink()]
    worker.submit([(PROMPTS[i], SHORT, s) for i, s in enumerate(after)], "guess")
    assert [s.last().result.tokens for s in after] == [alone(lm, p, SHORT).tokens for p in PROMPTS[:2]]
    wait_idle(worker)
    assert worker._jobs == {} and worker._by_handle == {}
    assert engine.rows == [] and not engine.queue and engine._finished == {}
    assert engine.cache.batch_size == 0 and engine.cache.lengths == []
    assert engine.pool.lent == 0 and engine.pool.idle >= 2  # every drafter made is back
    prefix = engine.prefix
    assert prefix is not None and prefix.pool is not None and prefix.stats.stored_blocks > 0
    assert prefix.nbytes == len(prefix.blocks) * prefix.pool.block_bytes <= prefix.max_bytes
    assert sorted([b.slot for b in prefix.blocks] + prefix.pool.free) == list(range(prefix.pool.allocated))


# ---------------------------------------------------------------------------------------------------
# An engine step that raises
# ---------------------------------------------------------------------------------------------------
class Broken:
    """A drafter with a bug: it raises when it proposes, or (where="observe") when it is told the verdict
    of the one-node tree it proposed, after the target's forward."""

    target_layers = ()
    group = None

    def __init__(self, where: str) -> None:
        self.where = where

    def reset(self, prompt_ids, target_hidden=None) -> None:
        pass

    def propose(self, ctx) -> DraftTree:
        if self.where == "propose":
            raise RuntimeError("a drafter bug")
        return DraftTree(tokens=[ctx.tokens[-1]], parent=[-1])

    def observe(self, tree, result, target_hidden=None) -> None:
        raise RuntimeError("a drafter bug")


@pytest.mark.parametrize("where", ["propose", "observe"])
def test_an_engine_step_that_raises_fails_its_jobs_and_the_worker_serves_on(lm, workers, where, capsys) -> None:
    """A request whose method's drafter raises inside a step, beside a plain one: the step raises, both jobs
    end with an error event (the plain one too: it was in the step), their room comes back, and the thread
    serves the next requests exactly as if they were alone."""
    worker, _ = make_worker(lm, capacity=2, build=lambda name: (lambda: Broken(where)) if name == "broken" else None)
    plain, broken = Sink(), Sink()
    worker.submit([(PROMPTS[0], LONG, plain)], None)
    worker.prepare("broken")
    worker.submit([(PROMPTS[1], LONG, broken)], "broken")
    start(worker, workers)
    for sink in (plain, broken):
        last = sink.last()
        assert last.result is None and "internal error in the engine" in last.error
    wait_idle(worker)
    assert worker.alive
    assert "a drafter bug" in capsys.readouterr().err  # the traceback goes to the server's log
    after = [Sink(), Sink()]
    worker.submit([(PROMPTS[i], SHORT, s) for i, s in enumerate(after)], None)
    assert [s.last().result.tokens for s in after] == [alone(lm, p, SHORT).tokens for p in PROMPTS[:2]]
    assert [s.text for s in after] == [alone(lm, p, SHORT).text for p in PROMPTS[:2]]


def test_stop_ends_the_thread_and_fails_what_runs(lm, workers) -> None:
    """Stopping while a job decodes (its sink asks for the stop on its first text, with 199 tokens to go):
    the job ends with the shutting-down error, and the thread ends."""
    worker, _ = make_worker(lm, capacity=1)
    stopper: list[threading.Thread] = []

    def stop_now(event: Event) -> None:
        if not stopper:  # stop() waits for the thread, so another thread calls it
            stopper.append(threading.Thread(target=worker.stop))
            stopper[0].start()

    sink = Sink(on_event=stop_now)
    worker.submit([(PROMPTS[0], LONG, sink)], None)
    worker.start()
    assert "shutting down" in (sink.last().error or "")
    stopper[0].join(WAIT)
    assert not worker.alive and worker.in_flight == 0


def test_a_stop_asked_for_while_a_step_fails_still_stops_the_thread(lm) -> None:
    """The server stops (stop()) just as a step raises: the jobs fail and the thread ends. Here the drafter
    asks for the stop itself while it proposes; stop() then cannot wait for its own thread, and that error
    is the step's."""
    worker, _ = make_worker(lm, capacity=1)
    calls: list[str] = []

    class StopsThenFails(Broken):
        def propose(self, ctx) -> DraftTree:
            calls.append("propose")
            worker.stop()  # its message queued; joining the engine thread from itself raises
            raise AssertionError("unreachable")

    worker.build = lambda name: (lambda: StopsThenFails("propose"))
    sink = Sink()
    worker.prepare("stopping")
    worker.submit([(PROMPTS[0], LONG, sink)], "stopping")
    worker.start()
    assert "internal error in the engine" in (sink.last().error or "")
    assert calls == ["propose"]
    for _ in range(WAIT * 100):
        if not worker.alive:
            break
        threading.Event().wait(0.01)
    assert not worker.alive, "the stop was lost: the engine thread still runs"


def test_the_methods_clients_name_are_kept_up_to_a_bound_never_dropping_one_in_use(lm, workers) -> None:
    """Clients may name any number of methods over a server's life: past MAX_METHODS the least recently
    used factory that no job in flight uses is dropped with its idle drafters; a running job's method is
    kept while it runs, a dropped method named again is built again, and every job decodes as alone."""
    from specstack.server.worker import MAX_METHODS

    built: list[str] = []

    def build(name: str):
        built.append(name)
        return lambda: Guess()  # a new factory per build

    worker, _ = make_worker(lm, capacity=4, build=build)
    start(worker, workers)
    worker.prepare("busy")
    busy = Sink()
    worker.submit([(PROMPTS[0], LONG, busy)], "busy")
    names = [f"m{i}" for i in range(MAX_METHODS + 4)]
    for name in names:
        worker.prepare(name)
        sink = Sink()
        worker.submit([(PROMPTS[1], SHORT, sink)], name)
        assert sink.last().result.tokens == alone(lm, PROMPTS[1], SHORT).tokens
        assert len(worker._factories) <= MAX_METHODS + 1  # the one just prepared may be over, until its job is added
        assert "busy" in worker._factories or busy.final.is_set()
    assert busy.last().result.tokens == alone(lm, PROMPTS[0], LONG).tokens
    wait_idle(worker)
    assert len(worker._factories) <= MAX_METHODS and "m0" not in worker._factories
    assert worker.engine.pool.idle <= MAX_METHODS and worker.engine.pool.lent == 0  # dropped ones' drafters went too
    worker.prepare("m0")
    again = Sink()
    worker.submit([(PROMPTS[2], SHORT, again)], "m0")
    assert again.last().result.tokens == alone(lm, PROMPTS[2], SHORT).tokens
    assert built.count("m0") == 2 and built.count(names[-1]) == 1
