"""Decode speed of two source trees of specstack, A/B in one run: two worker processes (old code, new
code) each load the default model once; the driver sends them the same (method, prompt) requests
alternately, the order flipped every request, so both see the same machine load.

    python benchmarks/restructure_ab/driver.py OLD_TREE NEW_TREE OUT.json   (trees: git worktrees)
"""
import json
import os
import statistics
import subprocess
import sys


def main() -> None:
    old_tree, new_tree, out_path = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3]
    env_old = dict(os.environ, PYTHONPATH=old_tree); env_new = dict(os.environ, PYTHONPATH=new_tree)
    py = sys.executable
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
    workers = {"old": subprocess.Popen([py, worker], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env_old, cwd="/"),
               "new": subprocess.Popen([py, worker], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env_new, cwd="/")}
    for w in workers.values():
        assert w.stdout.readline().strip() == "ready"
    methods = ["ar", "ngram:max=8,cost=1,match=6", "staged:cost=1,d2=3"]
    times = {(v, m): [] for v in workers for m in methods}
    for rnd in range(2):
        for i in range(10):
            for m in methods:
                order = ["old", "new"] if (i + rnd) % 2 == 0 else ["new", "old"]
                for v in order:
                    w = workers[v]; w.stdin.write(f"{m} {i}\n"); w.stdin.flush()
                    s, n = w.stdout.readline().split(); times[v, m].append(float(s) / int(n))
        print("round", rnd, flush=True)
    res = {}
    for m in methods:
        ratios = [o / n for o, n in zip(times["old", m], times["new", m], strict=True)]
        res[m] = {"old_tok_s": len(times["old", m]) / sum(times["old", m]), "new_tok_s": len(times["new", m]) / sum(times["new", m]),
                  "median_old_over_new_time": statistics.median(ratios), "pairs": len(ratios)}
        print(m, res[m], flush=True)
    json.dump(res, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
