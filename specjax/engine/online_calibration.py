"""Online calibration of draft confidences inside the device loop (``EngineConfig.online_calibration``).

The confidence policies (threshold, Algorithm 1, the production budget) read a drafter's
confidences ``c_k`` as conditional acceptance probabilities. An uncalibrated head misleads them
both ways: a head that under-states acceptance makes Algorithm 1 and production stop drafting
where a fixed K would win, and one that over-states it makes them verify drafts that are
rejected. (The quickstart DSpark head is close to calibrated in serving: its ratios below ended
in 0.77-1.18 in the serving benchmark, docs/SERVING.md "Online calibration".)

DSpark calibrates offline (Sequential Temperature Scaling on held-out drafts,
:mod:`specjax.calibration`). This is the serving-time counterpart, fitted on the verifier's own
decisions as the engine runs: per draft position k a ratio

    ρ_k = (A_k + m · ρ) / (P_k + m),        ρ = (Σ_k A_k + 1) / (Σ_k P_k + 1),

where over the verified drafts that *reached* position k (drafts 1..k−1 accepted) ``A_k`` counts
acceptances and ``P_k`` sums the raw ``c_k`` (both decayed by ``DECAY`` per drafting step, so the
ratio follows the traffic), and the pooled ratio ``ρ`` stands in for positions with little data
(``m = PSEUDO`` pseudo-observations). The policy then reads ``ĉ_k = min(1, ρ_k · c_k)``:
calibration in the large per position (the expected acceptance matches the observed one), the
ranking of drafts at one position unchanged.

Exactness: ``ρ`` is a function of verifications that already happened, and the current drafts'
own confidences were always admissible inputs to a length rule; a length rule that reads only
information available before the verification it decides, and never draft k itself when
deciding whether to verify draft k, is lossless (docs/DESIGN.md, invariant 1). ``ĉ_k`` reads
``c_k`` and past outcomes only, so Algorithm 1 stays non-anticipating. ``tests/test_engine.py``
checks it by chi-square.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["DECAY", "PSEUDO", "ratios", "calibrate", "update"]

# Forgetting per drafting step: an effective window of ~100 drafting steps (times the slots).
DECAY = 0.99
# Pseudo-observations (in units of predicted acceptances) pulling a position towards the pooled
# ratio: a position with a few reached drafts moves little from it.
PSEUDO = 4.0


def ratios(acc: jax.Array, pred: jax.Array) -> jax.Array:
    """Per-position ratios ``ρ_k [γ]`` from the decayed acceptance counts ``acc [γ]`` and the
    decayed sums of raw confidences ``pred [γ]`` (module docstring). All ones before any data."""
    pooled = (jnp.sum(acc) + 1.0) / (jnp.sum(pred) + 1.0)
    return (acc + PSEUDO * pooled) / (pred + PSEUDO)


def calibrate(conf: jax.Array, rho: jax.Array) -> jax.Array:
    """Calibrated conditional confidences ``min(1, ρ_k · c_k)``, ``[..., γ]`` f32."""
    return jnp.clip(conf.astype(jnp.float32) * rho.astype(jnp.float32), 0.0, 1.0)


def update(acc: jax.Array, pred: jax.Array, conf: jax.Array, ell: jax.Array,
           num_accepted: jax.Array, drew: jax.Array):
    """Adds one verification step's outcomes.

    Args:
      acc, pred: f32 ``[γ]`` running statistics.
      conf: f32 ``[S, γ]`` the raw confidences of the drafts just verified.
      ell: int32 ``[S]`` drafts verified per slot (≤ 0: none; -1 idle).
      num_accepted: int32 ``[S]`` drafts accepted per slot.
      drew: bool scalar, the step drafted (a plain step changes nothing, decays nothing).
    Returns:
      the updated ``(acc, pred)``.
    """
    pos = jnp.arange(conf.shape[1], dtype=jnp.int32)[None, :]
    reached = (pos < ell[:, None]) & (pos <= num_accepted[:, None])
    hit = reached & (pos < num_accepted[:, None])
    new_acc = DECAY * acc + jnp.sum(hit, axis=0).astype(jnp.float32)
    new_pred = DECAY * pred + jnp.sum(jnp.where(reached, conf.astype(jnp.float32), 0.0), axis=0)
    return jnp.where(drew, new_acc, acc), jnp.where(drew, new_pred, pred)
