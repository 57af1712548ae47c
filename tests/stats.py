"""Chi-square helpers shared by the exactness tests (import as ``from stats import ...``).

The tests in this repository prove distributional claims ("the emitted tokens are distributed as
p") with Pearson chi-square goodness-of-fit tests at a fixed significance level ``alpha = 1e-6``
(critical value ``scipy.stats.chi2.isf(1e-6, df)``) and fixed seeds, so a correct sampler fails with
probability 1e-6 per test (i.e. never, given the seeds), and a biased one fails as soon as the sample
is large enough to see the bias. Use a few hundred thousand draws or more; the helpers pool sparse
bins so that the chi-square approximation holds.

Main entry points:

* ``chisquare_gof(counts, probs, alpha=1e-6, label=...)``: asserts that ``counts`` (observed
  histogram) is consistent with ``probs`` (expected distribution; need not be normalised). Any
  observation in a bin of probability exactly 0 fails immediately (with the offending bins named).
  Bins with expected count below ``min_expected`` (5) are pooled, smallest first, into groups of at
  least ``min_expected``. Returns a :class:`ChiSquareResult`; with ``check=False`` it only reports, which
  is how negative controls show that a biased sampler *is* caught.
* ``counts_of(samples, num_bins)``: histogram of integer samples (negative / out-of-range ids are an
  error, reported clearly).
"""
from __future__ import annotations

import dataclasses

import numpy as np
from scipy import stats as _sps

__all__ = ["ChiSquareResult", "chisquare_gof", "counts_of", "ALPHA"]

ALPHA = 1e-6


@dataclasses.dataclass(frozen=True)
class ChiSquareResult:
    statistic: float
    df: int
    critical: float  # chi2.isf(alpha, df)
    pvalue: float
    n: int  # number of observations
    impossible: int  # observations in bins of probability 0
    passed: bool

    def __str__(self):
        return (
            f"chi2={self.statistic:.2f} df={self.df} critical={self.critical:.2f} "
            f"p={self.pvalue:.3g} n={self.n} impossible={self.impossible}"
        )


def counts_of(samples, num_bins: int) -> np.ndarray:
    """``np.bincount`` of integer samples with a clear error for ids outside ``[0, num_bins)``."""
    s = np.asarray(samples).ravel().astype(np.int64)
    bad = (s < 0) | (s >= num_bins)
    if bad.any():
        raise AssertionError(
            f"{int(bad.sum())} samples outside [0, {num_bins}): e.g. {np.unique(s[bad])[:10].tolist()}"
        )
    return np.bincount(s, minlength=num_bins).astype(np.float64)


def _pool(observed: np.ndarray, expected: np.ndarray, min_expected: float):
    """Pool bins with expected < min_expected (sorted by expected) into groups >= min_expected."""
    big = expected >= min_expected
    obs, exp = list(observed[big]), list(expected[big])
    small = np.flatnonzero(~big)
    small = small[np.argsort(expected[small], kind="stable")]
    acc_o = acc_e = 0.0
    for i in small:
        acc_o += observed[i]
        acc_e += expected[i]
        if acc_e >= min_expected:
            obs.append(acc_o)
            exp.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0.0 or acc_o > 0.0:  # leftover: merge into the smallest group (or keep if alone)
        if exp:
            j = int(np.argmin(exp))
            obs[j] += acc_o
            exp[j] += acc_e
        else:
            obs.append(acc_o)
            exp.append(acc_e)
    return np.asarray(obs), np.asarray(exp)


def chisquare_gof(
    counts,
    probs,
    alpha: float = ALPHA,
    *,
    min_expected: float = 5.0,
    label: str = "",
    check: bool = True,
) -> ChiSquareResult:
    """Pearson chi-square goodness of fit of ``counts`` against ``probs`` at level ``alpha``.

    Args:
      counts: observed counts per bin (any shape; flattened).
      probs: expected probabilities per bin, same size, non-negative (renormalised here).
      alpha: significance level; the test fails when the statistic exceeds ``chi2.isf(alpha, df)``.
      min_expected: bins with smaller expected counts are pooled.
      label: prefix for the assertion message.
      check: raise ``AssertionError`` on failure (default); ``False`` only returns the result.
    """
    obs = np.asarray(counts, np.float64).ravel()
    p = np.asarray(probs, np.float64).ravel()
    if obs.shape != p.shape:
        raise ValueError(f"counts {obs.shape} and probs {p.shape} differ in size")
    if (p < 0).any() or not np.isfinite(p).all() or p.sum() <= 0:
        raise ValueError("probs must be finite, non-negative and not all zero")
    p = p / p.sum()
    n = float(obs.sum())
    zero = p <= 0.0
    impossible = int(obs[zero].sum())
    exp = n * p
    o2, e2 = _pool(obs[~zero], exp[~zero], min_expected)
    df = max(len(o2) - 1, 0)
    if df == 0:
        statistic, critical, pvalue = 0.0, 0.0, 1.0
    else:
        statistic = float(np.sum((o2 - e2) ** 2 / e2))
        critical = float(_sps.chi2.isf(alpha, df))
        pvalue = float(_sps.chi2.sf(statistic, df))
    passed = impossible == 0 and statistic <= critical
    res = ChiSquareResult(statistic, df, critical, pvalue, int(n), impossible, passed)
    if check and not passed:
        msg = f"{label + ': ' if label else ''}chi-square goodness of fit rejected at alpha={alpha:g}: {res}"
        if impossible:
            bins = np.flatnonzero(zero & (obs > 0))[:10].tolist()
            msg += f"; observations in zero-probability bins {bins}"
        else:
            worst = np.argsort(-np.abs(obs - exp) / np.sqrt(np.maximum(exp, 1e-12)))[:5]
            msg += "; largest deviations (bin: observed vs expected) " + ", ".join(
                f"{int(i)}: {obs[i]:.0f} vs {exp[i]:.1f}" for i in worst
            )
        raise AssertionError(msg)
    return res
