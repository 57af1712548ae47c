"""Statistics of speculation runs (host side, numpy): acceptance per position, τ, predicted E[τ],
entropy slopes, from per-step records.

A :class:`StepRecords` holds the raw outcomes of many speculative steps (e.g. those of
:func:`specjax.evaluation.evaluate_drafter`): per step ``num_accepted`` and, for each draft
position k, the analytic acceptance probability of that draft *given its drafted prefix*
(``Σ_v min(p_k, q_k) = 1 − TV(p_k, q_k)`` for rejection sampling, ``p_k(x_k)`` for target-only
and greedy, where ``x_k = argmax q_k`` and ``p_k`` is one-hot under greedy), the target entropy
``H(p_k)`` (of the distribution the verifier uses; for greedy, of the temperature-1 target), and the
drafter's confidences when it has a confidence head.

Metrics (:func:`summarize`):

* ``acceptance[k]`` — P(draft k accepted | drafts < k accepted), the verifier's decisions over the
  steps that reached k; ``alpha[k]`` — mean analytic acceptance probability over the same steps
  (same expectation, lower variance: given the prefix, the decision is Bernoulli(alpha)).
* ``tau`` — mean emitted tokens per step = accepted + 1 (the bonus / correction token included),
  with its standard error; ``accept_rate`` = mean accepted / γ (= 1 − e2e-TV of the chain, Bebop's
  "acceptance rate" of a γ-step MTP). When the records know each step's held-out row (as
  :func:`specjax.evaluation.evaluate_drafter`'s do), these standard errors are clustered by row,
  since the anchors of one row share its context (:mod:`specjax.stats`); the independent-step ones
  are kept as ``tau_se_iid`` / ``accept_rate_se_iid``, and ``per_row`` holds each row's steps and
  accepted drafts, so that paired and pooled errors can be recomputed from the JSON.
* ``tau_pred`` — ``1 + Σ_j Π_{i≤j} alpha_i`` (Bebop eq. 12 + the bonus) from the measured alphas;
  the gap to ``tau`` is the correlation of acceptance across positions within a step (easy contexts
  accept everything), which the product of marginals ignores.
* ``entropy_fit`` — least-squares line ``alpha ≈ a − b·H`` over all (step, position) pairs that were
  verified (Bebop §3, eq. 5 / 9), with the slope's standard error (and ``slope_se_clustered``, by
  row, when rows are known), r and n; ``entropy_bins`` —
  mean acceptance per entropy bin (for the plot).

The helpers are plain numpy (:func:`entropy` also takes jax arrays, for use inside jitted code)
and tested on hand-computable cases (tests/test_evaluation.py). All names are also importable from
:mod:`specjax.evaluation`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.stats import cluster_sums, clustered_ratio, clustered_slope_se

__all__ = ["acceptance_by_position", "mean_accepted_length", "expected_tau", "linear_fit",
           "entropy", "binned_means", "StepRecords", "ENTROPY_EDGES", "summarize"]


def acceptance_by_position(num_accepted, gamma: int, num_draft=None):
    """Conditional acceptance per position.

    Args:
      num_accepted: int ``[N]`` accepted drafts per step.
      gamma: γ (drafts per step).
      num_draft: optional int ``[N]`` drafts verified per step (default γ).
    Returns:
      ``(rate [γ], reached [γ])``: ``rate[k]`` = fraction of steps with draft k+1 accepted among
      the ``reached[k]`` steps that verified it with drafts 1..k accepted (NaN if none).
    """
    a = np.asarray(num_accepted).reshape(-1)
    nd = np.full_like(a, gamma) if num_draft is None else np.asarray(num_draft).reshape(-1)
    rate = np.full(gamma, np.nan)
    reached = np.zeros(gamma, np.int64)
    for k in range(gamma):
        r = (a >= k) & (nd > k)
        reached[k] = int(r.sum())
        if reached[k]:
            rate[k] = float((a[r] > k).mean())
    return rate, reached


def mean_accepted_length(num_accepted) -> tuple[float, float]:
    """``(τ, standard error)``: mean emitted tokens per step, accepted + 1 (bonus included)."""
    a = np.asarray(num_accepted, np.float64).reshape(-1)
    if a.size == 0:
        return float("nan"), float("nan")
    se = float(a.std(ddof=1) / math.sqrt(a.size)) if a.size > 1 else float("nan")
    return float(a.mean() + 1.0), se


def expected_tau(alpha) -> np.ndarray:
    """``1 + Σ_j Π_{i≤j} α_i`` over the last axis (Bebop eq. 12 plus the bonus token)."""
    a = np.asarray(alpha, np.float64)
    return 1.0 + np.cumprod(a, axis=-1).sum(axis=-1)


def linear_fit(x, y, clusters=None) -> dict:
    """Ordinary least squares ``y ≈ intercept + slope·x`` with standard errors.

    Returns ``{"slope", "intercept", "slope_se", "intercept_se", "r", "n"}`` (NaNs when fewer than
    3 points or no spread in x). The slope equals ``numpy.polyfit(x, y, 1)[0]``;
    ``slope_se = sqrt(Σ residual² / (n − 2) / Σ (x − x̄)²)`` treats the points as independent.
    With ``clusters`` (``[N]`` ids, e.g. the held-out row of each point) the result also holds
    ``slope_se_clustered``, the cluster-robust s.e. of :func:`specjax.stats.clustered_slope_se`.
    """
    x = np.asarray(x, np.float64).reshape(-1)
    y = np.asarray(y, np.float64).reshape(-1)
    n = x.size
    out = {"slope": float("nan"), "intercept": float("nan"), "slope_se": float("nan"),
           "intercept_se": float("nan"), "r": float("nan"), "n": int(n)}
    if clusters is not None:
        out["slope_se_clustered"] = clustered_slope_se(x, y, clusters)
    if n < 3:
        return out
    xm, ym = x.mean(), y.mean()
    sxx = float(((x - xm) ** 2).sum())
    if sxx <= 0:
        return out
    sxy = float(((x - xm) * (y - ym)).sum())
    slope = sxy / sxx
    intercept = ym - slope * xm
    resid = y - (intercept + slope * x)
    s2 = float((resid ** 2).sum()) / (n - 2)
    syy = float(((y - ym) ** 2).sum())
    out.update(slope=slope, intercept=float(intercept), slope_se=math.sqrt(s2 / sxx),
               intercept_se=math.sqrt(s2 * (1.0 / n + xm * xm / sxx)),
               r=sxy / math.sqrt(sxx * syy) if syy > 0 else float("nan"))
    return out


def entropy(probs, axis: int = -1):
    """Shannon entropy in nats, ``−Σ p log p`` (``0 log 0 = 0``); numpy or jax arrays."""
    xp = jnp if isinstance(probs, jax.Array) else np
    p = probs
    logp = xp.log(xp.where(p > 0, p, 1.0))
    return -(p * logp).sum(axis=axis)


def binned_means(x, y, edges) -> dict:
    """Mean of ``y`` per bin of ``x`` (``edges`` increasing; ``edges[b] ≤ x < edges[b+1]``).

    Returns ``{"center", "mean", "se", "n"}`` lists (NaN for empty bins)."""
    x = np.asarray(x, np.float64).reshape(-1)
    y = np.asarray(y, np.float64).reshape(-1)
    edges = np.asarray(edges, np.float64)
    idx = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, len(edges) - 2)
    inside = (x >= edges[0]) & (x <= edges[-1])
    out = {"center": ((edges[:-1] + edges[1:]) / 2).tolist(), "mean": [], "se": [], "n": []}
    for b in range(len(edges) - 1):
        sel = inside & (idx == b)
        n = int(sel.sum())
        out["n"].append(n)
        out["mean"].append(float(y[sel].mean()) if n else float("nan"))
        out["se"].append(float(y[sel].std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan"))
    return out


@dataclasses.dataclass
class StepRecords:
    """Raw per-step outcomes of one (drafter, rule, temperature, domain) evaluation.

    num_accepted: int ``[N]``; accept_prob, tv, entropy, entropy_raw: float ``[N, γ]`` (analytic
    acceptance probability of each draft given its drafted prefix, TV(p_k, q_k), entropy of the
    verifier's p_k and of the temperature-1 target); confidences: ``[N, γ]`` or None; row: int
    ``[N]``, the held-out row each step's anchor came from (the cluster for standard errors:
    anchors of one row share its context), or None.
    """

    num_accepted: np.ndarray
    accept_prob: np.ndarray
    tv: np.ndarray
    entropy: np.ndarray
    entropy_raw: np.ndarray
    confidences: Optional[np.ndarray] = None
    row: Optional[np.ndarray] = None

    @property
    def gamma(self) -> int:
        return self.accept_prob.shape[1]

    @staticmethod
    def concat(parts: Sequence["StepRecords"], distinct_rows: bool = False) -> "StepRecords":
        """The steps of ``parts`` in order. ``distinct_rows``: the parts come from different row
        sets (e.g. domains), so their row ids are offset to stay distinct clusters; otherwise
        (chunks of one row set) they are kept as they are."""
        conf = None if parts[0].confidences is None else \
            np.concatenate([p.confidences for p in parts])
        row = None
        if all(p.row is not None for p in parts):
            rows, offset = [], 0
            for p in parts:
                rows.append(np.asarray(p.row, np.int64) + offset)
                if distinct_rows and p.row.size:
                    offset = int(rows[-1].max()) + 1
            row = np.concatenate(rows)
        return StepRecords(*(np.concatenate([getattr(p, f) for p in parts])
                             for f in ("num_accepted", "accept_prob", "tv", "entropy",
                                       "entropy_raw")), confidences=conf, row=row)

    def reached(self) -> np.ndarray:
        """bool ``[N, γ]``: draft k was verified with drafts < k accepted."""
        return np.arange(self.gamma)[None, :] <= self.num_accepted[:, None]

    def accepted(self) -> np.ndarray:
        """bool ``[N, γ]`` verifier decisions (entries after the first rejection are False and
        meaningless; see :mod:`specjax.calibration`)."""
        return np.arange(self.gamma)[None, :] < self.num_accepted[:, None]


ENTROPY_EDGES = np.linspace(0.0, 6.0, 13)


def summarize(rec: StepRecords, *, entropy_edges=ENTROPY_EDGES, raw_entropy: bool = False) -> dict:
    """The metrics of the module docstring for one evaluation cell (JSON-ready floats/lists)."""
    g = rec.gamma
    acc, reached_n = acceptance_by_position(rec.num_accepted, g)
    reached = rec.reached()
    alpha = np.array([rec.accept_prob[reached[:, k], k].mean() if reached[:, k].any()
                      else np.nan for k in range(g)])
    ent_pos = np.array([rec.entropy[reached[:, k], k].mean() if reached[:, k].any()
                        else np.nan for k in range(g)])
    tau, tau_se = mean_accepted_length(rec.num_accepted)
    n = rec.num_accepted.size
    a = rec.num_accepted.astype(np.float64)
    h = (rec.entropy_raw if raw_entropy else rec.entropy)[reached]
    y = rec.accept_prob[reached]
    y_ind = rec.accepted()[reached].astype(np.float64)
    rate_se = float(a.std(ddof=1) / g / math.sqrt(n)) if n > 1 else float("nan")
    extra, pair_rows = {}, None
    if rec.row is not None and n:
        # anchors of one row share its context: the s.e. are clustered by row, and the per-row
        # sums are kept so that paired and seed-pooled errors can be recomputed from the JSON
        ids, acc_sum, steps = cluster_sums(a, rec.row)
        extra = {"tau_se_iid": tau_se, "accept_rate_se_iid": rate_se, "n_rows": int(ids.size),
                 "per_row": {"row": ids.tolist(), "steps": steps.astype(int).tolist(),
                             "accepted": acc_sum.astype(int).tolist()}}
        tau_se = clustered_ratio(acc_sum, steps)[1]
        rate_se = tau_se / g
        pair_rows = np.broadcast_to(np.asarray(rec.row)[:, None], reached.shape)[reached]
    return {
        "n_steps": int(n),
        "tau": tau, "tau_se": tau_se,
        "accept_rate": float(a.mean() / g) if n else float("nan"),
        "accept_rate_se": rate_se,
        "acceptance": acc.tolist(), "reached": reached_n.tolist(),
        "alpha": alpha.tolist(),
        "tau_pred": float(expected_tau(np.nan_to_num(alpha))),
        "tau_pred_from_rates": float(expected_tau(np.nan_to_num(acc))),
        "alpha_1": float(alpha[0]),
        "tv_1": float(rec.tv[:, 0].mean()) if n else float("nan"),
        "entropy": ent_pos.tolist(),
        "entropy_mean": float(h.mean()) if h.size else float("nan"),
        "entropy_fit": linear_fit(h, y, pair_rows),
        "entropy_fit_indicator": linear_fit(h, y_ind, pair_rows),
        "entropy_bins": binned_means(h, y, entropy_edges),
        **extra,
    }
