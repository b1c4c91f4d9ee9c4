"""Issue 34's editor benchmark summary (run.sh writes the rows): latency to a complete suggestion (p50, p90)
cold and cached, decoding speed from each server's own `timings`, exact match of speculation against plain
decoding, and τ with tokens by origin for FIM against plain completion of the same prefixes.

    python benchmarks/fim/compare.py OUT_DIR > OUT_DIR/summary.md
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from pathlib import Path


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()] \
        if path.is_file() else []


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def decode_speed(rs: list[dict]) -> float:
    tokens = sum(r["tokens"] or 0 for r in rs)
    ms = sum(r["predicted_ms"] or 0.0 for r in rs)
    return tokens / ms * 1e3 if ms else float("nan")


def main() -> int:
    out = Path(sys.argv[1])
    ours, llama = rows(out / "specstack.jsonl"), rows(out / "llama-server.jsonl")
    print(f"# Editor infill benchmark\n\n{(out / 'settings.txt').read_text() if (out / 'settings.txt').is_file() else ''}")
    notes = out / "notes.txt"
    if notes.is_file():
        print(notes.read_text())
    print("| server | kind | requests | latency p50 ms | latency p90 ms | tokens (mean) | decode tokens/s "
          "(server timings) | prompt tokens read (mean) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    speed: dict[tuple[str, str], float] = {}
    lat: dict[tuple[str, str], tuple[float, float]] = {}
    for label, rs in (("specstack", ours), ("llama-server", llama)):
        for kind in ("cold", "cached", "ar"):
            sel = [r for r in rs if r["kind"] == kind]
            if not sel:
                continue
            ms = [r["latency_s"] * 1e3 for r in sel]
            speed[label, kind] = decode_speed(sel)
            lat[label, kind] = (pct(ms, 0.5), pct(ms, 0.9))
            print(f"| {label} | {kind} | {len(sel)} | {pct(ms, 0.5):.0f} | {pct(ms, 0.9):.0f} | "
                  f"{statistics.mean(r['tokens'] or 0 for r in sel):.1f} | {speed[label, kind]:.1f} | "
                  f"{statistics.mean(r['prompt_n'] or 0 for r in sel):.0f} |")
    print()
    for kind in ("cold", "cached"):
        if ("specstack", kind) in lat and ("llama-server", kind) in lat:
            (a50, a90), (b50, b90) = lat["specstack", kind], lat["llama-server", kind]
            print(f"- latency {kind}: specstack / llama-server = {a50 / b50:.2f} at p50, {a90 / b90:.2f} at p90")
    both = [speed.get(("specstack", k)) for k in ("cold", "cached")]
    if all(both) and ("llama-server", "cold") in speed:
        ref = decode_speed([r for r in llama if r["kind"] in ("cold", "cached")])
        mine = decode_speed([r for r in ours if r["kind"] in ("cold", "cached")])
        print(f"- decoding speed with speculation: {mine:.1f} tokens/s vs llama-server {ref:.1f} = {mine / ref:.2f} x")
    if ("specstack", "ar") in speed:
        mine = decode_speed([r for r in ours if r["kind"] in ("cold", "cached")])
        print(f"- speculation / our own ar: {mine / speed['specstack', 'ar']:.2f} x decoding speed")
    by_case = {(r["case"], r["kind"]): r for r in ours}
    cases = sorted({r["case"] for r in ours})
    same = [by_case[c, "cold"]["content"] == by_case[c, "ar"]["content"] for c in cases if (c, "ar") in by_case]
    if same:
        print(f"- exact match, speculation vs ar (same server, same weight format): {sum(same)}/{len(same)}")
    ll = {(r["case"], r["kind"]): r for r in llama}
    agree = [by_case[c, "cold"]["content"] == ll[c, "cold"]["content"] for c in cases if (c, "cold") in ll]
    if agree:
        print(f"- same middle as llama-server (different kernels, so int4 near-ties differ): {sum(agree)}/{len(agree)}")
    for label, rs in (("specstack", ours), ("llama-server", llama)):
        sel = [r for r in rs if r["kind"] == "cold"]
        if sel:
            print(f"- {label}: middle equal to the file's own body in {sum(r['exact_file'] for r in sel)}/{len(sel)}")
    print("\n## τ and tokens by origin: FIM against plain completion of the same prefixes (ours)\n")
    print("| request | tokens | τ (tokens per target forward) | target | draft | draft2 | context |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind, name in (("cold", "FIM (/infill)"), ("plain", "plain completion")):
        sel = [r for r in ours if r["kind"] == kind and r.get("speculation")]
        if not sel:
            continue
        origins: Counter[str] = Counter()
        for r in sel:
            origins.update({k: int(v) for k, v in r["speculation"]["origins"].items()})
        total = sum(origins.values())
        tau = total / max(1, origins.get("target", 0))
        print(f"| {name} | {total} | {tau:.2f} | " + " | ".join(str(origins.get(o, 0)) for o in
                                                                 ("target", "draft", "draft2", "context")) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
