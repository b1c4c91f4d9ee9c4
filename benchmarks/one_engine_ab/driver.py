"""Decode speed of two source trees of specstack, A/B in one run (issue 31: one engine against the two
loops it replaced): two worker processes (old code, new code) load the default model once each; the
driver sends them the same requests alternately, the order flipped every request, so both see the same
machine load. One sequence: 20 HumanEval prompts per method, 64 greedy tokens, ratio per method (median
of per-prompt time ratios, and total tokens/s). Batched: B rows of the first B prompts, `rounds` times.

    python benchmarks/one_engine_ab/driver.py OLD_TREE NEW_TREE OUT.json   (trees: git worktrees)
"""
import json
import os
import statistics
import subprocess
import sys

ONE = ["ar", "ngram:max=8,cost=1,match=6", "staged:cost=1,d2=3", "auto"]
BATCH = [("ar", 4), ("auto", 4), ("ar", 16), ("auto", 16)]
PROMPTS, ROUNDS = 20, 3


def main() -> None:
    old_tree, new_tree, out_path = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3]
    threads = os.environ.get("AB_THREADS", "1")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
    workers = {v: subprocess.Popen([sys.executable, worker, threads], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True, env=dict(os.environ, PYTHONPATH=tree), cwd="/")
               for v, tree in (("old", old_tree), ("new", new_tree))}
    for w in workers.values():
        assert w.stdout.readline().strip() == "ready"

    def ask(v: str, line: str) -> tuple[float, int]:
        w = workers[v]
        w.stdin.write(line + "\n")
        w.stdin.flush()
        s, n = w.stdout.readline().split()
        return float(s), int(n)

    jobs = [(f"one {m}", f"one {m} {i}") for i in range(PROMPTS) for m in ONE]
    jobs += [(f"batch {m} B={b}", f"batch {m} {b}") for _ in range(ROUNDS) for m, b in BATCH]
    for _key, line in jobs[: len(ONE)] + [(k, ln) for k, ln in jobs if k.startswith("batch")][: len(BATCH)]:
        for v in workers:  # warm-up: drafters built, curves measured, first forwards
            ask(v, line)
    times: dict[tuple[str, str], list[tuple[float, int]]] = {}
    for j, (key, line) in enumerate(jobs):
        for v in (["old", "new"] if j % 2 == 0 else ["new", "old"]):
            times.setdefault((v, key), []).append(ask(v, line))
        print(j + 1, "/", len(jobs), key, flush=True)
    res = {}
    for key in dict.fromkeys(k for k, _ in jobs):
        old, new = times["old", key], times["new", key]
        res[key] = {"old_tok_s": sum(n for _, n in old) / sum(s for s, _ in old),
                    "new_tok_s": sum(n for _, n in new) / sum(s for s, _ in new),
                    "median_old_over_new_time": statistics.median(o[0] / n[0] for o, n in zip(old, new, strict=True)),
                    "pairs": len(old), "same_tokens": [o[1] for o in old] == [n[1] for n in new]}
        print(key, res[key], flush=True)
    json.dump(res, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
