"""Host-side verification scheduling (numpy only, no JAX).

Each engine step, every active request r has γ drafted tokens with confidences
``c[r, k] = P(draft k accepted | drafts < k accepted)``. A policy picks how many of them to verify,
``ℓ_r ∈ [0, γ]``. The verification batch then holds ``B = Σ_r (1 + ℓ_r)`` tokens, padded up to a
compiled token bucket.

Policies (DSpark paper §3.2.2, §5.2 and Appendix A; DESIGN "Prefix scheduler"):

* ``no_speculation``: ℓ = 0 (plain decoding through the same engine).
* ``fixed_k``: ℓ = K for every request (K = 1 is the "MTP-1" setting).
* ``threshold``: longest prefix whose survival ``a_{r,j} = Π_{i≤j} c_{r,i}`` stays ≥ a threshold.
* ``prefix_schedule(early_stop=True)``: Algorithm 1. Sort all (r, j) by ``a`` (descending; ties:
  smaller j first), admit one by one and stop at the first admission that does not raise
  ``Θ = τ · SPS(B)``. The early stop makes the admission of draft k depend only on information
  available before x_k was drawn (the non-anticipating rule), which keeps decoding lossless.
  ``early_stop=False`` is the retrospective global search; it is biased (Appendix A) and kept only
  so tests can show the bias.
* ``production_schedule``: the asynchronous form of §5.2. The token *budget* comes from a full
  search over the greedy path using confidences from two steps earlier (stale, so independent of
  the tokens being verified); the current step then admits its top-``budget`` candidates by live
  ``a`` (rank-preserving top-K), which is non-anticipating.

Why the greedy path is enough: ``a_{r,j}`` is non-increasing in j, so for any fixed B the best τ is
reached by the B − R largest survival probabilities, which always form per-request prefixes.

SPS(B) (steps per second of a verification forward of B tokens) comes from an
:class:`~specjax.buckets.SPSProfile`, measured once per compiled token bucket. The buckets and the
profile live in :mod:`specjax.buckets`; their public names are re-exported here, so that
``from specjax.scheduling import SPSProfile`` keeps working.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from specjax.buckets import (SPSProfile, default_buckets, pick_bucket, plan_chunks, profile_sps,
                             prompt_chunk_buckets, validate_buckets)

__all__ = [
    # policies
    "prefix_survival", "prefix_schedule", "expected_throughput", "budget_search",
    "top_budget_admission", "shrink_stale", "survival_prior_update", "confidences_from_survival",
    "production_schedule", "no_speculation", "fixed_k",
    "threshold_schedule", "POLICIES", "SchedulerConfig", "schedule",
    # from specjax.buckets
    "SPSProfile", "default_buckets", "pick_bucket", "plan_chunks", "profile_sps",
    "prompt_chunk_buckets", "validate_buckets",
]


def prefix_survival(confidences: np.ndarray) -> np.ndarray:
    """``a[r, j] = Π_{i≤j} c[r, i]``: probability that drafts 1..j of request r are all accepted."""
    c = np.asarray(confidences, np.float64)
    if c.ndim != 2:
        raise ValueError(f"confidences must be [R, γ], got shape {c.shape}")
    if not ((c >= 0) & (c <= 1)).all():  # one pass; NaN and ±inf fail it too
        raise ValueError("confidences must be finite probabilities in [0, 1]")
    return np.cumprod(c, axis=1)


def _greedy_order(a: np.ndarray, max_len: Optional[np.ndarray] = None) -> tuple[np.ndarray, ...]:
    """Candidates (r, j) with a > 0 sorted by a descending, ties by smaller j then smaller r.

    ``max_len[r]`` (optional) caps how many drafts request r may verify. Returns (rows, js, a).
    """
    r_idx, j_idx = np.nonzero(a > 0)
    if max_len is not None:
        keep = j_idx < np.asarray(max_len)[r_idx]
        r_idx, j_idx = r_idx[keep], j_idx[keep]
    vals = a[r_idx, j_idx]
    order = np.lexsort((r_idx, j_idx, -vals))
    return r_idx[order], j_idx[order], vals[order]


def _lengths_from_admitted(num_rows: int, rows: np.ndarray, js: np.ndarray) -> np.ndarray:
    lengths = np.zeros(num_rows, np.int64)
    np.maximum.at(lengths, rows, js + 1)
    return lengths


def prefix_schedule(confidences, sps_table, *, early_stop: bool = True,
                    max_len: Optional[np.ndarray] = None) -> np.ndarray:
    """DSpark Algorithm 1: verification lengths maximising ``Θ = τ · SPS(B)``.

    Args:
      confidences: float ``[R, γ]``, ``c[r, k] = P(draft k accepted | prefix accepted)``.
      sps_table: float ``[B_max + 1]``, steps/second for a verification batch of B tokens.
        ``B = Σ_r (1 + ℓ_r)`` never exceeds ``B_max``.
      early_stop: True is Algorithm 1 (lossless). False is the retrospective global search over
        the whole greedy path (biased; for tests only).
      max_len: optional int ``[R]`` per-request caps on ℓ (e.g. remaining tokens to generate).
    Returns:
      int ``[R]`` lengths ℓ_r.
    """
    a = prefix_survival(confidences)
    sps = np.asarray(sps_table, np.float64)
    num_rows = a.shape[0]
    b_max = sps.shape[0] - 1
    if num_rows > b_max:
        raise ValueError(f"{num_rows} requests do not fit the largest bucket ({b_max} tokens)")
    rows, js, vals = _greedy_order(a, max_len)
    n_free = min(len(vals), b_max - num_rows)
    tau = num_rows + np.cumsum(vals[:n_free])  # τ after admitting 1..n_free candidates
    theta = tau * sps[num_rows + 1:num_rows + 1 + n_free]
    theta0 = num_rows * sps[num_rows]
    if early_stop:
        # Admit while each admission strictly raises Θ over the best so far; stop at the first
        # one that does not. Along a path where each step raises Θ, "best so far" is the previous.
        prev = np.concatenate([[theta0], theta[:-1]])
        fails = np.nonzero(~(theta > prev))[0]
        n = int(fails[0]) if fails.size else n_free
    else:
        best = int(np.argmax(theta)) if n_free else -1
        n = best + 1 if n_free and theta[best] > theta0 else 0
    return _lengths_from_admitted(num_rows, rows[:n], js[:n])


def expected_throughput(confidences, lengths, sps_table) -> float:
    """``Θ = τ · SPS(B)`` of given lengths (τ = Σ_r 1 + Σ_{j≤ℓ_r} a_{r,j})."""
    a = prefix_survival(confidences)
    lengths = np.asarray(lengths)
    mask = np.arange(a.shape[1])[None, :] < lengths[:, None]
    tau = a.shape[0] + float(np.sum(a * mask))
    return tau * float(np.asarray(sps_table)[a.shape[0] + int(lengths.sum())])


def budget_search(confidences, sps_table, max_len: Optional[np.ndarray] = None,
                  sps_table_draft=None, plain_sps: float = 0.0) -> int:
    """Number of draft tokens to verify: full (no early stop) search of Θ along the greedy path.

    Used with *stale* confidences (two steps old) by :func:`production_schedule`; searching the
    whole path steps over the cliffs of a jagged SPS curve.

    Args:
      sps_table_draft: optional float ``[B_max + 1]``: SPS of a step that also drafts
        (:meth:`SPSProfile.table_with_draft`). When given, a budget > 0 is scored with it and
        budget 0 with ``sps_table``: the budget is fixed before drafting, so budget 0 means the
        step does not draft at all and does not pay for it.
      plain_sps: optional steps/second of the plain decode step a non-drafting step runs instead
        of a verification (the device loop's production policy; :attr:`SPSProfile.plain_s`).
        When > 0, budget 0 is scored ``R · plain_sps``; otherwise ``R · SPS(R)``.
    """
    a = prefix_survival(confidences)
    sps = np.asarray(sps_table, np.float64)
    sps_d = sps if sps_table_draft is None else np.asarray(sps_table_draft, np.float64)
    if sps_d.shape != sps.shape:
        raise ValueError(f"sps_table_draft shape {sps_d.shape} != sps_table shape {sps.shape}")
    num_rows, b_max = a.shape[0], sps.shape[0] - 1
    if num_rows > b_max:
        raise ValueError(f"{num_rows} requests do not fit the largest bucket ({b_max} tokens)")
    _, _, vals = _greedy_order(a, max_len)
    n_free = min(len(vals), b_max - num_rows)
    if n_free == 0:
        return 0
    tau = num_rows + np.cumsum(vals[:n_free])
    theta = tau * sps_d[num_rows + 1:num_rows + 1 + n_free]
    best = int(np.argmax(theta))
    theta0 = num_rows * (plain_sps if plain_sps > 0 else sps[num_rows])
    return best + 1 if theta[best] > theta0 else 0


def confidences_from_survival(a) -> np.ndarray:
    """The inverse of :func:`prefix_survival`: ``c_j = a_j / a_{j-1}`` (``a_0 = 1``), 0 where
    ``a_{j-1} = 0``. ``a``: float ``[..., γ]``, non-increasing along the last axis."""
    a = np.asarray(a, np.float64)
    prev = np.concatenate([np.ones_like(a[..., :1]), a[..., :-1]], axis=-1)
    return np.divide(a, prev, out=np.zeros_like(a), where=prev > 0)


def survival_prior_update(prior, fresh, weight: float) -> np.ndarray:
    """The running prior after one drafting step: a moving average of *survivals*.

    ``cumprod(new) = (1 − weight) · cumprod(prior) + weight · mean_r cumprod(fresh[r])``, returned
    as confidences. Averaging survivals, not confidences, keeps the prior's summed survival the
    mean of the drafted ones' (``Π`` of mean confidences understates it when they vary); a new
    request reads it, and stale vectors shrink towards it (:func:`shrink_stale`).

    Args:
      prior: float ``[γ]``. fresh: float ``[R, γ]`` this step's drafted confidences (R ≥ 1).
      weight: of this step (1 replaces the prior: the first observation).
    """
    a = (1 - weight) * prefix_survival(np.asarray(prior)[None])[0] \
        + weight * prefix_survival(fresh).mean(axis=0)
    return confidences_from_survival(a)


def shrink_stale(stale, prior, lag, decay: float) -> np.ndarray:
    """Stale confidences pulled towards the running prior by their age (production's budget input).

    In survival space: ``a = a_prior + decay**lag · (a_stale − a_prior)`` with ``a = cumprod(c)``,
    returned as confidences. A vector drafted ``lag`` steps ago predicts what a request would
    draft now less well the older it is (the correlation of their summed survivals falls with
    the lag, ``benchmarks/confidence_staleness.py``), so it is shrunk towards the running prior;
    ``decay = 1`` keeps it as it is, ``decay = 0`` reads the prior alone. Shrinking survivals
    moves the summed survival ``S = Σ_j a_j`` (the budget search's τ per request) linearly from
    the stale vector's to the prior's. The device loop's jnp form:
    :func:`specjax.engine.device_policies.shrink_stale`.

    Args:
      stale: float ``[R, γ]`` each request's latest usable drafted confidences.
      prior: float ``[γ]`` the running prior (:func:`survival_prior_update`).
      lag: int ``[R]`` steps since each row's vector was drafted (a row that reads the prior
        already is unchanged by any lag).
      decay: per-step factor in ``[0, 1]`` (``SchedulerConfig.stale_decay``).
    Returns:
      float ``[R, γ]`` (``stale`` itself when ``decay = 1``).
    """
    if decay == 1.0:  # exactly the stale vector (no rounding through the survivals)
        return stale
    w = decay ** np.asarray(lag, np.float64)
    a_p = prefix_survival(np.asarray(prior)[None])
    return confidences_from_survival(a_p + w[:, None] * (prefix_survival(stale) - a_p))


def top_budget_admission(confidences, budget: int,
                         max_len: Optional[np.ndarray] = None) -> np.ndarray:
    """Admits the ``budget`` candidates with the highest live survival ``a`` (rank-preserving).

    Whether draft k of request r is admitted depends on how many candidates rank above it, all of
    which have ``a ≥ a_{r,k}`` and none of which depends on x_{r,k}; so this is non-anticipating
    for any budget fixed before the current drafts were drawn.
    """
    if budget < 0:
        raise ValueError(f"budget must be ≥ 0, got {budget}")
    a = prefix_survival(confidences)
    rows, js, _ = _greedy_order(a, max_len)
    n = min(int(budget), len(rows))
    return _lengths_from_admitted(a.shape[0], rows[:n], js[:n])


def production_schedule(live_confidences, stale_confidences, sps_table,
                        max_len: Optional[np.ndarray] = None, sps_table_draft=None,
                        plain_sps: float = 0.0) -> np.ndarray:
    """DSpark §5.2: budget from stale confidences (full search), top-budget live admission.

    Args:
      live_confidences: float ``[R, γ]`` of the drafts being verified now.
      stale_confidences: float ``[R, γ]`` from two steps earlier (rows aligned with the live
        ones; use the live request's own older confidences, or a neutral prior for new requests).
      sps_table: float ``[B_max + 1]``.
    Returns:
      int ``[R]`` lengths; ``Σ ℓ`` never exceeds the budget, ``R + Σ ℓ ≤ B_max``.
    """
    budget = budget_search(stale_confidences, sps_table, max_len, sps_table_draft, plain_sps)
    return top_budget_admission(live_confidences, budget, max_len)


def no_speculation(num_rows: int, gamma: int = 0) -> np.ndarray:
    return np.zeros(num_rows, np.int64)


def fixed_k(num_rows: int, k: int, max_len: Optional[np.ndarray] = None) -> np.ndarray:
    """ℓ = k for every request (capped by ``max_len``)."""
    lengths = np.full(num_rows, k, np.int64)
    return lengths if max_len is None else np.minimum(lengths, max_len)


def threshold_schedule(confidences, threshold: float,
                       max_len: Optional[np.ndarray] = None) -> np.ndarray:
    """Longest prefix with survival ``a_{r,j} ≥ threshold`` (a static confidence threshold)."""
    a = prefix_survival(confidences)
    lengths = np.sum(a >= threshold, axis=1).astype(np.int64)  # a is non-increasing in j
    return lengths if max_len is None else np.minimum(lengths, max_len)


# "retrospective" is Algorithm 1 without the early stop: biased (Appendix A), for tests only.
POLICIES = ("none", "fixed", "mtp1", "threshold", "dspark", "production", "retrospective")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Which policy the engine uses and its parameters.

    policy: one of POLICIES. k: draft length for "fixed". threshold: for "threshold".
    explore_every: "production" only: when its budget search says not to draft, still draft at
      least once every this many steps (the best budget > 0, whatever the plain step's rate),
      so that the stale confidences the search runs on stay fresh and it can turn drafting back
      on when the load falls. A fixed step count: it never looks at a draft. Before any
      confidences were seen (an engine's first step) it drafts too: the stale confidences are a
      0.5 guess until then. 0 disables both.
    stale_decay: "production" only: the budget search reads each request's latest drafted
      confidences shrunk towards the running prior of all drafted ones by ``stale_decay**lag``
      in survival space, ``lag`` the steps since they were drafted (:func:`shrink_stale`). 1
      reads them as they are however old, so a pessimistic vector holds drafting off until the
      next exploring step. The default 0.85 is the value that predicted the current step's
      summed survival best over lags 1-16, pooled over T = 0 and 1, for the DSpark-Markov head
      of docs/SERVING.md ("How fast the confidences go stale";
      ``benchmarks/confidence_staleness.py`` measures it for any head). Any value is lossless:
      the budget reads no draft of the step it admits.
    """

    policy: str = "dspark"
    k: int = 4
    threshold: float = 0.5
    explore_every: int = 16
    stale_decay: float = 0.85

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"SchedulerConfig.policy must be one of {POLICIES}, "
                             f"got {self.policy!r}")
        if self.k < 0:
            raise ValueError(f"SchedulerConfig.k must be ≥ 0, got {self.k}")
        if not 0 <= self.threshold <= 1:
            raise ValueError(f"SchedulerConfig.threshold must be in [0, 1], got {self.threshold}")
        if not 0 <= self.stale_decay <= 1:
            raise ValueError(f"SchedulerConfig.stale_decay must be in [0, 1], "
                             f"got {self.stale_decay}")
        if self.explore_every < 0:
            raise ValueError(f"SchedulerConfig.explore_every must be ≥ 0, "
                             f"got {self.explore_every}")


def schedule(config: SchedulerConfig, confidences: np.ndarray, sps_table: np.ndarray, *,
             stale_confidences: Optional[np.ndarray] = None,
             max_len: Optional[np.ndarray] = None, sps_table_draft=None) -> np.ndarray:
    """Dispatches to the configured policy. Returns int ``[R]`` lengths (≤ γ, ≤ max_len)."""
    confidences = np.asarray(confidences, np.float64)
    num_rows, gamma = confidences.shape
    cap = np.full(num_rows, gamma) if max_len is None else np.minimum(max_len, gamma)
    if config.policy == "none":
        return no_speculation(num_rows)
    if config.policy == "fixed":
        return fixed_k(num_rows, min(config.k, gamma), cap)
    if config.policy == "mtp1":
        return fixed_k(num_rows, min(1, gamma), cap)
    if config.policy == "threshold":
        return threshold_schedule(confidences, config.threshold, cap)
    if config.policy == "dspark":
        return prefix_schedule(confidences, sps_table, early_stop=True, max_len=cap)
    if config.policy == "retrospective":
        return prefix_schedule(confidences, sps_table, early_stop=False, max_len=cap)
    stale = confidences if stale_confidences is None else stale_confidences
    return production_schedule(confidences, stale, sps_table, max_len=cap,
                               sps_table_draft=sps_table_draft)
