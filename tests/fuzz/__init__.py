"""Fuzz the `specstack` command line (issue 18): malformed inputs for every command, each run in-process
through `specstack.cli.entry.main`, each checked against the error contract:

- the exit code is 0 or 2 (bench-ties may also answer 1, its documented "a divergence is no near-tie");
  130 never (no case sends a signal);
- on exit 2 the last line of stderr is the one `specstack: error: <message>` line;
- no exception escapes `main` (one that does is the traceback a user would see) and stderr holds no
  'Traceback';
- the case ends within its time bound;
- no file that existed before changes, except the outputs the case named and only on exit 0; a case
  that fails leaves nothing new behind, and one that succeeds writes only where it was told to.

A case is made from a seed and an index alone (`generators.make_case`), so one failure reruns by itself:
`python benchmarks/fuzz_cli.py --seed S --case I`. Every case works on the tiny models of `fixtures.Fixtures`
(a random Llama checkpoint with a 64-token context, a GGUF of its own, a draft, a trigram, a finished
bench run, ...) and copies of them in a workspace folder of its own, so nothing real is loaded and a
failing case cannot damage the next. tests/cli/test_fuzz.py runs a bounded number in CI;
benchmarks/fuzz_cli.py runs as many as asked.

One job per module, each importing only those above it:

- fixtures.py: the valid inputs cases start from (`Fixtures`, `build_fixtures`, `fixtures_at`);
- case.py: a case (`Case`, the files it is given: `Put`) and the command line under construction (`Builder`);
- damage.py: damaged bytes, JSON and JSONL, and the paths where an input or an output is expected;
- values.py: bad integers and floats, method strings and the other small languages of the options;
- damaged_inputs.py: damaged copies of the fixtures (checkpoints, GGUFs, drafts, trigrams, runs, ...);
- generators.py: one generator per command and `make_case`, which draws a case from a seed and an index;
- runner.py: running one command line, in-process (guarded) or as a subprocess (`Outcome`);
- checks.py: what an outcome and the files before and after it must satisfy (`Problem`);
- harness.py: a case made, run and checked (`run_case`), a run of many (`fuzz`) and its `report`.
"""
