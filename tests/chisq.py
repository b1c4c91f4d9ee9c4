"""The goodness-of-fit check shared by the distribution tests (imported via pytest's pythonpath)."""
from __future__ import annotations

import numpy as np
from scipy.stats import chisquare


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Goodness of fit of counts to probs. Cells of probability 0 must be empty; cells expected fewer
    than `min_expected` times are pooled into one cell (the chi-square approximation needs it)."""
    counts, probs = counts.ravel().astype(float), probs.ravel().astype(float)
    assert counts[probs == 0].sum() == 0, "emitted a token sequence of target probability 0"
    n = counts.sum()
    probs = probs / probs.sum()
    expected = n * probs
    big = expected >= min_expected
    small = (~big) & (probs > 0)
    obs = list(counts[big]) + ([counts[small].sum()] if small.any() else [])
    exp = list(expected[big]) + ([expected[small].sum()] if small.any() else [])
    assert len(obs) >= 2
    return float(chisquare(np.array(obs), np.array(exp)).pvalue)
