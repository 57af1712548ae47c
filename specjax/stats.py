"""Cluster-robust standard errors for per-token and per-step means. Pure numpy.

Observations that share a context are correlated: the anchors drawn from one held-out row share
its text, the tokens of one rollout share its prompt. Treating them as independent understates
the error of their mean. Here each observation carries a cluster id (the row, the sequence) and the
errors are the linearised cluster-robust ("CR1") ones:

* a ratio ``r = Σ_g y_g / Σ_g n_g`` over clusters ``g`` (``y_g`` a sum over the cluster's
  observations, ``n_g`` their count) has

      Var(r) ≈ G / (G − 1) · Σ_g (y_g − r n_g)² / (Σ_g n_g)²;

* a least-squares slope ``b`` of ``y ≈ a + b x`` has the sandwich variance

      Var(b) ≈ G / (G − 1) · Σ_g (Σ_{i∈g} (x_i − x̄) e_i)² / Sxx²,

  with ``e_i`` the residuals and ``Sxx = Σ (x_i − x̄)²``.

Both reduce to the usual independent-sample errors (with an ``n / (n − 1)`` factor) when every
cluster holds one observation. Reference: Cameron & Miller, "A Practitioner's Guide to
Cluster-Robust Inference" (J. Human Resources, 2015), eqs. 7 and 11.
"""
from __future__ import annotations

import numpy as np

__all__ = ["cluster_sums", "clustered_ratio", "clustered_mean", "clustered_slope_se"]


def cluster_sums(values, clusters) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-cluster sums and counts.

    Args:
      values: ``[N]`` observations.
      clusters: ``[N]`` integer cluster ids (any values; need not be contiguous).
    Returns:
      ``(ids [G], sums [G], counts [G])`` with ``ids`` sorted.
    """
    v = np.asarray(values, np.float64).ravel()
    c = np.asarray(clusters).ravel()
    if v.shape != c.shape:
        raise ValueError(f"values and clusters differ in shape: {v.shape} vs {c.shape}")
    ids, inv = np.unique(c, return_inverse=True)
    sums = np.bincount(inv, weights=v, minlength=ids.size)
    counts = np.bincount(inv, minlength=ids.size).astype(np.float64)
    return ids, sums, counts


def clustered_ratio(sums, counts) -> tuple[float, float]:
    """``(ratio, clustered s.e.)`` of ``Σ sums / Σ counts``.

    Args:
      sums: ``[G]`` per-cluster sums of the quantity (e.g. accepted drafts of one sequence).
      counts: ``[G]`` per-cluster denominators (e.g. drafts verified), > 0 in total.
    Returns:
      The ratio and its cluster-robust standard error (nan when G < 2).
    """
    y = np.asarray(sums, np.float64).ravel()
    n = np.asarray(counts, np.float64).ravel()
    if y.shape != n.shape:
        raise ValueError(f"sums and counts differ in shape: {y.shape} vs {n.shape}")
    if n.sum() <= 0 or np.any(n < 0):
        raise ValueError("counts must be >= 0 with a positive total")
    r = y.sum() / n.sum()
    g = y.size
    if g < 2:
        return float(r), float("nan")
    var = g / (g - 1) * np.sum((y - r * n) ** 2) / n.sum() ** 2
    return float(r), float(np.sqrt(var))


def clustered_mean(values, clusters) -> tuple[float, float]:
    """``(mean, clustered s.e.)`` of ``values [N]`` with cluster ids ``clusters [N]``."""
    _, s, n = cluster_sums(values, clusters)
    if n.size == 0:
        return float("nan"), float("nan")
    return clustered_ratio(s, n)


def clustered_slope_se(x, y, clusters) -> float:
    """Cluster-robust s.e. of the least-squares slope of ``y ≈ a + b x`` (nan when fewer than two
    clusters, fewer than 3 points or no spread in ``x``).

    Args:
      x, y: ``[N]`` paired observations; clusters: ``[N]`` cluster ids.
    """
    x = np.asarray(x, np.float64).ravel()
    y = np.asarray(y, np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"x and y differ in shape: {x.shape} vs {y.shape}")
    if x.size < 3:
        return float("nan")
    xc = x - x.mean()
    sxx = float(np.sum(xc ** 2))
    if sxx <= 0:
        return float("nan")
    b = float(np.sum(xc * (y - y.mean())) / sxx)
    resid = y - y.mean() - b * xc
    _, score, _ = cluster_sums(xc * resid, clusters)
    g = score.size
    if g < 2:
        return float("nan")
    return float(np.sqrt(g / (g - 1) * np.sum(score ** 2)) / sxx)
