"""Ctrl-C always stops a run (issue 18, kind 7): within a step, exit 130, no traceback, no file left.

The CLI's SIGINT handler only sets a flag (specstack/interrupt.py) that every loop checks once per
step, so a Ctrl-C can no longer land in a finaliser and be swallowed. Tested three ways: the flag and
the handler themselves; the engine loops stopping at the step after the request; and the real
command in a subprocess, sent SIGINT at points from its imports to the middle of a long generation.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from specstack import interrupt
from specstack.cli.entry import main

# ---------------------------------------------------------------------------------------------------
# The flag and the handler
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def no_request():
    interrupt.clear()
    yield
    interrupt.clear()


def test_check_raises_only_once_requested(no_request):
    interrupt.check()  # nothing requested: a no-op
    assert not interrupt.requested()
    interrupt.request()
    assert interrupt.requested()
    with pytest.raises(KeyboardInterrupt):
        interrupt.check()


def test_handler_sets_the_flag_then_a_second_ctrl_c_raises_and_is_restored(no_request):
    # from Python's default handler, whatever this process inherited (a background job starts with
    # SIGINT ignored), and back to what it was after
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with interrupt.handling_sigint():
            assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
            signal.raise_signal(signal.SIGINT)  # the first Ctrl-C only asks
            assert interrupt.requested()
            with pytest.raises(KeyboardInterrupt):  # the impatient second one raises at once
                signal.raise_signal(signal.SIGINT)
            with interrupt.handling_sigint():  # nested: a no-op that keeps the pending request
                assert interrupt.requested()
            assert interrupt.requested()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert not interrupt.requested()
        with pytest.raises(KeyboardInterrupt):  # Python's default is back
            signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_a_ctrl_c_inside_a_finaliser_is_not_lost(no_request, recwarn):
    """The observed bug: Python's default handler raised KeyboardInterrupt inside a finaliser, which
    printed "Exception ignored" and swallowed it. Now the Ctrl-C is kept until the next check."""

    class Finalised:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)

    with interrupt.handling_sigint():
        Finalised()  # dropped at once: its finaliser runs here and gets the Ctrl-C
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()
    assert not [w for w in recwarn if "Unraisable" in type(w.message).__name__]


def test_main_returns_130_for_a_ctrl_c_after_the_last_step(monkeypatch, capsys):
    """The command finished, but a Ctrl-C came during it: the run still counts as interrupted."""
    import specstack.cli.generate

    def command(args):
        signal.raise_signal(signal.SIGINT)
        return 0

    monkeypatch.setattr(specstack.cli.generate, "cmd_generate", command)
    before = signal.getsignal(signal.SIGINT)
    assert main(["generate", "--prompt", "hi"]) == 130
    assert signal.getsignal(signal.SIGINT) is before
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------------
# The engine loops stop at the step after the request
# ---------------------------------------------------------------------------------------------------
class CountingModel:
    """The model, with a Ctrl-C requested during the `at`-th call of its `method` (counted in `calls`)."""

    def __init__(self, model, method: str, at: int) -> None:
        self._model, self._method, self._at, self.calls = model, getattr(model, method), at, 0
        setattr(self, method, self._counted)

    def __getattr__(self, name):
        return getattr(self._model, name)

    def _counted(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self._at:
            interrupt.request()
        return self._method(*args, **kwargs)


@pytest.mark.parametrize("method", ["ar", "chain"])
def test_engine_stops_at_the_next_step(tiny_llama, no_request, method):
    from specstack.config import GenerationConfig
    from specstack.drafting.model import ModelDrafter, TreeParams
    from specstack.engine.batched import generate

    model = CountingModel(tiny_llama.lm.model, "forward", at=3)  # one target forward per engine step
    target = replace(tiny_llama.lm, model=model)
    drafter = ModelDrafter(tiny_llama.lm, TreeParams.chain(2)) if method == "chain" else None
    gen = GenerationConfig(max_new_tokens=100, stop_on_eos=False)
    with pytest.raises(KeyboardInterrupt):
        generate(target, [1, 5, 9], gen, drafter=drafter)
    assert model.calls == 3  # the step that saw the request finished, no other began

    interrupt.request()  # requested before the run: it stops before the prefill
    model.calls = 0
    with pytest.raises(KeyboardInterrupt):
        generate(target, [1, 5, 9], gen, drafter=drafter)
    assert model.calls == 0


# ---------------------------------------------------------------------------------------------------
# The real command, interrupted at many points
# ---------------------------------------------------------------------------------------------------
LONG_CONTEXT = 4096  # uninterrupted, the tiny model writes tens of KB of text into this context
# "Within a step" is measured in text, not seconds (a machine's speed does not change it): after the
# signal, at most a few steps' tokens may still reach stdout (those already in the pipe, the step under
# way); a Ctrl-C lost until the end would let through the rest of the generation.
TEXT_AFTER_SIGNAL = 1000  # bytes
# The time bounds only stop a hang; they are generous for a busy machine: a step takes milliseconds,
# the exit (torch's teardown) a second or two, longer when the cores are shared.
STOP_WITHIN = 20.0  # seconds from the signal to the exit when it lands between steps
LOAD_WITHIN = 45.0  # ... when it lands while the model loads (the load finishes, then the first check)
START_WITHIN = 120.0  # seconds to reach the point of the signal (imports of torch and transformers)


@dataclass(frozen=True)
class Point:
    """Where SIGINT is sent: once `anchor` is seen (`import:MODULE`: that import finished, from -X
    importtime; `text`: the first generated text on stdout), after `delay` seconds."""
    anchor: str
    delay: float = 0.0
    method: str = "ar"
    html: bool = False

    @property
    def stop_within(self) -> float:
        return STOP_WITHIN if self.anchor == "text" else LOAD_WITHIN


_rnd = random.Random(18)
POINTS = {
    "importing-commands": Point("import:specstack.cli.common"),  # before torch: the handler is already in
    "loading": Point("import:torch", html=True),
    "ar": Point("text", round(_rnd.uniform(0.05, 1.5), 2)),
    "ar-html": Point("text", round(_rnd.uniform(0.05, 1.5), 2), html=True),
    "chain": Point("text", round(_rnd.uniform(0.05, 1.5), 2), method="chain"),
    "chain-html": Point("text", round(_rnd.uniform(0.05, 1.5), 2), method="chain", html=True),
}


@pytest.fixture(scope="module")
def long_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CLI's tiny checkpoint with a long context (RoPE: no position table to grow)."""
    path = tmp_path_factory.mktemp("tiny-long") / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": LONG_CONTEXT}))
    return path


class Run:
    """`specstack generate` in a subprocess, its stdout and stderr drained by threads that note when
    the first text and each import arrive."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "specstack.cli", *argv], cwd=cwd,
                                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.seen: set[str] = set()
        self.text_bytes = 0  # stdout read so far
        self.err: list[str] = []  # stderr lines, the import times left out
        self.changed = threading.Condition()
        self.readers = [threading.Thread(target=self._read_out, daemon=True),
                        threading.Thread(target=self._read_err, daemon=True)]
        for t in self.readers:
            t.start()

    def _note(self, anchor: str) -> None:
        with self.changed:
            self.seen.add(anchor)
            self.changed.notify_all()

    def _read_out(self) -> None:
        while chunk := self.proc.stdout.read1(4096):
            self.text_bytes += len(chunk)
            if chunk.strip():
                self._note("text")

    def _read_err(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line.startswith("import time:"):
                self._note("import:" + line.rsplit("|", 1)[1].strip())
            else:
                self.err.append(line)
        self._note("eof")

    def wait_for(self, anchor: str, timeout: float) -> bool:
        """True once `anchor` is seen; False if the process ended first or the time ran out."""
        with self.changed:
            self.changed.wait_for(lambda: anchor in self.seen or "eof" in self.seen, timeout)
            return anchor in self.seen

    def finish(self, timeout: float) -> int | None:
        """The exit code, or None if it did not exit in time (then it is killed)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None
        finally:
            for t in self.readers:
                t.join(5)


def interrupt_run(model: Path, root: Path, point: Point) -> list[str]:
    """Run, interrupt at `point`, and list what went wrong."""
    work, cache = root / "work", root / "cache"  # work: the run's folder, where its --html goes
    work.mkdir(parents=True)
    argv = ["generate", "--model", str(model), "--prompt", "Once upon a time", "--max-new-tokens", "100000",
            "--dtype", "fp32", "--threads", "1", "--method", point.method]
    if point.method != "ar":  # the draft in fp32 too: no kernel to build in this run's fresh cache (its lines on stderr)
        argv += ["--draft-dtype", "fp32"]
    if point.html:
        argv += ["--html", str(work / "origins.html")]
    run = Run(argv, work, os.environ | {"SPECSTACK_CACHE": str(cache)})
    try:
        if not run.wait_for(point.anchor, START_WITHIN):
            return [f"{point.anchor} never came (exit {run.proc.poll()}): {run.err[-3:]}"]
        time.sleep(point.delay)
        if run.proc.poll() is not None:
            return [f"the run ended (exit {run.proc.returncode}) before the signal: it is too short to test"]
        run.proc.send_signal(signal.SIGINT)
        sent, text_before = time.monotonic(), run.text_bytes
        code = run.finish(point.stop_within)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
    took = time.monotonic() - sent
    problems = []
    if code is None:
        problems.append(f"still running {point.stop_within:.0f} s after SIGINT, killed")
    elif code != 130:
        problems.append(f"exit {code}, not 130")
    text_after = run.text_bytes - text_before
    if point.anchor == "text" and text_after > TEXT_AFTER_SIGNAL:
        problems.append(f"{text_after} bytes of text after the signal: the run went on")
    if point.anchor != "text" and run.text_bytes:
        problems.append(f"{run.text_bytes} bytes of text: the run did not stop before generating")
    text = "\n".join(run.err)
    if "Traceback" in text or "Exception ignored" in text or len(run.err) > 1:
        problems.append(f"stderr: {text[-2000:]!r}")
    left = sorted(str(p.relative_to(root)) for p in work.rglob("*"))
    left += sorted(str(p.relative_to(root)) for p in cache.rglob("*") if ".tmp" in p.name)
    if left:
        problems.append(f"files left: {left}")
    return [f"{p} ({took:.1f} s after the signal)" for p in problems]


def test_sigint_at_many_points_exits_130_quietly_and_leaves_no_file(long_model, tmp_path):
    """Two runs at a time (each on one thread): the points are independent, and the machine may be
    slow, so the whole takes about half of one-by-one."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        found = dict(zip(POINTS, pool.map(lambda kv: interrupt_run(long_model, tmp_path / kv[0], kv[1]),
                                          POINTS.items()), strict=True))
    failed = {name: problems for name, problems in found.items() if problems}
    assert not failed, "\n".join(f"{name} {POINTS[name]}: {'; '.join(p)}" for name, p in failed.items())
