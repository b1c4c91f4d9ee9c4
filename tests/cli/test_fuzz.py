"""Issue 18's fuzz test: malformed input to every command (odd method strings and numbers, damaged prompt,
result, model, draft, trigram and sequences files, paths that cannot be read or written) ends in exit 0
or 2 with the one error line, no traceback, within a time bound, and no existing file changed
(tests/fuzz/ generates the cases and states the checks). A fixed seed and a bounded count here;
`python benchmarks/fuzz_cli.py --count 2000 --seed 1` runs more."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fuzz.case import Case, Put
from fuzz.fixtures import Fixtures, build_fixtures
from fuzz.generators import COMMANDS
from fuzz.harness import fuzz, report, run_case
from fuzz.runner import run_subprocess

SEED = 18
COUNT = 60  # six cases per command


@pytest.fixture(scope="module")
def fixtures(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Fixtures:
    return build_fixtures(tmp_path_factory.mktemp("fuzz-fixtures"), tiny_model_dir)


def test_malformed_input_keeps_the_error_contract(fixtures: Fixtures, tmp_path: Path) -> None:
    results = list(fuzz(SEED, COUNT, fixtures, tmp_path))
    assert {r.case.command for r in results} == set(COMMANDS)
    assert not any(r.problems for r in results), report(results, fixtures)


def _case(index: int, ws: Path, command: str, argv: list[str], puts: list[Put], note: str) -> Case:
    return Case(0, index, str(ws), command, tuple(argv), tuple(puts), (), note)


def test_the_real_entry_point_prints_no_traceback(fixtures: Fixtures, tmp_path: Path) -> None:
    """End to end through `python -m specstack.cli`: a checkpoint whose config.json is not an object,
    and a bench run whose results.jsonl has an undecodable line (issue 18, kinds 4 and 6)."""
    rows = (fixtures.run / "results.jsonl").read_bytes().split(b"\n")
    rows[1] = b'\xff\xfe{"task_id":'
    cases = [
        _case(0, tmp_path / "case0", "generate",
              ["generate", "--model", str(tmp_path / "case0" / "model"), "--prompt", "hi", "--max-new-tokens", "2"],
              [Put("model", source=fixtures.model), Put("model/config.json", data=json.dumps([1, 2]).encode())],
              "config.json is a list"),
        _case(1, tmp_path / "case1", "bench", ["bench", "--phases", str(tmp_path / "case1" / "run")],
              [Put("run", source=fixtures.run), Put("run/results.jsonl", data=b"\n".join(rows))],
              "results.jsonl line 2 is not UTF-8"),
    ]
    results = [run_case(c, fixtures, Path(c.ws), seconds=120, runner=run_subprocess) for c in cases]
    assert not any(r.problems for r in results), report(results, fixtures)
    assert all(r.outcome.code == 2 for r in results), [(r.outcome.code, r.outcome.err) for r in results]
