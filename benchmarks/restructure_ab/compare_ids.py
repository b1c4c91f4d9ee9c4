"""Greedy token identity of one `specstack bench` run against another (e.g. before/after a change):
    python benchmarks/restructure_ab/compare_ids.py OLD/results.jsonl NEW/results.jsonl [NEW2/results.jsonl ...]"""
import collections
import json
import sys


def main() -> None:
    def rows(p):
        return {(r["task_id"], r["method"]): r for r in map(json.loads, open(p))}
    old = rows(sys.argv[1])
    new = {}
    for p in sys.argv[2:]:
        new.update(rows(p))
    same = collections.Counter(); total = collections.Counter(); diff = []
    for key, r in new.items():
        if key not in old: continue
        total[key[1]] += 1
        if r["tokens"] == old[key]["tokens"]: same[key[1]] += 1
        else: diff.append(key)
    for m in total: print(f"{m}: {same[m]}/{total[m]} token-identical to the old commit")
    print("differences:", diff)


if __name__ == "__main__":
    main()
