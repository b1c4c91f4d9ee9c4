"""draft2's model (Spector & Ré 2023; DESIGN §4 "N-gram model (draft2)"): a Katz backoff trigram with
Good–Turing discounts, trained on a corpus (`specstack ngram train`) and saved as a compact .npz. It is
a proper distribution over the target vocabulary V (every token has mass through the unigram), so it
can also serve as a draft q.

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

import heapq
import json
import os
import zipfile
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specstack.errors import SpecstackError
from specstack.files import atomic_output

FORMAT_VERSION = 1


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


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def _discount_of(counts: np.ndarray, d: np.ndarray) -> np.ndarray:
    k = len(d) - 1
    return np.where(counts <= k, d[np.minimum(counts, k)], 1.0)


# ---------------------------------------------------------------------------------------------------
# One backoff level as flat arrays
# ---------------------------------------------------------------------------------------------------
@dataclass
class _Level:
    """Contexts (sorted keys) and, per context, the kept continuations sorted by probability
    (descending, then token id): entries off[i]:off[i+1] belong to context ctx[i]."""
    ctx: np.ndarray  # int64 [C] sorted context keys (v for bigrams, u*V+v for trigrams)
    off: np.ndarray  # int64 [C+1]
    tok: np.ndarray  # uint16/int32 [E]
    prob: np.ndarray  # float32 [E]
    alpha: np.ndarray  # float64 [C] backoff weight of each context


def _build_level(keys: np.ndarray, counts: np.ndarray, V: int, d: np.ndarray, min_count: int,
                 lower_prob) -> tuple[_Level, np.ndarray, np.ndarray]:
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
    p = (_discount_of(c_k, d) * c_k / totals[g_k]).astype(np.float32).astype(np.float64)
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
    level = _Level(level_ctx.astype(np.int64), off, w_k[order].astype(tok_dtype), p[order],
                   alpha[ctx_ids].astype(np.float64))
    return level, keys[kept], p


# ---------------------------------------------------------------------------------------------------
# The trigram
# ---------------------------------------------------------------------------------------------------
@dataclass
class _Entry:
    """A context's kept continuations as Python objects (built on first use, then cached)."""
    toks: list[int]
    probs: list[float]
    seen: dict[int, float]
    alpha: float


class KatzTrigram:
    """Katz backoff trigram over token ids 0..V-1 (see the module docstring for the formulas)."""

    _CACHE_LIMIT = 200_000  # cached contexts (Python lists) before the cache is dropped
    _WARM_ENTRIES = 256  # contexts with more continuations than this are materialised at load

    def __init__(self, vocab_size: int, k: int, unigram: np.ndarray, bigram: _Level, trigram: _Level,
                 meta: Mapping | None = None) -> None:
        self.vocab_size = int(vocab_size)
        self.k = int(k)
        self.unigram = np.asarray(unigram, dtype=np.float64)
        if self.unigram.shape != (self.vocab_size,):
            raise ValueError(f"unigram table has shape {self.unigram.shape}, expected ({self.vocab_size},)")
        self.bigram, self.trigram = bigram, trigram
        self.meta: dict = dict(meta or {})
        # context key -> row, built once (fast: a few hundred thousand ints at most)
        self._bi_row = dict(zip(bigram.ctx.tolist(), range(len(bigram.ctx)), strict=True))
        self._tri_row = dict(zip(trigram.ctx.tolist(), range(len(trigram.ctx)), strict=True))
        self._uni_list: list[float] = self.unigram.tolist()
        # tokens by unigram probability (descending, ties by id): the last stream of top()
        self._uni_order: list[int] = np.lexsort((np.arange(self.vocab_size), -self.unigram)).tolist()
        self._bi_cache: dict[int, _Entry] = {}
        self._tri_cache: dict[int, _Entry] = {}
        # materialise the few very common contexts now (~10 ms), so no proposal pays for them later
        for level, rows, cache in ((bigram, self._bi_row, self._bi_cache), (trigram, self._tri_row, self._tri_cache)):
            for row in np.flatnonzero(np.diff(level.off) > self._WARM_ENTRIES):
                self._entry(level, rows, cache, int(level.ctx[row]))

    # ---- training -------------------------------------------------------------------------------
    @classmethod
    def train(cls, token_streams: Iterable[Sequence[int]], vocab_size: int, k: int = 5,
              min_count: int = 1, min_count_bigram: int | None = None) -> KatzTrigram:
        """Count uni/bi/trigrams within each stream (no n-gram crosses a stream boundary), discount
        with Good–Turing (counts <= k), drop n-grams seen fewer than min_count times (trigrams) /
        min_count_bigram times (bigrams; default: min_count), and compute the backoff weights."""
        V = int(vocab_size)
        if not 1 <= V < 2 ** 21:  # trigram keys (u*V + v)*V + w must fit in int64
            raise ValueError(f"vocab_size must be in [1, 2**21), got {vocab_size}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        min_bi = min_count if min_count_bigram is None else min_count_bigram
        if min_count < 1 or min_bi < 1:
            raise ValueError("min_count must be >= 1")
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

        def unique(parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
            if not parts:
                return np.zeros(0, np.int64), np.zeros(0, np.int64)
            keys, counts = np.unique(np.concatenate(parts), return_counts=True)
            return keys, counts.astype(np.int64)

        # 1. unigram: Good–Turing over the whole vocabulary
        c1 = np.bincount(np.concatenate(uni), minlength=V).astype(np.int64) if uni else np.zeros(V, np.int64)
        N = int(c1.sum())
        d1, A1 = good_turing_discounts(count_of_counts(c1[c1 > 0], k + 1), k)
        if N == 0:
            p1 = np.full(V, 1.0 / V)
        else:
            p1 = _discount_of(c1, d1) * c1 / N
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

        # 2. bigram, backing off to the unigram
        k2, n2 = unique(bi)
        d2, A2 = good_turing_discounts(count_of_counts(n2, k + 1), k)
        bigram, bi_keys, bi_p = _build_level(k2, n2, V, d2, min_bi, lambda ctx, w: p1[w])

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

        # 3. trigram, backing off to the bigram
        k3, n3 = unique(tri)
        d3, A3 = good_turing_discounts(count_of_counts(n3, k + 1), k)
        trigram, _, _ = _build_level(k3, n3, V, d3, min_count, lambda ctx, w: p_bigram(ctx % V, w))

        meta = {
            "format": FORMAT_VERSION, "k": k, "min_count": min_count, "min_count_bigram": min_bi,
            "streams": n_streams, "tokens": N,
            "distinct": {"unigram": int((c1 > 0).sum()), "bigram": len(k2), "trigram": len(k3)},
            "kept": {"bigram": len(bigram.tok), "trigram": len(trigram.tok)},
            "contexts": {"bigram": len(bigram.ctx), "trigram": len(trigram.ctx)},
            "discounts": {"unigram": d1[1:].tolist(), "bigram": d2[1:].tolist(), "trigram": d3[1:].tolist()},
            "A": {"unigram": _finite(A1), "bigram": _finite(A2), "trigram": _finite(A3)},
        }
        return cls(V, k, p1, bigram, trigram, meta)

    @property
    def discounts(self) -> dict[str, list[float]]:
        """d_1..d_k per level ("unigram", "bigram", "trigram")."""
        return self.meta.get("discounts", {})

    # ---- save / load ----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write a compressed .npz (atomically: a crash never leaves a half-written file)."""
        path = Path(path)
        meta = dict(self.meta, format=FORMAT_VERSION, vocab_size=self.vocab_size, k=self.k)
        arrays = {"meta": np.array(json.dumps(meta)), "unigram": self.unigram.astype(np.float32)}
        for name, lv in (("bi", self.bigram), ("tri", self.trigram)):
            arrays.update({f"{name}_ctx": lv.ctx, f"{name}_off": lv.off, f"{name}_tok": lv.tok,
                           f"{name}_prob": lv.prob, f"{name}_alpha": lv.alpha})
        with atomic_output(path, parents=True) as tmp, open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)
        return path

    # what np.load raises on a file that is not a whole .npz of plain arrays: not a zip, truncated, a
    # damaged member (bad CRC, bad deflate data, an unknown compression method), a pickled object, a
    # member missing
    _READ_ERRORS = (OSError, ValueError, KeyError, EOFError, NotImplementedError, zipfile.BadZipFile, zlib.error)

    @classmethod
    def load(cls, path: str | os.PathLike) -> KatzTrigram:
        """Load a file written by `save` (a missing, unreadable or inconsistent file is a SpecstackError
        naming it)."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                levels = {name: _Level(z[f"{name}_ctx"], z[f"{name}_off"], z[f"{name}_tok"], z[f"{name}_prob"],
                                       z[f"{name}_alpha"]) for name in ("bi", "tri")}
                unigram = z["unigram"]
        except FileNotFoundError:
            raise SpecstackError(f"n-gram file not found: {path}") from None
        except cls._READ_ERRORS as e:
            raise SpecstackError(f"cannot read n-gram file {path}: {e}") from None
        problem = cls._problem(meta, unigram, levels)
        if problem:
            raise SpecstackError(f"cannot read n-gram file {path}: {problem}")
        unigram = unigram.astype(np.float64)
        unigram /= unigram.sum()
        return cls(meta["vocab_size"], meta["k"], unigram, levels["bi"], levels["tri"], meta)

    @staticmethod
    def _problem(meta: object, unigram: np.ndarray, levels: Mapping[str, _Level]) -> str | None:
        """What makes a loaded file unusable (queries index the arrays by each other), or None."""
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
            found = meta.get("format") if isinstance(meta, dict) else meta
            return f"unsupported format {found!r} (expected {FORMAT_VERSION})"
        V, k = meta.get("vocab_size"), meta.get("k")
        if not (type(V) is int and 1 <= V < 2 ** 21 and type(k) is int and k >= 1):
            return f"its vocab_size and k must be positive integers, got {V!r} and {k!r}"
        if unigram.shape != (V,) or unigram.dtype.kind != "f" or not (np.isfinite(unigram).all()
                                                                     and (unigram >= 0).all() and unigram.sum() > 0):
            return f"the unigram must be {V} finite probabilities, not all 0"
        for name, lv in levels.items():
            arrays = {"ctx": lv.ctx, "off": lv.off, "tok": lv.tok, "prob": lv.prob, "alpha": lv.alpha}
            kinds = {"ctx": "iu", "off": "iu", "tok": "iu", "prob": "f", "alpha": "f"}
            if any(a.ndim != 1 or a.dtype.kind not in kinds[part] for part, a in arrays.items()):
                return f"{name}: every table must be a 1-D array of the right type"
            C, E = len(lv.ctx), len(lv.tok)
            if len(lv.off) != C + 1 or len(lv.alpha) != C or len(lv.prob) != E:
                return f"{name}: table lengths disagree ({C} contexts, {len(lv.off)} offsets, {E} tokens)"
            if lv.off[0] != 0 or lv.off[-1] != E or (np.diff(lv.off) < 0).any():
                return f"{name}: offsets must rise from 0 to the {E} entries"
            if E and (int(lv.tok.min()) < 0 or int(lv.tok.max()) >= V):
                return f"{name}: token ids must be in [0, {V})"
        return None

    def check_vocab(self, vocab_size: int) -> None:
        """A trigram for another tokenizer would propose foreign (or out-of-range) token ids."""
        if self.vocab_size != vocab_size:
            name = self.meta.get("model_name", "another model")
            raise SpecstackError(f"the n-gram model covers {self.vocab_size} tokens ({name}), "
                                 f"the target {vocab_size}: train one with its tokenizer")

    # ---- queries --------------------------------------------------------------------------------
    def _entry(self, level: _Level, rows: dict[int, int], cache: dict[int, _Entry], key: int) -> _Entry | None:
        e = cache.get(key)
        if e is not None:
            return e
        row = rows.get(key)
        if row is None:
            return None
        a, b = int(level.off[row]), int(level.off[row + 1])
        toks = level.tok[a:b].tolist()
        probs = level.prob[a:b].astype(np.float64).tolist()
        if len(cache) >= self._CACHE_LIMIT:
            cache.clear()  # rare; the warm contexts come back on first use
        e = cache[key] = _Entry(toks, probs, dict(zip(toks, probs, strict=True)), float(level.alpha[row]))
        return e

    def _entries(self, context: Sequence[int]) -> tuple[_Entry | None, _Entry | None]:
        """(trigram entry of (u, v), bigram entry of v) for the last two tokens of the context."""
        V = self.vocab_size
        tri = bi = None
        if len(context) >= 1:
            v = int(context[-1])
            if 0 <= v < V:
                bi = self._entry(self.bigram, self._bi_row, self._bi_cache, v)
                if len(context) >= 2:
                    u = int(context[-2])
                    if 0 <= u < V:
                        tri = self._entry(self.trigram, self._tri_row, self._tri_cache, u * V + v)
        return tri, bi

    def prob(self, w: int, context: Sequence[int]) -> float:
        """P(w | the last two tokens of context)."""
        if not 0 <= w < self.vocab_size:
            return 0.0
        tri, bi = self._entries(context)
        scale = 1.0
        if tri is not None:
            p = tri.seen.get(w)
            if p is not None:
                return p
            scale = tri.alpha
        if bi is not None:
            p = bi.seen.get(w)
            if p is not None:
                return scale * p
            scale *= bi.alpha
        return scale * self._uni_list[w]

    def backoff_weight(self, context: Sequence[int]) -> float:
        """α of the longest context (the last two tokens, or the last one if only one): 1 if unseen."""
        tri, bi = self._entries(context)
        e = tri if len(context) >= 2 else bi
        return 1.0 if e is None else e.alpha

    def distribution(self, context: Sequence[int]) -> torch.Tensor:
        """P(. | context) as a float32 tensor [V] summing to 1."""
        V = self.vocab_size
        tri_row = bi_row = None
        if len(context) >= 1 and 0 <= int(context[-1]) < V:
            v = int(context[-1])
            bi_row = self._bi_row.get(v)
            if len(context) >= 2 and 0 <= int(context[-2]) < V:
                tri_row = self._tri_row.get(int(context[-2]) * V + v)
        a3 = 1.0 if tri_row is None else float(self.trigram.alpha[tri_row])
        a2 = 1.0 if bi_row is None else float(self.bigram.alpha[bi_row])
        d = self.unigram * (a3 * a2)
        for lv, row, scale in ((self.bigram, bi_row, a3), (self.trigram, tri_row, 1.0)):
            if row is not None:
                a, b = lv.off[row], lv.off[row + 1]
                d[lv.tok[a:b].astype(np.int64)] = scale * lv.prob[a:b].astype(np.float64)
        return torch.from_numpy(d.astype(np.float32))

    def top(self, context: Sequence[int], n: int) -> list[tuple[int, float]]:
        """The n most likely next tokens with their probabilities, in the order of `distribution`
        (probability descending, ties by token id): a merge of three already-sorted streams — the
        seen continuations of (u, v), then of v scaled by α(uv), then the unigram scaled by
        α(uv)·α(v) — each skipping the tokens a higher level already covers."""
        if n <= 0:
            return []
        tri, bi = self._entries(context)
        a3 = 1.0 if tri is None else tri.alpha
        a2 = 1.0 if bi is None else bi.alpha
        skip3 = tri.seen if tri is not None else {}
        skip2 = bi.seen if bi is not None else {}
        uni = self._uni_list

        def stream_tri():
            if tri is not None:
                yield from zip(tri.toks, tri.probs, strict=True)

        def stream_bi():
            if bi is not None and a3 > 0:
                for t, p in zip(bi.toks, bi.probs, strict=True):
                    if t not in skip3:
                        yield t, a3 * p

        def stream_uni():
            s = a3 * a2
            if s > 0:
                for t in self._uni_order:
                    if t not in skip3 and t not in skip2:
                        yield t, s * uni[t]

        out: list[tuple[int, float]] = []
        merged = heapq.merge(stream_tri(), stream_bi(), stream_uni(), key=lambda tp: (-tp[1], tp[0]))
        for t, p in merged:
            out.append((t, p))
            if len(out) >= n:
                break
        return out



