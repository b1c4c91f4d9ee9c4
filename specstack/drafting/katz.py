"""draft2's model (Spector & Ré 2023; DESIGN §4 "N-gram model (draft2)"): a Katz backoff trigram with
Good–Turing discounts, trained on a corpus (`specstack ngram train`) and saved as a compact .npz. It is
a proper distribution over the target vocabulary V (every token has mass through the unigram), so it
can also serve as a draft q.

katz_estimate.py holds the formulas and the estimation (a corpus -> flat tables); this module is the
model over those tables: its queries (`prob`, `distribution`, `top`), and its file.
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

from specstack.drafting.katz_estimate import MAX_VOCAB, BackoffLevel, estimate
from specstack.errors import SpecstackError
from specstack.files import atomic_output

FORMAT_VERSION = 1


@dataclass
class _Entry:
    """A context's kept continuations as Python objects (built on first use, then cached)."""
    toks: list[int]
    probs: list[float]
    seen: dict[int, float]
    alpha: float


class KatzTrigram:
    """Katz backoff trigram over token ids 0..V-1 (katz_estimate.py's docstring has the formulas)."""

    _CACHE_LIMIT = 200_000  # cached contexts (Python lists) before the cache is dropped
    _WARM_ENTRIES = 256  # contexts with more continuations than this are materialised at load

    def __init__(self, vocab_size: int, k: int, unigram: np.ndarray, bigram: BackoffLevel, trigram: BackoffLevel,
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
        # materialise the few very common contexts now (a small part of a load), so no proposal pays
        # for them later
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
        t = estimate(token_streams, vocab_size, k, min_count, min_count_bigram)
        return cls(t.vocab_size, t.k, t.unigram, t.bigram, t.trigram, {"format": FORMAT_VERSION, **t.meta})

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
            np.savez_compressed(f, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle
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
                levels = {name: BackoffLevel(z[f"{name}_ctx"], z[f"{name}_off"], z[f"{name}_tok"], z[f"{name}_prob"],
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
    def _problem(meta: object, unigram: np.ndarray, levels: Mapping[str, BackoffLevel]) -> str | None:
        """What makes a loaded file unusable (queries index the arrays by each other), or None."""
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
            found = meta.get("format") if isinstance(meta, dict) else meta
            return f"unsupported format {found!r} (expected {FORMAT_VERSION})"
        V, k = meta.get("vocab_size"), meta.get("k")
        if not (type(V) is int and 1 <= V < MAX_VOCAB and type(k) is int and k >= 1):
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
    def _entry(self, level: BackoffLevel, rows: dict[int, int], cache: dict[int, _Entry], key: int) -> _Entry | None:
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
