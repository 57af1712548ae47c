"""Verification-length policies in jnp, for the device loop (:mod:`specjax.engine.device_loop`).

Each function mirrors a numpy reference in :mod:`specjax.scheduling` and returns the same lengths
on the same inputs (``tests/test_device_policies.py`` checks this, ties included). Differences of
form, not of result:

* fixed shapes: all S slots are passed, with ``active bool [S]``; inactive slots get ℓ = -1 (the
  verification step's "idle" marker) and are never candidates;
* f32 instead of f64 (the lengths agree unless two Θ values are within f32 rounding of each other,
  which the tests avoid by construction and which does not affect exactness: any length rule that
  only reads information available before the drafts it admits is lossless).

Candidate order (Algorithm 1 and the production form): all (r, j) with survival
``a[r, j] = Π_{i≤j} c[r, i] > 0`` and ``j < cap[r]``, sorted by ``a`` descending, ties by smaller j,
then smaller r (the numpy ``_greedy_order``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def survival(conf: jax.Array) -> jax.Array:
    """``a [S, γ] = cumprod(conf)`` in f32."""
    return jnp.cumprod(conf.astype(jnp.float32), axis=1)


def _ordered_candidates(a: jax.Array, cap: jax.Array, active: jax.Array):
    """Flattened candidates sorted in greedy order.

    Returns ``(rows [S·γ], js [S·γ], vals [S·γ], n_cand)``: the first ``n_cand`` entries are the
    real candidates in order; the rest are padding (val 0).
    """
    s, g = a.shape
    r = jnp.repeat(jnp.arange(s, dtype=jnp.int32), g)
    j = jnp.tile(jnp.arange(g, dtype=jnp.int32), s)
    v = a.reshape(-1)
    ok = (v > 0) & (j < cap[r]) & active[r]
    # lexsort: last key is primary. Non-candidates go last (key 1).
    order = jnp.lexsort((r, j, -jnp.where(ok, v, 0.0), (~ok).astype(jnp.int32)))
    return r[order], j[order], jnp.where(ok[order], v[order], 0.0), jnp.sum(ok)


def _lengths(rows, js, n, num_slots: int, active):
    """ℓ per slot from the first ``n`` admitted candidates (-1 for inactive slots)."""
    take = jnp.arange(rows.shape[0]) < n
    ell = jnp.zeros((num_slots,), jnp.int32).at[rows].max(jnp.where(take, js + 1, 0))
    return jnp.where(active, ell, -1)


def _theta_path(vals, n_cand, num_rows, sps):
    """τ·SPS along the greedy path: ``theta [S·γ]`` after admitting 1.. candidates, the number
    that may be admitted ``n_free``, and ``theta0`` (nothing admitted)."""
    b_max = sps.shape[0] - 1
    n_free = jnp.minimum(n_cand, b_max - num_rows)
    m = jnp.arange(vals.shape[0])
    tau = num_rows + jnp.cumsum(vals)
    theta = tau * sps[jnp.minimum(num_rows + 1 + m, b_max)]
    theta0 = num_rows * sps[num_rows]
    return theta, n_free, theta0


def prefix_schedule(conf, sps, cap, active, *, early_stop: bool = True):
    """DSpark Algorithm 1 (``early_stop=True``; lossless) or the retrospective search (biased).

    Args:
      conf: f32 ``[S, γ]`` confidences of the current drafts.
      sps: f32 ``[B_max + 1]`` steps/s of a verification batch of B tokens.
      cap: int32 ``[S]`` per-slot cap on ℓ. active: bool ``[S]``.
    Returns:
      int32 ``[S]`` lengths (-1 inactive).
    """
    s = conf.shape[0]
    rows, js, vals, n_cand = _ordered_candidates(survival(conf), cap, active)
    num_rows = jnp.sum(active).astype(jnp.int32)
    theta, n_free, theta0 = _theta_path(vals, n_cand, num_rows, sps)
    m = jnp.arange(vals.shape[0])
    if early_stop:
        prev = jnp.concatenate([theta0[None], theta[:-1]])
        fails = ~(theta > prev) & (m < n_free)
        n = jnp.where(jnp.any(fails), jnp.argmax(fails), n_free)
    else:
        masked = jnp.where(m < n_free, theta, -jnp.inf)
        best = jnp.argmax(masked)
        n = jnp.where((n_free > 0) & (masked[best] > theta0), best + 1, 0)
    return _lengths(rows, js, n, s, active)


def budget_search(conf, sps, cap, active, sps_draft=None, sps_plain=None):
    """Draft-token budget from (stale) confidences: full search of Θ along the greedy path.

    ``sps_draft`` (optional, like ``sps``) scores budgets > 0 (a step that drafts); budget 0 is
    scored with ``sps_plain`` (f32 scalar, steps/s of the plain step that replaces a
    verification of no drafts) when it is > 0, else with ``sps``. Returns an int32 scalar.
    """
    rows, js, vals, n_cand = _ordered_candidates(survival(conf), cap, active)
    num_rows = jnp.sum(active).astype(jnp.int32)
    sps_d = sps if sps_draft is None else sps_draft
    theta, n_free, _ = _theta_path(vals, n_cand, num_rows, sps_d)
    m = jnp.arange(vals.shape[0])
    masked = jnp.where(m < n_free, theta, -jnp.inf)
    best = jnp.argmax(masked)
    theta0 = num_rows * sps[num_rows]
    if sps_plain is not None:
        theta0 = jnp.where(sps_plain > 0, num_rows * sps_plain, theta0)
    ok = (n_free > 0) & (masked[best] > theta0)
    return jnp.where(ok, best + 1, 0).astype(jnp.int32)


def top_budget_admission(conf, budget, cap, active):
    """Admits the ``budget`` candidates with the highest live survival (rank-preserving)."""
    rows, js, _, n_cand = _ordered_candidates(survival(conf), cap, active)
    return _lengths(rows, js, jnp.minimum(budget, n_cand), conf.shape[0], active)


def threshold_schedule(conf, threshold, cap, active):
    """Longest prefix with survival ``≥ threshold`` (capped)."""
    ell = jnp.sum(survival(conf) >= threshold, axis=1).astype(jnp.int32)
    return jnp.where(active, jnp.minimum(ell, cap), -1)


def fixed_k(k: int, cap, active):
    """ℓ = k for every active slot (capped)."""
    return jnp.where(active, jnp.minimum(k, cap), -1).astype(jnp.int32)


def confidences_from_survival(a):
    """``c_j = a_j / a_{j-1}`` (``a_0 = 1``), 0 where ``a_{j-1} = 0``; ``a`` ``[..., γ]``."""
    prev = jnp.concatenate([jnp.ones_like(a[..., :1]), a[..., :-1]], axis=-1)
    return jnp.where(prev > 0, a / jnp.where(prev > 0, prev, 1.0), 0.0)


def shrink_stale(stale, prior, lag, decay: float):
    """Production's stale confidences ``[S, γ]`` shrunk towards ``prior [γ]`` by
    ``decay**lag`` (``lag`` int ``[S]``) in survival space; ``decay`` is static."""
    if decay == 1.0:
        return stale
    w = jnp.float32(decay) ** lag.astype(jnp.float32)
    a_p = survival(prior[None])
    return confidences_from_survival(a_p + w[:, None] * (survival(stale) - a_p))


def survival_prior_update(prior, conf, fresh, weight):
    """The running prior ``[γ]`` after a drafting step: survivals averaged over the ``fresh``
    rows (bool ``[S]``) of ``conf [S, γ]`` and mixed in with ``weight`` (scalar); unchanged when
    no row is fresh."""
    a = survival(conf)
    n = jnp.sum(fresh)
    mean = jnp.sum(jnp.where(fresh[:, None], a, 0.0), axis=0) / jnp.maximum(n, 1)
    new = confidences_from_survival((1 - weight) * survival(prior[None])[0] + weight * mean)
    return jnp.where(n > 0, new, prior)
