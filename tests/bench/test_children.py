"""The processes the bench starts (bench/children.py): a process group of their own, stopped with the whole
group, gone when the bench is killed with SIGKILL (no `finally` runs then); a real bench killed while its
llama-server runs leaves no server behind. Real processes throughout (sleep, sh, the CLI, llama-server);
the orphan tests need Linux's setpriv, the last the binary benchmarks/build_llama_cpp.sh builds."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specstack.bench import children
from specstack.bench.llama_server import server_binary

linux_guard = pytest.mark.skipif(shutil.which("setpriv") is None or not Path("/proc").is_dir(),
                                 reason="no setpriv or /proc here (not Linux): children die with the bench only "
                                        "through its finally blocks")


def pids_running(marker: str) -> list[int]:
    """Processes whose command line holds `marker` (read from /proc; zombies count as gone)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z" and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found


def wait_exec(marker: str, program: str, timeout: float = 15.0) -> bool:
    """Whether a process running `program` itself with `marker` appears in time: under setpriv the child's
    command line holds the marker from its fork, but its death signal is asked for only before setpriv
    execs `program` (a parent killed before that leaves it running: a race of the test, not of the bench)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in pids_running(marker):
            try:
                argv0 = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if Path(argv0.decode(errors="replace")).name == program:
                return True
        time.sleep(0.05)
    return False


def wait_gone(marker: str, timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := pids_running(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@linux_guard
def test_a_child_dies_with_a_parent_killed_by_sigkill(tmp_path):
    marker = f"61.{os.getpid()}"  # a sleep no other process runs
    parent = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from specstack.bench import children\n"
        f"children.start(['sleep', '{marker}']); print('started', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "started"
        assert wait_exec(marker, "sleep"), "the child never ran"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert wait_gone(marker) == [], "the child outlived its killed parent"
    finally:
        parent.kill()
        subprocess.run(["pkill", "-f", marker], check=False)


@linux_guard
def test_stop_and_a_timeout_take_the_whole_group():
    marker = f"62.{os.getpid()}"  # sleeps no other process runs
    proc = children.start(["sh", "-c", f"sleep {marker} & sleep {marker} & wait"])
    deadline = time.monotonic() + 5
    while len(pids_running(marker)) < 3 and time.monotonic() < deadline:  # sh and its two sleeps
        time.sleep(0.05)
    assert len(pids_running(marker)) == 3
    try:
        children.stop(proc, grace_s=2)
        assert wait_gone(marker) == [], "a grandchild outlived stop()"
    finally:
        subprocess.run(["pkill", "-f", marker], check=False)
    with pytest.raises(subprocess.TimeoutExpired):
        children.run(["sh", "-c", f"sleep {marker} & sleep {marker}"], timeout=0.5)
    assert wait_gone(marker) == [], "a timed-out run left its group behind"
    done = children.run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"])
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def _peer_marker(method: str) -> tuple[str, str | None]:
    """What marks a peer's process in /proc's command lines, and why the peer cannot run here (or None)."""
    from specstack.bench import openvino_peer
    from specstack.models.registry import resolve

    if method == "openvino":
        return "specstack.bench.peer_child", openvino_peer.unavailable(True)
    why = server_binary(None)[1] or None
    return str(resolve("smollm2-135m").path), why and f"llama-server not built ({why})"


@linux_guard
@pytest.mark.parametrize("method", ["llamacpp-ngram", "openvino"])
def test_a_bench_killed_with_sigkill_leaves_no_peer_process(tmp_path, method):
    """`specstack bench` with a peer that runs as a process (llama-server's n-gram peer; OpenVINO GenAI in
    its child), killed while that process is up: nothing of it remains."""
    marker, why = _peer_marker(method)
    if why:
        pytest.skip(why)
    before = set(pids_running(marker))
    bench = subprocess.Popen([sys.executable, "-m", "specstack.cli", "bench", "--model", "smollm2-135m",
                              "--methods", f"{method};ar", "--prompts", "humaneval", "--limit", "8",
                              "--max-new-tokens", "256", "--threads", "1", "--out", str(tmp_path / "run")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (started := [p for p in pids_running(marker) if p not in before and p != bench.pid]):
            assert bench.poll() is None, f"the bench ended before its {method} process started"
            assert time.monotonic() < deadline, f"no {method} process started"
            time.sleep(0.2)
        bench.send_signal(signal.SIGKILL)
        bench.wait()
        left = wait_gone(marker)
        assert [p for p in left if p in started] == [], f"{method}'s process outlived the killed bench"
    finally:
        bench.kill()
