"""How draft2's Katz backoff trigram is estimated from a corpus (Spector & Ré 2023; DESIGN §4
"N-gram model (draft2)"): token streams in, flat probability tables out (`KatzTables`). katz.py wraps
the tables as `KatzTrigram`, the model the drafters query, saves and loads.

Katz backoff (per level, trigram -> bigram -> unigram), with c(.) counts from the training corpus:
    P(w|u,v) = d_c · c(uvw) / c(uv)        if uvw was seen (kept after pruning), c = c(uvw)
             = α(uv) · P(w|v)               otherwise
    α(uv)    = (1 − Σ_seen P(w|u,v)) / (1 − Σ_seen P(w|v))      (sums over the w seen after uv)
    d_r      = ((r+1)·n_{r+1} / (r·n_r) − A) / (1 − A)  for r ≤ k,  A = (k+1)·n_{k+1} / n_1,
               1 for r > k, and 1 when the formula is undefined or falls outside (0, 1];
n_r = the number of distinct n-grams of the level seen exactly r times (in the unpruned table).
The unigram level uses the same discounts over the whole vocabulary: the mass taken from the seen
tokens is spread evenly over the unseen ones (add-one when nothing would be left for them).

Pruning (`min_count`): n-grams seen fewer times are dropped *after* the discounts and the context
totals c(uv) are taken from the full table, so the dropped mass simply joins the backoff mass and
α renormalises it: the pruned model is still a proper distribution (SRILM-style count cut-offs).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_VOCAB = 2 ** 21  # trigram keys (u*V + v)*V + w must fit in int64


# ---------------------------------------------------------------------------------------------------
# Good–Turing discounts
# ---------------------------------------------------------------------------------------------------
def count_of_counts(counts: np.ndarray, upto: int) -> np.ndarray:
    """n[r] = how many distinct n-grams were seen exactly r times, for r = 0..upto (n[0] unused)."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.bincount(counts[counts <= upto], minlength=upto + 1)[: upto + 1]


def good_turing_discounts(n: Sequence[int] | np.ndarray, k: int) -> tuple[np.ndarray, float]:
    """(d, A): d[r] for r = 0..k (d[0] = 1, unused) from the count-of-counts n (n[r], r = 0..k+1)."""
    def n_(r: int) -> int:
        return int(n[r]) if r < len(n) else 0

    d = np.ones(k + 1)
    if n_(1) == 0:
        return d, float("nan")
    A = (k + 1) * n_(k + 1) / n_(1)
    if not A < 1.0:  # the Katz correction needs A < 1; otherwise keep the counts undiscounted
        return d, A
    for r in range(1, k + 1):
        if n_(r) == 0:
            continue
        x = ((r + 1) * n_(r + 1) / (r * n_(r)) - A) / (1.0 - A)
        if 0.0 < x <= 1.0:
            d[r] = x
    return d, A


def finite_or_none(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def discount_of(counts: np.ndarray, d: np.ndarray) -> np.ndarray:
    k = len(d) - 1
    return np.where(counts <= k, d[np.minimum(counts, k)], 1.0)


# ---------------------------------------------------------------------------------------------------
# One backoff level as flat arrays
# ---------------------------------------------------------------------------------------------------
@dataclass
class BackoffLevel:
    """Contexts (sorted keys) and, per context, the kept continuations sorted by probability
    (descending, then token id): entries off[i]:off[i+1] belong to context ctx[i]."""
    ctx: np.ndarray  # int64 [C] sorted context keys (v for bigrams, u*V+v for trigrams)
    off: np.ndarray  # int64 [C+1]
    tok: np.ndarray  # uint16/int32 [E]
    prob: np.ndarray  # float32 [E]
    alpha: np.ndarray  # float64 [C] backoff weight of each context


def build_level(keys: np.ndarray, counts: np.ndarray, V: int, d: np.ndarray, min_count: int,
                 lower_prob: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> tuple[BackoffLevel, np.ndarray, np.ndarray]:
    """One Katz level from the unique n-gram keys (sorted; key = context*V + w) and their counts.

    lower_prob(ctx_keys, w) gives the next-lower level's P(w | shorter context) for entries whose
    context key is ctx_keys. Returns the level and, for the next level's joins, the kept keys (sorted)
    with their probabilities."""
    ctx_of = keys // V
    w = keys % V
    # context totals c(ctx) over the full (unpruned) table: the MLE normaliser
    starts = np.flatnonzero(np.r_[True, ctx_of[1:] != ctx_of[:-1]]) if len(keys) else np.zeros(0, np.int64)
    group = np.cumsum(np.r_[False, ctx_of[1:] != ctx_of[:-1]]) if len(keys) else np.zeros(0, np.int64)
    totals = np.add.reduceat(counts, starts) if len(keys) else np.zeros(0, np.int64)
    kept = counts >= min_count
    ctx_k, w_k, c_k, g_k = ctx_of[kept], w[kept], counts[kept], group[kept]
    p = (discount_of(c_k, d) * c_k / totals[g_k]).astype(np.float32).astype(np.float64)
    low = lower_prob(ctx_k, w_k)
    G = len(totals)
    seen = np.bincount(g_k, weights=p, minlength=G)
    seen_low = np.bincount(g_k, weights=low, minlength=G)
    has = np.bincount(g_k, minlength=G) > 0
    num = np.maximum(1.0 - seen, 0.0)
    den = 1.0 - seen_low
    full = den <= 1e-12  # every token with lower-order mass was seen here: nothing to back off to
    alpha = np.where(full, 0.0, num / np.where(full, 1.0, den))
    scale = np.where(full & (seen > 0), 1.0 / np.where(seen > 0, seen, 1.0), 1.0)
    p = (p * scale[g_k]).astype(np.float32)
    # store: contexts with kept entries, entries by (context, -p, token)
    order = np.lexsort((w_k, -p, ctx_k))
    ctx_ids = np.flatnonzero(has)
    level_ctx = ctx_of[starts][ctx_ids] if G else np.zeros(0, np.int64)
    n_per = np.bincount(g_k, minlength=G)[ctx_ids]
    off = np.r_[0, np.cumsum(n_per)].astype(np.int64)
    tok_dtype = np.uint16 if V <= 65536 else np.int32
    level = BackoffLevel(level_ctx.astype(np.int64), off, w_k[order].astype(tok_dtype), p[order],
                   alpha[ctx_ids].astype(np.float64))
    return level, keys[kept], p



# ---------------------------------------------------------------------------------------------------
# The three levels from a corpus
# ---------------------------------------------------------------------------------------------------
@dataclass
class KatzTables:
    """A trained trigram: the unigram over the whole vocabulary and the two backoff levels above it."""
    vocab_size: int
    k: int
    unigram: np.ndarray  # float64 [V], sums to 1
    bigram: BackoffLevel
    trigram: BackoffLevel
    meta: dict[str, Any]  # what training saw and chose: counts, discounts, A per level


def count_ngrams(token_streams: Iterable[Sequence[int]], V: int) -> tuple[np.ndarray, list[np.ndarray],
                                                                           list[np.ndarray], int]:
    """Unigram counts [V] and the bi/trigram keys of every stream (no n-gram crosses a stream boundary),
    with the number of non-empty streams."""
    uni, bi, tri = [], [], []
    n_streams = 0
    for s in token_streams:
        a = np.asarray(s, dtype=np.int64).ravel()
        if a.size == 0:
            continue
        if a.min() < 0 or a.max() >= V:
            raise ValueError(f"token id out of range [0, {V}): {int(a.min())}..{int(a.max())}")
        n_streams += 1
        uni.append(a)
        if a.size >= 2:
            bi.append(a[:-1] * V + a[1:])
        if a.size >= 3:
            tri.append((a[:-2] * V + a[1:-1]) * V + a[2:])
    c1 = np.bincount(np.concatenate(uni), minlength=V).astype(np.int64) if uni else np.zeros(V, np.int64)
    return c1, bi, tri, n_streams


def _unique(parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys (sorted) and how often each occurs."""
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    keys, counts = np.unique(np.concatenate(parts), return_counts=True)
    return keys, counts.astype(np.int64)


def unigram_probs(c1: np.ndarray, d1: np.ndarray) -> np.ndarray:
    """P(w) over the whole vocabulary: discounted counts, the discounted mass spread evenly over the
    unseen tokens."""
    V, N = len(c1), int(c1.sum())
    if N == 0:
        p1 = np.full(V, 1.0 / V)
    else:
        p1 = discount_of(c1, d1) * c1 / N
        unseen = c1 == 0
        left = 1.0 - p1.sum()
        if unseen.any() and left > 1e-12:
            p1[unseen] = left / unseen.sum()
        elif unseen.any():  # nothing was discounted: fall back to add-one
            p1 = (c1 + 1.0) / (N + V)
        else:
            p1 = c1 / N  # every token seen: the MLE is already a distribution over V
    p1 = p1.astype(np.float32).astype(np.float64)
    p1 /= p1.sum()
    return p1


def bigram_prob(bigram: BackoffLevel, bi_keys: np.ndarray, bi_p: np.ndarray, p1: np.ndarray,
                V: int) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """P(w | v) for arrays of (v, w): the kept bigram's probability, else α(v)·P(w)."""
    def p_bigram(v: np.ndarray, w: np.ndarray) -> np.ndarray:
        key = v * V + w
        pos = np.searchsorted(bi_keys, key)
        hit = pos < len(bi_keys)
        hit[hit] = bi_keys[pos[hit]] == key[hit]
        alpha = np.ones(len(v))
        if len(bigram.ctx):
            row = np.minimum(np.searchsorted(bigram.ctx, v), len(bigram.ctx) - 1)
            has = bigram.ctx[row] == v
            alpha[has] = bigram.alpha[row[has]]
        p = alpha * p1[w]
        p[hit] = bi_p[pos[hit]]
        return p

    return p_bigram


def estimate(token_streams: Iterable[Sequence[int]], vocab_size: int, k: int = 5, min_count: int = 1,
             min_count_bigram: int | None = None) -> KatzTables:
    """Count uni/bi/trigrams within each stream, discount with Good–Turing (counts <= k), drop n-grams
    seen fewer than min_count times (trigrams) / min_count_bigram times (bigrams; default: min_count),
    and compute the backoff weights."""
    V = int(vocab_size)
    if not 1 <= V < MAX_VOCAB:
        raise ValueError(f"vocab_size must be in [1, 2**21), got {vocab_size}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    min_bi = min_count if min_count_bigram is None else min_count_bigram
    if min_count < 1 or min_bi < 1:
        raise ValueError("min_count must be >= 1")
    c1, bi, tri, n_streams = count_ngrams(token_streams, V)

    # 1. unigram: Good–Turing over the whole vocabulary
    d1, A1 = good_turing_discounts(count_of_counts(c1[c1 > 0], k + 1), k)
    p1 = unigram_probs(c1, d1)

    # 2. bigram, backing off to the unigram
    k2, n2 = _unique(bi)
    d2, A2 = good_turing_discounts(count_of_counts(n2, k + 1), k)
    bigram, bi_keys, bi_p = build_level(k2, n2, V, d2, min_bi, lambda ctx, w: p1[w])
    p_bigram = bigram_prob(bigram, bi_keys, bi_p, p1, V)

    # 3. trigram, backing off to the bigram
    k3, n3 = _unique(tri)
    d3, A3 = good_turing_discounts(count_of_counts(n3, k + 1), k)
    trigram, _, _ = build_level(k3, n3, V, d3, min_count, lambda ctx, w: p_bigram(ctx % V, w))

    meta = {
        "k": k, "min_count": min_count, "min_count_bigram": min_bi, "streams": n_streams, "tokens": int(c1.sum()),
        "distinct": {"unigram": int((c1 > 0).sum()), "bigram": len(k2), "trigram": len(k3)},
        "kept": {"bigram": len(bigram.tok), "trigram": len(trigram.tok)},
        "contexts": {"bigram": len(bigram.ctx), "trigram": len(trigram.ctx)},
        "discounts": {"unigram": d1[1:].tolist(), "bigram": d2[1:].tolist(), "trigram": d3[1:].tolist()},
        "A": {"unigram": finite_or_none(A1), "bigram": finite_or_none(A2), "trigram": finite_or_none(A3)},
    }
    return KatzTables(V, k, p1, bigram, trigram, meta)
