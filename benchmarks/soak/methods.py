"""A server's memory as requests name one method after another (issue 54): each request picks its own
method with the `speculation` extension (chain:k=1, 2, ... then tree:budget=..., each a method the server
has not built yet), and the server's RSS is read from /metrics after each. Before the draft shelf and
the bound on kept methods, every new method loaded its draft again and started a prefix cache of its
own for it; now the draft is loaded once and at most MAX_METHODS factories are kept.

    python benchmarks/soak/methods.py URL [N]      # URL: the API base, http://127.0.0.1:PORT/v1

Prints one line per request (method, RSS in MB, growth since the first) and the total growth.
"""
from __future__ import annotations

import sys

import httpx

from specstack.bench.serve_wire import parse_rss

PROMPT = "def fibonacci(n):\n    "


def methods(n: int) -> list[str]:
    chains = [f"chain:k={k}" for k in range(1, 9)]
    trees = [f"tree:budget={b}" for b in range(4, 4 + max(0, n - len(chains)))]
    return (chains + trees)[:n]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    url, n = argv[0].rstrip("/"), int(argv[1]) if len(argv) > 1 else 16
    root = url[: -len("/v1")] if url.endswith("/v1") else url
    with httpx.Client(timeout=600) as http:
        model = http.get(url + "/models").json()["data"][0]["id"]
        first = None
        for method in methods(n):
            r = http.post(url + "/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 16,
                                                      "temperature": 0, "speculation": {"method": method}})
            rss = parse_rss(http.get(root + "/metrics").text) or 0
            first = rss if first is None else first
            print(f"{method:>16}  HTTP {r.status_code}  RSS {rss / 2**20:8.1f} MB  +{(rss - first) / 2**20:7.1f} MB",
                  flush=True)
    print(f"growth over {n - 1} methods after the first: {(rss - first) / 2**20:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
