"""The long fuzz run of the `specstack` command line (issue 18; tests/fuzz/ makes and checks the
cases, tests/cli/test_fuzz.py runs a bounded number in CI): malformed input to every command, each case
checked against the error contract (exit 0 or 2, the one error line, no traceback, within --seconds, no
existing file changed). Prints the failures grouped by kind, each with the command line that
reproduces it; exit status 1 when a case failed.

    python benchmarks/fuzz_cli.py --count 2000 --seed 1 [--start 0] [--seconds 20] [--out bench_out/fuzz]
    python benchmarks/fuzz_cli.py --seed 1 --case 17     (one case again: its files kept, its output shown)

The cases run in-process in a worker process. A case that kills the worker (a crash in native code, a
thread explosion) is reported as such and a new worker goes on from the next case.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fuzz.checks import Problem  # noqa: E402 -- tests/ is not a package
from fuzz.fixtures import Fixtures, fixtures_at  # noqa: E402
from fuzz.generators import make_case  # noqa: E402
from fuzz.harness import Result, case_text, fuzz, report, run_case  # noqa: E402
from fuzz.runner import CASE_SECONDS, Outcome  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=2000, help="cases (default 2000; the commands take turns)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--start", type=int, default=0, help="the first case's index (default 0)")
    p.add_argument("--seconds", type=float, default=CASE_SECONDS, help=f"each case's bound (default {CASE_SECONDS:.0f})")
    p.add_argument("--out", type=Path, default=Path("bench_out/fuzz"),
                   help="fixtures, workspaces, journal.jsonl and report.txt (default bench_out/fuzz)")
    p.add_argument("--case", type=int, default=None, metavar="I", help="run case I alone and show it")
    p.add_argument("--examples", type=int, default=5, help="cases shown per kind of failure (default 5)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


# ---------------------------------------------------------------------------------------------------
# The worker: runs cases in-process and journals each one
# ---------------------------------------------------------------------------------------------------
def work(args: argparse.Namespace) -> None:
    fx = fixtures_at(args.out / "fixtures")
    with open(args.out / "journal.jsonl", "a", encoding="utf-8") as journal:
        for r in fuzz(args.seed, args.count, fx, args.out / "cases", start=args.start, seconds=args.seconds):
            journal.write(json.dumps({"index": r.case.index, "outcome": asdict(r.outcome),
                                      "problems": [asdict(p) for p in r.problems]}) + "\n")
            journal.flush()
            print(f"case {r.case.index} {r.case.command}: exit {r.outcome.code}, {r.outcome.seconds:.1f} s"
                  + (f", FAILED ({', '.join(p.kind for p in r.problems)})" if r.problems else ""),
                  file=sys.stderr, flush=True)


def show_one(args: argparse.Namespace) -> int:
    """One case, its workspace kept, everything it printed shown."""
    fx = fixtures_at(args.out / "fixtures")
    ws = args.out / "cases" / f"case{args.case}"
    shutil.rmtree(ws, ignore_errors=True)
    case = make_case(args.seed, args.case, fx, ws)
    r = run_case(case, fx, ws, args.seconds)
    print(case_text(r, fx).replace("$WS", str(ws)).replace("$FX", str(fx.root)))
    print(f"--- stdout\n{r.outcome.out}--- stderr\n{r.outcome.err}---")
    print("problems: " + ("; ".join(f"{p.kind}: {p.where} {p.detail}" for p in r.problems) or "none"))
    return 1 if r.problems else 0


# ---------------------------------------------------------------------------------------------------
# The parent: workers until every case has run, then the report
# ---------------------------------------------------------------------------------------------------
def read_journal(path: Path, fx: Fixtures, seed: int, cases: Path) -> dict[int, Result]:
    results = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        i = row["index"]
        results[i] = Result(make_case(seed, i, fx, cases / f"case{i}"), Outcome(**row["outcome"]),
                            [Problem(**p) for p in row["problems"]])
    return results


def run_worker(args: argparse.Namespace, start: int, count: int, journal: Path) -> int | None:
    """A worker for cases start .. start + count - 1; its exit status, or None when it was killed
    because no case finished for a long while (a hang the in-process alarm could not stop)."""
    worker = subprocess.Popen([sys.executable, __file__, "--worker", "--seed", str(args.seed), "--start", str(start),
                               "--count", str(count), "--seconds", str(args.seconds), "--out", str(args.out)])
    size, quiet_since = journal.stat().st_size, time.monotonic()
    while worker.poll() is None:
        time.sleep(1)
        if journal.stat().st_size != size:
            size, quiet_since = journal.stat().st_size, time.monotonic()
        elif time.monotonic() - quiet_since > 3 * args.seconds + 120:
            worker.kill()
            worker.wait()
            return None
    return worker.returncode


def run_all(args: argparse.Namespace) -> int:
    shutil.rmtree(args.out, ignore_errors=True)  # fixtures from an older tree could hide a change
    args.out.mkdir(parents=True)
    fx = fixtures_at(args.out / "fixtures")
    journal, cases = args.out / "journal.jsonl", args.out / "cases"
    journal.touch()
    end, start = args.start + args.count, args.start
    results: dict[int, Result] = {}
    while start < end:
        status = run_worker(args, start, end - start, journal)
        results = read_journal(journal, fx, args.seed, cases)
        done = max(results, default=start - 1) + 1
        if done < end:  # the worker died, or hung past its alarm, in case `done`
            case = make_case(args.seed, done, fx, cases / f"case{done}")
            results[done] = Result(case, Outcome(None, "", "", 0.0), [Problem(
                "killed the process" if status is not None else "hang", case.command,
                f"the worker ended with status {status}" if status is not None else
                "no answer, not even to its alarm (stuck in native code): the worker was killed")])
            with open(journal, "a", encoding="utf-8") as f:
                f.write(json.dumps({"index": done, "outcome": asdict(results[done].outcome),
                                    "problems": [asdict(p) for p in results[done].problems]}) + "\n")
            shutil.rmtree(cases / f"case{done}", ignore_errors=True)
        start = done + 1
    text = report([results[i] for i in sorted(results)], fx, args.examples)
    (args.out / "report.txt").write_text(text + "\n", encoding="utf-8")
    print(text)
    return 1 if any(r.problems for r in results.values()) else 0


def main() -> int:
    args = parse_args()
    if args.worker:
        work(args)
        return 0
    if args.case is not None:
        return show_one(args)
    return run_all(args)


if __name__ == "__main__":
    raise SystemExit(main())
