"""Confidence calibration for prefix scheduling: Sequential Temperature Scaling, ECE, AUROC, Brier.

A DSpark confidence head emits, for each draft position k = 1..γ, a logit ``l_k`` whose sigmoid
``c_k = σ(l_k)`` estimates ``P(draft k accepted | drafts 1..k−1 accepted)``. The prefix scheduler
needs the *joint* survival probabilities ``a_k = Π_{i≤k} c_i = P(drafts 1..k all accepted)``
(docs/DESIGN.md "Prefix scheduler"), so that is the quantity calibrated and scored here.

Sequential Temperature Scaling (STS, DSpark §3.2.1): on held-out drafts, for k = 1..γ in order,
a 1-D grid search picks ``T_k > 0`` minimising the ECE of ``a_k = Π_{i≤k} σ(l_i / T_i)`` against
observed survival, with ``T_1..T_{k−1}`` already fixed. Dividing a logit by a positive temperature
is strictly increasing, so the ranking of ``c_k`` across drafts at each position is unchanged and
``a_k`` is unchanged in order among drafts with the same calibrated prefix product ``a_{k−1}``.
(Across drafts with *different* prefixes the order of ``a_k`` can change when the ``T_i`` differ;
that is inherent to per-position temperatures, not a defect.)

Data conventions (host-side numpy; this is offline analysis):

* ``confidence_logits``: float ``[N, γ]``, one row per verified draft block.
* ``accepted``: bool ``[N, γ]``; ``accepted[n, k]`` is the verifier's decision on draft k *given
  that drafts 1..k−1 were accepted*. Entries after the first rejection were never verified; they
  are ignored whatever they hold.
* ``num_verified``: optional int ``[N]`` (default γ): how many drafts of block n were sent to the
  verifier (a scheduler may verify fewer than γ). Entries beyond it are ignored too.

Which samples enter position k (0-based index ``k−1`` in the arrays):

* **Survival / joint metrics** (the STS objective, :func:`position_metrics` ``ece`` / ``brier``
  / ``auroc``): every block whose survival to k is *known*: either k ≤ num_verified[n], or the
  block was already rejected at some verified position j < k (then it certainly did not survive
  to k). Label ``survived[n, k] = accepted[n, 1] ∧ … ∧ accepted[n, k]``; prediction ``a_k``.
  A block rejected at position 1 therefore is a negative at *every* position. Blocks whose
  verified drafts were all accepted but that were verified to fewer than k drafts are left out.
* **Conditional metrics** (``*_cond`` in :func:`position_metrics`): blocks with k ≤
  num_verified[n] whose drafts 1..k−1 were all accepted; label ``accepted[n, k]``; prediction
  ``c_k``. This scores the head's stated meaning (a conditional acceptance probability).

ECE uses ``n_bins`` equal-width bins on [0, 1] (bin b holds ``b/B ≤ x < (b+1)/B``, the last
bin also holds 1.0) and is ``Σ_b (n_b / n) |mean pred_b − mean label_b|`` over non-empty bins.

References: DSpark (DeepSeek) §3.2.1 (confidence head, STS) and Fig. 6 (reliability diagrams);
Guo, Pleiss, Sun, Weinberger, "On Calibration of Modern Neural Networks" (ICML 2017, temperature
scaling, ECE); Naeini, Cooper, Hauskrecht (AAAI 2015, ECE); Hanley & McNeil (Radiology 1982,
AUROC = Mann–Whitney U); Brier (Monthly Weather Review 1950).

Reliability diagrams of these quantities: :mod:`specjax.calibration_plot`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

__all__ = [
    "DEFAULT_N_BINS",
    "DEFAULT_TEMPERATURE_GRID",
    "sigmoid",
    "survival",
    "reliability_bins",
    "expected_calibration_error",
    "brier_score",
    "auroc",
    "apply_temperatures",
    "SequentialTemperatureScaling",
    "sequential_temperature_scaling",
    "position_metrics",
]

DEFAULT_N_BINS = 15
# Log-symmetric around 1 (0.05 .. 20, 401 points: ratio ~1.5% between neighbours, T = 1 included).
DEFAULT_TEMPERATURE_GRID = np.geomspace(0.05, 20.0, 401)


def logit(p, eps: float = 1e-7) -> np.ndarray:
    """``log(p / (1 − p))`` of probabilities clipped to ``[eps, 1 − eps]`` (confidences as the
    confidence-head logits the calibration functions take), in ``p``'s dtype."""
    p = np.clip(p, eps, 1 - eps)
    return np.log(p) - np.log1p(-p)


def sigmoid(x) -> np.ndarray:
    """Numerically stable logistic function (``0.5·(1 + tanh(x/2))``, no overflow for large |x|)."""
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _check_blocks(confidence_logits, accepted, num_verified=None):
    logits = np.asarray(confidence_logits, dtype=np.float64)
    acc = np.asarray(accepted)
    if logits.ndim != 2:
        raise ValueError(f"confidence_logits must be [N, γ], got shape {logits.shape}")
    if acc.shape != logits.shape:
        raise ValueError(f"accepted {acc.shape} must have the shape of confidence_logits "
                         f"{logits.shape}")
    if acc.dtype != np.bool_:
        raise TypeError(f"accepted must be a boolean array, got dtype {acc.dtype}")
    if np.isnan(logits).any():
        raise ValueError("confidence_logits contains NaN")
    return logits, acc


def survival(accepted, num_verified=None) -> tuple[np.ndarray, np.ndarray]:
    """Prefix survival labels and which of them are observed.

    Args:
      accepted: bool ``[N, γ]`` per-position verifier decisions (see module docstring).
      num_verified: optional int ``[N]`` in ``[0, γ]``; default γ for every block.

    Returns:
      ``(survived, observed)``, both bool ``[N, γ]``: ``survived[n, k]`` is true iff drafts 1..k of
      block n were all accepted; ``observed[n, k]`` says whether that is known (module docstring).
    """
    acc = np.asarray(accepted)
    if acc.ndim != 2 or acc.dtype != np.bool_:
        raise ValueError(f"accepted must be a bool [N, γ] array, got {acc.dtype} {acc.shape}")
    n, gamma = acc.shape
    k = np.arange(1, gamma + 1)[None, :]
    if num_verified is None:
        verified = np.ones((n, gamma), dtype=bool)
    else:
        nv = np.asarray(num_verified)
        if nv.shape != (n,) or not np.issubdtype(nv.dtype, np.integer):
            raise ValueError(f"num_verified must be an int [N={n}] array, "
                             f"got {nv.dtype} {nv.shape}")
        if (nv < 0).any() or (nv > gamma).any():
            raise ValueError(f"num_verified must lie in [0, γ={gamma}]")
        verified = k <= nv[:, None]
    # Unverified entries count as "accepted" for the running AND so they never fake a rejection;
    # whether survival there is known is decided by `observed`.
    survived = np.logical_and.accumulate(acc | ~verified, axis=1)
    rejected_before = np.concatenate([np.zeros((n, 1), bool), ~survived[:, :-1]], axis=1)
    observed = verified | rejected_before
    return survived & observed, observed


def _bin_index(probs: np.ndarray, n_bins: int) -> np.ndarray:
    return np.clip((probs * n_bins).astype(np.int64), 0, n_bins - 1)


def _flat_masked(probs, labels, where):
    p = np.asarray(probs, dtype=np.float64).ravel()
    y = np.asarray(labels).ravel().astype(np.float64)
    if p.shape != y.shape:
        raise ValueError(f"predictions {np.shape(probs)} and labels {np.shape(labels)} "
                         "differ in shape")
    if where is not None:
        w = np.broadcast_to(np.asarray(where, dtype=bool), np.shape(probs)).ravel()
        p, y = p[w], y[w]
    return p, y


def reliability_bins(probs, labels, *, n_bins: int = DEFAULT_N_BINS, where=None):
    """Equal-width reliability bins.

    Args:
      probs: predicted probabilities in [0, 1], any shape.
      labels: same shape, bool / {0, 1} (or soft labels in [0, 1]).
      n_bins: number of equal-width bins on [0, 1].
      where: optional bool mask (broadcastable to ``probs``) of the samples to use.

    Returns:
      ``(counts, mean_pred, mean_label)``, each ``[n_bins]``; empty bins have NaN means.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    p, y = _flat_masked(probs, labels, where)
    if ((p < 0) | (p > 1)).any():
        raise ValueError("probabilities must lie in [0, 1]")
    b = _bin_index(p, n_bins)
    counts = np.bincount(b, minlength=n_bins).astype(np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_pred = np.bincount(b, weights=p, minlength=n_bins) / counts
        mean_label = np.bincount(b, weights=y, minlength=n_bins) / counts
    return counts, mean_pred, mean_label


def expected_calibration_error(probs, labels, *, n_bins: int = DEFAULT_N_BINS, where=None) -> float:
    """ECE with equal-width bins: ``Σ_b (n_b/n) |mean pred_b − mean label_b|`` (NaN if n = 0).

    Args as :func:`reliability_bins`. References: Naeini et al. 2015; Guo et al. 2017, eq. 3.
    """
    counts, mp, ml = reliability_bins(probs, labels, n_bins=n_bins, where=where)
    total = counts.sum()
    if total == 0:
        return float("nan")
    nz = counts > 0
    return float(np.sum(counts[nz] * np.abs(mp[nz] - ml[nz])) / total)


def brier_score(probs, labels, *, where=None) -> float:
    """Mean squared error between predicted probabilities and {0, 1} outcomes (NaN if empty)."""
    p, y = _flat_masked(probs, labels, where)
    return float(np.mean((p - y) ** 2)) if p.size else float("nan")


def auroc(scores, labels, *, where=None) -> float:
    """Area under the ROC curve, rank-based (Mann–Whitney U), ties counted as ½.

    ``AUROC = P(score of a random positive > score of a random negative) + ½ P(equal)``,
    computed from average ranks in O(n log n). NaN when there are no positives or no negatives.

    Args:
      scores: real-valued scores, any shape (any monotone transform gives the same AUROC).
      labels: same shape, bool / {0, 1}.
      where: optional bool mask of the samples to use.
    """
    s, y = _flat_masked(scores, labels, where)
    pos = y > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    # Average 1-based rank of each distinct value: ties share the mean of the ranks they span.
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0
    ranks = avg_rank[inverse.ravel()]
    u = ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def apply_temperatures(confidence_logits, temperatures):
    """Calibrated conditional confidences ``c_k = σ(l_k / T_k)``.

    Args:
      confidence_logits: ``[..., γ]`` logits; a ``jax.Array`` gives a ``jax.Array`` (usable inside
        a jitted engine step), anything else gives a numpy float64 array.
      temperatures: ``[γ]`` positive temperatures.

    Returns:
      ``[..., γ]`` confidences in (0, 1); take ``cumprod`` along the last axis for survival ``a_k``.
    """
    t = np.asarray(temperatures, dtype=np.float64)
    if t.ndim != 1 or (t <= 0).any() or not np.isfinite(t).all():
        raise ValueError(f"temperatures must be a 1-D array of finite positive values, got {t}")
    if np.shape(confidence_logits)[-1:] != t.shape:
        raise ValueError(f"confidence_logits {np.shape(confidence_logits)} must end in "
                         f"γ = {t.size}")
    try:
        import jax
        if isinstance(confidence_logits, jax.Array):
            import jax.numpy as jnp
            x = confidence_logits
            return jax.nn.sigmoid(x / jnp.asarray(t, x.dtype))
    except ImportError:  # pragma: no cover - jax is a hard dependency of the package
        pass
    return sigmoid(np.asarray(confidence_logits, dtype=np.float64) / t)


@dataclasses.dataclass(frozen=True)
class SequentialTemperatureScaling:
    """Result of :func:`sequential_temperature_scaling`.

    Attributes:
      temperatures: ``[γ]`` fitted ``T_k > 0``.
      ece_before: ``[γ]`` ECE of the raw cumulative products on the fitting set.
      ece_after: ``[γ]`` ECE of the calibrated cumulative products on the fitting set.
      n_bins: bins used for the ECE.
    """

    temperatures: np.ndarray
    ece_before: np.ndarray
    ece_after: np.ndarray
    n_bins: int

    def apply(self, confidence_logits):
        """Calibrated conditional confidences ``σ(l_k / T_k)``, ``[..., γ]`` (see
        :func:`apply_temperatures`); feed these to ``scheduling.prefix_schedule``."""
        return apply_temperatures(confidence_logits, self.temperatures)


def sequential_temperature_scaling(
    confidence_logits,
    accepted,
    *,
    num_verified=None,
    n_bins: int = DEFAULT_N_BINS,
    grid: Optional[Sequence[float]] = None,
) -> SequentialTemperatureScaling:
    """Fit Sequential Temperature Scaling (DSpark §3.2.1) on held-out drafts.

    For k = 1..γ in order: for every ``T`` in ``grid``, form
    ``a_k(T) = a_{k−1} · σ(l_k / T)`` with the already-calibrated ``a_{k−1}`` (``a_0 = 1``) and
    compute its ECE against ``survived[:, k]`` over the blocks whose survival to k is observed
    (see the module docstring for exactly which); keep the minimiser. Exact ties in ECE go to
    the temperature closest to 1 (smallest ``|log T|``). A position with no observed block keeps
    ``T_k = 1``.

    Args:
      confidence_logits: float ``[N, γ]`` held-out confidence-head logits.
      accepted: bool ``[N, γ]`` verifier decisions.
      num_verified: optional int ``[N]`` drafts verified per block (default γ).
      n_bins: equal-width ECE bins.
      grid: candidate temperatures (all finite and > 0); default ``DEFAULT_TEMPERATURE_GRID``
        (0.05..20, log-spaced, 401 points including 1).

    Returns:
      :class:`SequentialTemperatureScaling` with ``temperatures`` and ``apply``.
    """
    logits, acc = _check_blocks(confidence_logits, accepted)
    survived, observed = survival(acc, num_verified)
    g = np.asarray(DEFAULT_TEMPERATURE_GRID if grid is None else grid, dtype=np.float64).ravel()
    if g.size == 0 or (g <= 0).any() or not np.isfinite(g).all():
        raise ValueError("grid must be a non-empty sequence of finite positive temperatures")
    # Visit candidates closest to T = 1 first so that argmin's first-minimum rule breaks ties there.
    g = g[np.argsort(np.abs(np.log(g)), kind="stable")]
    n, gamma = logits.shape
    temps = np.ones(gamma)
    ece_before = np.full(gamma, np.nan)
    ece_after = np.full(gamma, np.nan)
    a_raw = np.cumprod(sigmoid(logits), axis=1)
    a_prev = np.ones(n)
    for k in range(gamma):
        obs = observed[:, k]
        y = survived[obs, k]
        if obs.any():
            ece_before[k] = expected_calibration_error(a_raw[obs, k], y, n_bins=n_bins)
            prev, lk = a_prev[obs], logits[obs, k]
            eces = np.array([expected_calibration_error(prev * sigmoid(lk / t), y, n_bins=n_bins)
                             for t in g])
            best = int(np.argmin(eces))
            temps[k] = g[best]
            ece_after[k] = eces[best]
        a_prev = a_prev * sigmoid(logits[:, k] / temps[k])
    return SequentialTemperatureScaling(temperatures=temps, ece_before=ece_before,
                                        ece_after=ece_after, n_bins=n_bins)


def position_metrics(
    confidence_logits,
    accepted,
    *,
    temperatures=None,
    num_verified=None,
    n_bins: int = DEFAULT_N_BINS,
) -> dict[str, np.ndarray]:
    """Per-position calibration and discrimination metrics (each value is an ``[γ]`` array).

    Keys (samples per position as in the module docstring):
      ``ece``, ``brier``, ``auroc``: of the cumulative product ``a_k`` against prefix survival;
      ``n``: number of blocks whose survival to k is observed; ``mean_pred``, ``survival_rate``:
      mean ``a_k`` and observed survival over them;
      ``ece_cond``, ``auroc_cond``, ``n_cond``: of the conditional ``c_k`` against
      ``accepted[:, k]`` over blocks whose prefix 1..k−1 was accepted.

    Args:
      confidence_logits: float ``[N, γ]``.
      accepted: bool ``[N, γ]``.
      temperatures: optional ``[γ]``; if given, metrics are of the calibrated confidences.
      num_verified: optional int ``[N]``.
      n_bins: ECE bins.
    """
    logits, acc = _check_blocks(confidence_logits, accepted)
    temps = np.ones(logits.shape[1]) if temperatures is None else temperatures
    c = apply_temperatures(logits, temps)
    c = np.asarray(c, dtype=np.float64)
    a = np.cumprod(c, axis=1)
    survived, observed = survival(acc, num_verified)
    gamma = logits.shape[1]
    k1 = np.arange(1, gamma + 1)[None, :]
    verified = (np.ones_like(acc) if num_verified is None
                else k1 <= np.asarray(num_verified)[:, None])
    prefix_ok = np.concatenate([np.ones((acc.shape[0], 1), bool), survived[:, :-1]], axis=1)
    cond = verified & prefix_ok
    out = {key: np.full(gamma, np.nan) for key in
           ("ece", "brier", "auroc", "mean_pred", "survival_rate", "ece_cond", "auroc_cond")}
    out["n"] = observed.sum(axis=0)
    out["n_cond"] = cond.sum(axis=0)
    for k in range(gamma):
        o, ck = observed[:, k], cond[:, k]
        if o.any():
            out["ece"][k] = expected_calibration_error(a[o, k], survived[o, k], n_bins=n_bins)
            out["brier"][k] = brier_score(a[o, k], survived[o, k])
            out["auroc"][k] = auroc(a[o, k], survived[o, k])
            out["mean_pred"][k] = a[o, k].mean()
            out["survival_rate"][k] = survived[o, k].mean()
        if ck.any():
            out["ece_cond"][k] = expected_calibration_error(c[ck, k], acc[ck, k], n_bins=n_bins)
            out["auroc_cond"][k] = auroc(c[ck, k], acc[ck, k])
    return out
