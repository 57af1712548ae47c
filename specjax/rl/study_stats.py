"""Statistics of the RL study: cluster-robust standard errors, the entropy-acceptance slope and
Bebop's eq. 16 decomposition of an acceptance change. Pure functions of numpy arrays.

Tokens of one sequence are correlated (one prompt, one stretch of text, shared draft chains), so a
per-token mean's error is computed with the sequence as the cluster (:func:`clustered_ratio`, from
:mod:`specjax.stats`, which states the estimator).
"""
from __future__ import annotations

import numpy as np

from specjax.stats import clustered_ratio  # noqa: F401  (re-exported: the study's s.e.)

__all__ = ["clustered_ratio", "ols_slope", "decompose_delta_alpha", "mean_se", "seed_mean_se",
           "pooled_exactness_gap", "Z_1E6", "MIN_STEPS_FOR_VERDICT"]

# two-sided normal quantile at the 1e-6 level (the project's threshold for exactness tests)
Z_1E6 = 4.891638
# steps below which a z from their spread is not compared with a normal quantile: the s.e. is
# estimated, so z has Student's t tails, which put 3e-5 beyond 4.89 at 30 steps, 4e-6 at 100
# and 1.5e-6 at 400 (the level nears 1e-6 as steps grow; with 5 steps it would be 8e-3)
MIN_STEPS_FOR_VERDICT = 30


def mean_se(values) -> tuple[float, float]:
    """``(mean, s.e. of the mean)`` across independent runs (seeds); s.e. nan for one value."""
    v = np.asarray([x for x in values if x is not None], np.float64)
    if v.size == 0:
        return float("nan"), float("nan")
    se = float(v.std(ddof=1) / np.sqrt(v.size)) if v.size > 1 else float("nan")
    return float(v.mean()), se


def seed_mean_se(per_seed, *, floor_label: str = "evaluation floor",
                 one_seed_label: str = "held-out problems (one seed)") -> tuple[float, float, str]:
    """``(mean, s.e., what the s.e. is)`` of per-seed estimates that each carry their own error.

    ``per_seed``: ``[(estimate, s.e.), ...]``, one per training seed, each s.e. the evaluation's
    noise inside that seed (e.g. over held-out problems). The mean's variance is (training noise +
    evaluation noise) / n, so it is at least ``sum(se_i**2) / n**2``, known precisely from many
    problems, while the spread of a few seeds estimates the total with n - 1 degrees of freedom
    and can fall far below it by chance. The s.e. is the larger of the two:
    ``"seeds"`` (the spread over seeds), ``floor_label`` (the seeds agreed more closely than
    their evaluation noise allows) or, for one seed, ``one_seed_label``. Name the labels after
    what each seed's s.e. measures (say ``"trend-fit floor"`` when it is a fitted slope's s.e.).
    """
    est = np.asarray([e for e, _ in per_seed], np.float64)
    se = np.asarray([s for _, s in per_seed], np.float64)
    if est.size == 0:
        raise ValueError("no per-seed estimates")
    if est.size == 1:
        return float(est[0]), float(se[0]), one_seed_label
    spread = est.std(ddof=1) / np.sqrt(est.size)
    floor = np.sqrt(np.sum(se ** 2)) / est.size
    return (float(est.mean()), float(max(spread, floor)),
            "seeds" if spread >= floor else floor_label)


def ols_slope(x, y) -> tuple[float, float]:
    """``(slope, s.e.)`` of the least-squares line ``y ≈ a + b x`` (s.e. nan below 3 points or
    for constant ``x``)."""
    x = np.asarray(x, np.float64).ravel()
    y = np.asarray(y, np.float64).ravel()
    if x.shape != y.shape or x.size < 2:
        raise ValueError(f"need >= 2 paired points, got {x.shape}, {y.shape}")
    sxx = np.sum((x - x.mean()) ** 2)
    if sxx == 0:
        return float("nan"), float("nan")
    b = np.sum((x - x.mean()) * (y - y.mean())) / sxx
    if x.size < 3:
        return float(b), float("nan")
    resid = y - (y.mean() + b * (x - x.mean()))
    return float(b), float(np.sqrt(np.sum(resid ** 2) / (x.size - 2) / sxx))


def decompose_delta_alpha(alpha, entropy, slope: float) -> dict:
    """Bebop eq. 16: ``Δα_t = b (H_t − H_0) + [Δα_t − b (H_t − H_0)]``.

    Args:
      alpha: ``[S]`` acceptance per RL step (step 0 first).
      entropy: ``[S]`` policy entropy per step.
      slope: ``b``, the entropy-acceptance slope (from the run's early phase).
    Returns:
      ``{"total", "entropy", "mismatch"}``, each ``[S]`` lists; ``entropy + mismatch == total``.
    """
    a = np.asarray(alpha, np.float64).ravel()
    h = np.asarray(entropy, np.float64).ravel()
    if a.shape != h.shape or a.size == 0:
        raise ValueError(f"alpha and entropy must be equal non-empty [S], got {a.shape}, {h.shape}")
    total = a - a[0]
    ent = slope * (h - h[0]) if np.isfinite(slope) else np.zeros_like(h)
    return {"total": total.tolist(), "entropy": ent.tolist(), "mismatch": (total - ent).tolist()}


def pooled_exactness_gap(gaps) -> dict | None:
    """The exactness monitor of a run's rollouts, pooled (nats per token).

    Args:
      gaps: ``[S]`` each rollout's ``exactness_gap`` (the mean of ``log p(x_t) + H_t`` over its
        tokens, :func:`specjax.rl.scoring.exactness_gap`), one per RL step; None entries (a
        rollout without tokens) are left out.
    Returns:
      ``{"gap_nats": [mean, s.e.], "z", "steps", "holds"}``, or None below two values. Each
      step's value has mean 0 given everything before it when the rollouts are exact samples of
      the policy, so the steps are uncorrelated and the s.e. is their spread over
      ``sqrt(steps)``. ``holds``: ``|z|`` below :data:`Z_1E6`; None below
      :data:`MIN_STEPS_FOR_VERDICT` steps, where a spread of a few values makes ``z`` far
      heavier-tailed than a normal. A non-finite gap (``-inf``: a token the policy cannot
      produce) gives ``holds`` False, whatever the number of steps.
    """
    v = [float(g) for g in gaps if g is not None]
    if len(v) < 2:
        return None
    if not np.all(np.isfinite(v)):  # no spread to speak of: a loud verdict, not a warning
        m = float("-inf") if np.any(np.isneginf(v)) else float("nan")
        return {"gap_nats": [m, float("nan")], "z": m, "steps": len(v), "holds": False}
    m, se = mean_se(v)
    z = m / se if se > 0 else float("nan")
    holds = bool(abs(z) < Z_1E6) if len(v) >= MIN_STEPS_FOR_VERDICT else None
    return {"gap_nats": [m, se], "z": z, "steps": len(v), "holds": holds}
