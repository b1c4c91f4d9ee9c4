"""Reports of `specstack bench`, built only from its rows (results.jsonl; DESIGN §2.7): summary.json,
summary.md, speedup_per_prompt.png, tau_hist.png, origins.html. The rows are read by rows.py; the tables
printed from finished runs (--compare, --ratios, --phases) are tables.py's.

Speed-ups are per prompt: a method's tokens/s on a prompt (the mean over its repeats) divided by the
baseline's on the same prompt; `mean_speedup_vs_X` / `median_speedup_vs_X` are the mean / median of
those ratios over the prompts both ran. `tokens_per_s` is total tokens / total seconds. `tau` is
total tokens / total target forwards that produced tokens (rows that report one). `identical_rate`
is the share of rows whose tokens equal the greedy `ar` reference (null when sampling). `origins` is
the share of emitted tokens by who produced them (target, draft model, draft2 = the trigram, context
lookup), over the rows that report origins (our methods; null for the peers).

A batch-mode run (--batch-sizes) is summarized by batch_report.py (entries `METHOD@bB`, summary.md's
batch table, batch_throughput.png) beside its single-sequence `ar` rows, summarized here.
"""
from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specstack.bench.batch_report import batch_section, is_batch_row, plot_batch_throughput, summarize_batches
from specstack.bench.figures import pyplot, save_png
from specstack.bench.rows import Row
from specstack.files import atomic_write_text

SUMMARY_FIELDS = ("dtype", "prompts", "rows", "new_tokens", "seconds", "tokens_per_s", "mean_speedup_vs_hf",
                  "median_speedup_vs_hf", "mean_speedup_vs_ar", "median_speedup_vs_ar", "tau", "identical_rate",
                  "origins")


# ---------------------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------------------
def methods_in(rows: Sequence[Row], order: Sequence[str] = ()) -> list[str]:
    """Method labels: `order` first (those with rows), then any others in row order."""
    present = dict.fromkeys(r["method"] for r in rows)
    return [m for m in order if m in present] + [m for m in present if m not in order]


def prompt_speeds(rows: Sequence[Row], method: str) -> dict[str, float]:
    """task_id -> tokens/s of `method` on it, averaged over its repeats."""
    by_task: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r["method"] == method:
            by_task[r["task_id"]].append(r["tokens_per_s"])
    return {t: statistics.mean(v) for t, v in by_task.items()}


def prompt_speedups(rows: Sequence[Row], method: str, baseline: str) -> dict[str, float]:
    """task_id -> speed-up of `method` over `baseline` (prompts both ran, baseline speed > 0)."""
    mine, base = prompt_speeds(rows, method), prompt_speeds(rows, baseline)
    return {t: mine[t] / base[t] for t in mine if t in base and base[t] > 0}


def origin_shares(rows: Sequence[Row]) -> dict[str, float] | None:
    """Share of the emitted tokens by origin over `rows` (those that report origins), in the token-origin
    view's order; None when no row reports them."""
    from specstack.report.origins import ORIGINS

    counts: dict[str, int] = defaultdict(int)
    for r in rows:
        for origin, n in (r.get("origins") or {}).items():
            counts[origin] += n
    total = sum(counts.values())
    if not total:
        return None
    order = [o for o in ORIGINS if o in counts] + sorted(o for o in counts if o not in ORIGINS)
    return {o: counts[o] / total for o in order if counts[o]}


def _mean_median(values: Sequence[float]) -> tuple[float | None, float | None]:
    return (statistics.mean(values), statistics.median(values)) if values else (None, None)


def summarize(rows: Sequence[Row], ar: str | None, hf: str | None,
              order: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Per method: the fields of SUMMARY_FIELDS (see the module doc); ar / hf name the baseline
    methods (None: the matching speed-ups are null)."""
    out: dict[str, dict[str, Any]] = {}
    for m in methods_in(rows, order):
        mine = [r for r in rows if r["method"] == m]
        tokens = sum(r["new_tokens"] for r in mine)
        seconds = sum(r["seconds"] for r in mine)
        s: dict[str, Any] = {"dtype": mine[0].get("dtype"), "prompts": len({r["task_id"] for r in mine}),
                             "rows": len(mine), "new_tokens": tokens, "seconds": seconds,
                             "tokens_per_s": tokens / seconds if seconds > 0 else None}
        for key, base in (("hf", hf), ("ar", ar)):
            ratios = list(prompt_speedups(rows, m, base).values()) if base else []
            s[f"mean_speedup_vs_{key}"], s[f"median_speedup_vs_{key}"] = _mean_median(ratios)
        with_tau = [r for r in mine if r.get("tau")]
        forwards = sum(r["new_tokens"] / r["tau"] for r in with_tau)
        s["tau"] = sum(r["new_tokens"] for r in with_tau) / forwards if forwards > 0 else None
        checked = [r["identical_to_ar"] for r in mine if r.get("identical_to_ar") is not None]
        s["identical_rate"] = sum(checked) / len(checked) if checked else None
        s["origins"] = origin_shares(mine)
        out[m] = s
    return out


# ---------------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------------
def cell(v: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if v is None else format(v, spec) + suffix


def origins_text(shares: Mapping[str, float] | None) -> str:
    """`64 % target, 36 % draft` (– when unknown)."""
    if not shares:
        return "–"
    return ", ".join(("< 1" if v < 0.005 else f"{100 * v:.0f}") + f" % {o}" for o, v in shares.items())


def summary_table(summary: Mapping[str, Mapping[str, Any]], hf: str | None, ar: str | None) -> str:
    hf, ar = hf or "hf", ar or "ar"
    lines = [f"| method | dtype | prompts | tokens | seconds | tokens/s | mean speed-up vs {hf} | median vs {hf} | "
             f"mean speed-up vs {ar} | median vs {ar} | tau | identical to ar | tokens by origin |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for m, s in summary.items():
        lines.append(f"| {m} | {s['dtype']} | {s['prompts']} | {s['new_tokens']} | {s['seconds']:.1f} | "
                     f"{cell(s['tokens_per_s'], '.1f')} | {cell(s['mean_speedup_vs_hf'])} | "
                     f"{cell(s['median_speedup_vs_hf'])} | "
                     f"{cell(s['mean_speedup_vs_ar'])} | {cell(s['median_speedup_vs_ar'])} | {cell(s['tau'])} | "
                     f"{cell(None if s['identical_rate'] is None else 100 * s['identical_rate'], '.0f', ' %')} | "
                     f"{origins_text(s.get('origins'))} |")
    return "\n".join(lines)


def render_md(summary: Mapping[str, Mapping[str, Any]], meta: Mapping[str, Any],
              batches: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """summary.md; `batches`: the batch-mode entries (batch_report.summarize_batches), if any."""
    st, mach, v = meta["settings"], meta["machine"], meta["versions"]
    sampling = "greedy" if not st["temperature"] else (
        f"sampling: temperature {st['temperature']}, top-k {st['top_k']}, top-p {st['top_p']}, seed {st['seed']}")
    parts = [
        f"# specstack bench: {st['model']} on {st['prompts']}", "",
        f"- command: `{meta['command']}`",
        f"- machine: {mach['cpu']}; {mach['threads']} threads for torch and llama.cpp; device {st['device']}",
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
        *[f"- peer {label}: {about}" for label, about in meta.get("peers", {}).items()],
        f"- date: {meta['date']}",
        f"- {meta['n_prompts']} prompts x {st['max_new_tokens']} new tokens x {st['repeats']} repeats; {sampling}; "
        f"default weight format {st['dtype']}",
    ]
    if batches is None:
        parts += [
            "- protocol: models loaded once, one warm-up generation per method, then per prompt every method in "
            "turn (A B C A B C ...); every method generates exactly max-new-tokens tokens (EOS does not stop it), "
            "wall time includes the prefill; speed-ups are per-prompt ratios of tokens/s (repeats averaged first).",
            "", summary_table(summary, meta["baselines"].get("hf"), meta["baselines"].get("ar"))]
    else:
        parts += ["", "## Single sequence: our `ar`, each prompt alone (the reference of the batches)", ""]
        parts.append(summary_table(summary, meta["baselines"].get("hf"), meta["baselines"].get("ar")) if summary
                     else "(none: every batch row was already in results.jsonl)")
        parts += batch_section(batches, meta["baselines"].get("ar"), st.get("batch_sizes") or ())
    notes = list(meta.get("notes", []))
    notes += [f"{m}: skipped ({why})" for m, why in meta.get("skipped", {}).items()]
    if notes:
        parts += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    files = ", ".join(meta.get("files", []))
    rows_are = ("one row per prompt, method and repeat" if batches is None else
                "one row per sequence: prompt, method, batch size, batch and repeat; llamacpp-batched one per batch "
                "size; the single-sequence ar one per prompt")
    parts += ["", f"Files: results.jsonl ({rows_are}), {files}."]
    if meta.get("origins"):
        parts.append(f"origins.html: {meta['origins']}.")
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------------
# Figures and the origins page
# ---------------------------------------------------------------------------------------------------
def plot_speedups(rows: Sequence[Row], methods: Sequence[str], baseline: str | None, path: Path) -> None:
    """Per-prompt speed-up over the baseline of every other method, prompts sorted (staged paper,
    Figure 2); without a baseline, per-prompt tokens/s."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for m in methods:
        if m == baseline:
            continue
        values = prompt_speedups(rows, m, baseline) if baseline else prompt_speeds(rows, m)
        ys = sorted(values.values())
        ax.plot(range(1, len(ys) + 1), ys, marker="o" if len(ys) <= 40 else None, ms=3, label=m)
    if baseline:
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("prompt (sorted by speed-up)" if baseline else "prompt (sorted)")
    ax.set_ylabel(f"speed-up over {baseline}" if baseline else "tokens/s")
    ax.set_title("Per-prompt speed-up" if baseline else "Per-prompt tokens/s")
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def plot_tau_hist(rows: Sequence[Row], methods: Sequence[str], path: Path) -> None:
    """Histogram of accepted draft tokens per step, per speculative method (share of steps)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    per_method = {m: [a for r in rows if r["method"] == m for a in (r.get("accepted_per_step") or [])]
                  for m in methods}
    per_method = {m: v for m, v in per_method.items() if v}
    if per_method:
        top = max(max(v) for v in per_method.values())
        width = 0.8 / len(per_method)
        for i, (m, values) in enumerate(per_method.items()):
            counts = [values.count(k) / len(values) for k in range(top + 1)]
            ax.bar([k - 0.4 + (i + 0.5) * width for k in range(top + 1)], counts, width=width, label=m)
        ax.set_xticks(range(top + 1))
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no speculative method in this run", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("draft tokens accepted per target forward (the step emits one more)")
    ax.set_ylabel("share of steps")
    ax.set_title("Accepted tokens per step")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def origins_choice(rows: Sequence[Row], methods: Sequence[str], baseline: str | None) -> Row | None:
    """The row for the token-origin page: the first speculative method (rows with per-token origins),
    on its best-speed-up prompt over the baseline (or its fastest prompt without one), first repeat."""
    method = next((m for m in methods if any(r["method"] == m and r.get("token_origins") for r in rows)), None)
    if method is None:
        return None
    scores = prompt_speedups(rows, method, baseline) if baseline else {}
    scores = scores or prompt_speeds(rows, method)
    best = max(scores, key=lambda t: scores[t])
    return min((r for r in rows if r["method"] == method and r["task_id"] == best and r.get("token_origins")),
               key=lambda r: r["repeat"])


def origins_html(row: Row, tokenizer: Any, title: str) -> str:
    from specstack.report.origins import html_page, token_pieces

    pieces = token_pieces(tokenizer, row["tokens"])
    line = (f"{row['task_id']}: {row['new_tokens']} tokens in {row['seconds']:.2f} s "
            f"({row['tokens_per_s']:.1f} tokens/s), tau {row['tau']:.2f}")
    return html_page(pieces, row["token_origins"], title, line)



# ---------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------
def write_report(out: Path, rows: Sequence[Row], meta: dict[str, Any], order: Sequence[str],
                 tokenizer: Any = None) -> dict[str, Any]:
    """summary.json, summary.md and the figures from all rows; origins.html when a speculative
    method ran and a tokenizer is given. Returns summary.json's content."""
    batch_rows = [r for r in rows if is_batch_row(r)]
    meta["n_prompts"] = len({r["task_id"] for r in rows if not r.get("aggregate")})
    if batch_rows:
        return _write_batch_report(out, rows, meta, order)
    ar, hf = meta["baselines"].get("ar"), meta["baselines"].get("hf")
    methods = methods_in(rows, order)
    summary = summarize(rows, ar, hf, methods)
    baseline = hf if hf in summary else (ar if ar in summary else None)
    chosen = origins_choice(rows, methods, baseline) if tokenizer is not None else None
    meta["origins"] = None
    if chosen is not None:
        title = f"{chosen['method']} on {chosen['task_id']}"
        page = origins_html(chosen, tokenizer, f"specstack bench: {title}")
        atomic_write_text(out / "origins.html", page)
        meta["origins"] = f"{title} (best speed-up over {baseline})" if baseline else title
    else:
        (out / "origins.html").unlink(missing_ok=True)  # never leave a stale page from an earlier run
    try:
        plot_speedups(rows, methods, baseline, out / "speedup_per_prompt.png")
        plot_tau_hist(rows, methods, out / "tau_hist.png")
    except ImportError:
        meta["notes"] = [*meta["notes"], "figures skipped: matplotlib is not installed (pip install matplotlib)"]
    meta["files"] = [f for f in ("summary.json", "summary.md", "speedup_per_prompt.png", "tau_hist.png", "origins.html")
                     if f.startswith("summary") or (out / f).is_file()]
    return _write_summaries(out, summary, meta)


META_KEYS = ("baselines", "skipped", "notes", "peers", "settings", "machine", "versions", "command", "date", "n_prompts")


def _write_summaries(out: Path, summary: dict[str, Any], meta: dict[str, Any],
                     batches: dict[str, Any] | None = None) -> dict[str, Any]:
    doc = {"methods": {**summary, **(batches or {})}, **{k: meta[k] for k in META_KEYS}}
    atomic_write_text(out / "summary.json", json.dumps(doc, indent=1) + "\n")
    atomic_write_text(out / "summary.md", render_md(summary, meta, batches))
    return doc


def _write_batch_report(out: Path, rows: Sequence[Row], meta: dict[str, Any], order: Sequence[str]) -> dict[str, Any]:
    """A batch-mode run (bench/batched.py): the single-sequence ar rows summarized as any rows, one
    entry per METHOD@bB (batch_report.py), batch_throughput.png. The per-prompt figures and the
    origins page belong to single-sequence runs and are not made (nor left over from one)."""
    singles = [r for r in rows if not is_batch_row(r)]
    ar = meta["baselines"].get("ar")
    summary = summarize(singles, ar, None, methods_in(singles, order))
    base = summary.get(ar, {}).get("tokens_per_s") if ar else None
    batches = summarize_batches([r for r in rows if is_batch_row(r)], order, base)
    meta["origins"] = None
    for stale in ("origins.html", "speedup_per_prompt.png", "tau_hist.png"):
        (out / stale).unlink(missing_ok=True)
    try:
        plot_batch_throughput(batches, out / "batch_throughput.png")
    except ImportError:
        meta["notes"] = [*meta["notes"], "figures skipped: matplotlib is not installed (pip install matplotlib)"]
    meta["files"] = [f for f in ("summary.json", "summary.md", "batch_throughput.png")
                     if f.startswith("summary") or (out / f).is_file()]
    return _write_summaries(out, summary, meta, batches)
