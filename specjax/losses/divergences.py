"""CE, forward KL and reverse KL per position (plain autodiff); shapes in ``specjax.losses``."""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax.losses._common import (ArrayLike, _check_float, _check_same_shape, _compute_dtype,
                                    _masked, _position_mask, _vocab_last)

# Reverse-KL floor for log p: the log of the smallest normal float32 (≈ −87.34). A token the
# target gives exactly zero probability (top-k / top-p masks) is treated as if p were that small,
# so KL(q‖p) stays finite and its gradient pushes q's mass there down hard instead of being NaN/inf.
DEFAULT_LOG_P_FLOOR = float(np.log(np.finfo(np.float32).tiny))


def ce_loss(
    draft_logits: jax.Array,
    labels: jax.Array,
    *,
    axis: int = -1,
    where: Optional[ArrayLike] = None,
) -> jax.Array:
    r"""Cross-entropy with hard labels, ``−log q(x*)`` with ``q = softmax(draft_logits)``.

    Args:
      draft_logits: ``[..., V]`` float (any float dtype; computed in at least float32).
      labels: ``[...]`` integer token ids in ``[0, V)``. Ids outside that range (e.g. ``-1``
        padding) are only allowed at positions masked out by ``where``.
      axis: the vocabulary axis of ``draft_logits`` (default last).
      where: optional bool, broadcastable to ``[...]``; False positions give 0 loss and 0 gradient.

    Returns:
      ``[...]`` float32 losses, ``logsumexp(z) − z[x*]``.

    References: DSpark eq. 9; Bebop footnote 4 (CE = forward KL + H(p), same gradient).
    """
    _check_float("draft_logits", draft_logits)
    z = _vocab_last(jnp.asarray(draft_logits), axis)
    labels = jnp.asarray(labels)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"labels must be integer token ids, got dtype {labels.dtype}")
    if labels.shape != z.shape[:-1]:
        raise ValueError(f"labels {labels.shape} must have the draft_logits shape without the "
                         f"vocabulary axis, {z.shape[:-1]}")
    mask = _position_mask(where, labels.shape)
    z = z.astype(_compute_dtype(z))
    # Clip so that padding ids index safely; their loss is then removed by `where`.
    safe = jnp.clip(labels, 0, z.shape[-1] - 1)
    picked = jnp.take_along_axis(z, safe[..., None], axis=-1)[..., 0]
    return _masked(jax.nn.logsumexp(z, axis=-1) - picked, mask)


def _log_q_and_p(draft_logits, target_probs, axis, where):
    """The KL losses' common start: ``(log q, detached p, position mask, compute dtype)`` with the
    vocabulary last; ``p`` keeps its input dtype."""
    z = _vocab_last(jnp.asarray(draft_logits), axis)
    p = _vocab_last(jax.lax.stop_gradient(jnp.asarray(target_probs)), axis)
    _check_same_shape(z, p, "draft_logits", "target_probs")
    mask = _position_mask(where, z.shape[:-1])
    dt = _compute_dtype(z, p)
    return jax.nn.log_softmax(z.astype(dt), axis=-1), p, mask, dt


def kl_loss(
    draft_logits: jax.Array,
    target_probs: jax.Array,
    *,
    axis: int = -1,
    where: Optional[ArrayLike] = None,
) -> jax.Array:
    r"""Forward KL, ``KL(p‖q) = Σ_v p_v (log p_v − log q_v)``, ``q = softmax(draft_logits)``.

    Terms with ``p_v = 0`` are exactly 0 (the ``0·log 0 = 0`` convention), so top-k / top-p-masked
    targets are fine. ``p_v > 0`` where ``q_v = 0`` (a ``-inf`` draft logit) gives ``+inf``: that is
    the true value. ``p`` is not renormalised.

    Args:
      draft_logits: ``[..., V]`` float.
      target_probs: ``[..., V]`` float, detached inside.
      axis: the vocabulary axis (default last).
      where: optional bool, broadcastable to ``[...]``.

    Returns:
      ``[...]`` float32. Gradient w.r.t. the logits: ``q·Σp − p`` (``= q − p`` for normalised p).

    References: Bebop §4.1 and Table 1 (gradient ``q_j − p_j``).
    """
    _check_float("draft_logits", draft_logits)
    _check_float("target_probs", target_probs)
    log_q, p, mask, dt = _log_q_and_p(draft_logits, target_probs, axis, where)
    p = p.astype(dt)
    pos = p > 0
    # Double `where`: log(1) in the untaken branch keeps its forward and backward finite.
    log_p = jnp.log(jnp.where(pos, p, 1.0))
    terms = jnp.where(pos, p * (log_p - log_q), 0.0)
    return _masked(jnp.sum(terms, axis=-1), mask)


def reverse_kl_loss(
    draft_logits: jax.Array,
    target_probs: jax.Array,
    *,
    axis: int = -1,
    where: Optional[ArrayLike] = None,
    log_p_floor: float = DEFAULT_LOG_P_FLOOR,
) -> jax.Array:
    r"""Reverse KL, ``KL(q‖p) = Σ_v q_v (log q_v − log p_v)``, ``q = softmax(draft_logits)``.

    Zero target probabilities. ``p`` built with top-k / top-p masks is exactly 0 on many tokens
    where ``q > 0``, and then ``KL(q‖p) = +inf``. Here ``log p`` is clamped from below,
    ``log p ← max(log p, log_p_floor)``; the default floor is ``log(float32 tiny) ≈ −87.34``, i.e.
    a zero is treated as the smallest normal float32. The loss stays finite, its gradient
    ``q_j(log q_j − log p_j − KL)`` (Bebop eq. 17) drives ``q`` off the forbidden tokens strongly,
    and nothing is NaN. Tokens with ``q_v = 0`` contribute 0 (``0·log 0 = 0``).

    Args:
      draft_logits: ``[..., V]`` float.
      target_probs: ``[..., V]`` float, detached inside.
      axis: the vocabulary axis (default last).
      where: optional bool, broadcastable to ``[...]``.
      log_p_floor: lower clamp for ``log p`` (a float; must be finite).

    Returns:
      ``[...]`` float32.

    References: Bebop App. C, eq. 17.
    """
    _check_float("draft_logits", draft_logits)
    _check_float("target_probs", target_probs)
    if not math.isfinite(log_p_floor):
        raise ValueError(f"log_p_floor must be finite, got {log_p_floor}")
    log_q, p, mask, dt = _log_q_and_p(draft_logits, target_probs, axis, where)
    q = jnp.exp(log_q)
    log_p = jnp.maximum(jnp.log(p.astype(dt)), log_p_floor)  # log 0 = -inf -> floor, no NaN
    nz = q > 0
    log_q_safe = jnp.where(nz, log_q, 0.0)  # -inf logits: keep the untaken branch finite
    terms = jnp.where(nz, q * (log_q_safe - log_p), 0.0)
    return _masked(jnp.sum(terms, axis=-1), mask)
