"""The DSpark drafter objective (DSpark §3.3 eq. 9-12): weighted CE + L1 + confidence BCE."""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from specjax.losses._common import (ArrayLike, _check_float, _compute_dtype, _masked,
                                    _position_mask)
from specjax.losses.tv import _tv_and_ce


def dspark_position_weights(gamma: int, dtype=jnp.float32) -> jax.Array:
    """DSpark position weights ``w_k = exp(−(k−1)/γ)`` for ``k = 1..γ`` (DSpark §3.3)."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    return jnp.exp(-jnp.arange(gamma, dtype=dtype) / gamma)


class DSparkTerms(NamedTuple):
    """Unweighted per-position terms of the DSpark objective, each ``[..., γ]``."""

    ce: jax.Array    # −log q_k(x*_k)
    l1: jax.Array    # ‖q_k − p_k‖₁ = 2·tv_k (exact for normalised p)
    conf: jax.Array  # bce(σ(conf_k), stop_grad(1 − tv_k))
    tv: jax.Array    # tv_k; 1 − tv_k is the confidence target c*_k (DSpark eq. 8)


def _sigmoid_bce(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``−t log σ(x) − (1 − t) log σ(−x)``, stable for large |x| (log-sigmoid form)."""
    return -(targets * jax.nn.log_sigmoid(logits) + (1.0 - targets) * jax.nn.log_sigmoid(-logits))


def dspark_loss_terms(
    draft_logits: jax.Array,
    target_probs: jax.Array,
    labels: jax.Array,
    confidence_logits: jax.Array,
    *,
    where: Optional[ArrayLike] = None,
    chunk_size: Optional[int] = None,
) -> DSparkTerms:
    r"""The three DSpark per-position terms, unweighted; see :func:`dspark_loss`.

    ``ce`` and ``tv`` come from one chunked custom-VJP pass (the TV kernel of :func:`tv_loss` also
    produces ``logsumexp(z) − z[x*]``), so their summed gradient is written once, with no extra
    logits-sized buffer. ``l1 = 2·tv`` (equal to ``Σ|q − p|`` when ``Σ p = 1``). The confidence
    target ``1 − tv`` is detached: the confidence loss trains only the confidence head, never the
    draft distribution. Masked positions (``where`` False) have all terms 0; their labels may be
    padding ids (they are clipped into range before indexing).

    Args: as :func:`dspark_loss`. Returns: :class:`DSparkTerms`, each ``[..., γ]`` float32.
    """
    z = jnp.asarray(draft_logits)
    if z.ndim < 2:
        raise ValueError(f"draft_logits must be [..., γ, V], got shape {z.shape}")
    _check_float("draft_logits", z)
    p = jax.lax.stop_gradient(jnp.asarray(target_probs))
    _check_float("target_probs", p)
    c = jnp.asarray(confidence_logits)
    _check_float("confidence_logits", c)
    if c.shape != z.shape[:-1]:
        raise ValueError(f"confidence_logits {c.shape} must be [..., γ] = {z.shape[:-1]}")
    labels = jnp.asarray(labels)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"labels must be integer token ids, got dtype {labels.dtype}")
    if labels.shape != z.shape[:-1]:
        raise ValueError(f"labels {labels.shape} must be [..., γ] = {z.shape[:-1]}")
    mask = _position_mask(where, z.shape[:-1])
    # One chunked custom-VJP pass gives both tv and ce and one fused gradient; computed
    # separately, the CE and TV gradients would be two logits-sized buffers that are then summed.
    tv, ce = _tv_and_ce(z, p, labels, mask, chunk_size, with_ce=True)
    target = jax.lax.stop_gradient(1.0 - tv)
    conf = _masked(_sigmoid_bce(c.astype(_compute_dtype(c)), target), mask)
    return DSparkTerms(ce=ce, l1=2.0 * tv, conf=conf, tv=tv)


def dspark_loss(
    draft_logits: jax.Array,
    target_probs: jax.Array,
    labels: jax.Array,
    confidence_logits: jax.Array,
    *,
    weights: Optional[ArrayLike] = None,
    ce_coef: float = 0.1,
    l1_coef: float = 0.9,
    conf_coef: float = 1.0,
    where: Optional[ArrayLike] = None,
    chunk_size: Optional[int] = None,
) -> jax.Array:
    r"""DSpark drafter objective for γ-token blocks (DSpark §3.3 eq. 9–12).

    ``L = Σ_k w_k [ce_coef·(−log q_k(x*_k)) + l1_coef·‖q_k − p_k‖₁
    + conf_coef·bce(σ(conf_k), stop_grad(1 − tv_k))]``, with ``w_k = exp(−(k−1)/γ)`` by default.
    As in the paper the positions are *summed*, not averaged; the defaults are the paper's
    ``α_ce = 0.1, α_tv = 0.9, α_conf = 1.0``. The paper writes ``L_tv`` as the L1 norm, i.e.
    ``2·tv``, and that is what ``l1_coef`` multiplies here. The BCE target ``c*_k = 1 − tv_k`` is
    the analytic acceptance rate of position k given its prefix was accepted (eq. 8).

    Args:
      draft_logits: ``[..., γ, V]``.
      target_probs: ``[..., γ, V]``, detached inside.
      labels: ``[..., γ]`` integer ground-truth tokens ``x*_k``.
      confidence_logits: ``[..., γ]`` pre-sigmoid confidence-head outputs.
      weights: ``[γ]`` (or broadcastable to ``[..., γ]``) position weights; default
        :func:`dspark_position_weights`.
      ce_coef, l1_coef, conf_coef: term coefficients.
      where: optional bool broadcastable to ``[..., γ]``; masked positions contribute nothing
        (labels there may be padding ids).
      chunk_size: passed to :func:`tv_loss`.

    Returns:
      ``[...]`` float32 (one loss per block). Use :func:`dspark_loss_terms` for the parts.
    """
    z = jnp.asarray(draft_logits)
    if z.ndim < 2:
        raise ValueError(f"draft_logits must be [..., γ, V], got shape {z.shape}")
    gamma = z.shape[-2]
    w = dspark_position_weights(gamma) if weights is None else jnp.asarray(weights, jnp.float32)
    try:
        w = jnp.broadcast_to(w, z.shape[:-1])
    except ValueError:
        raise ValueError(f"weights of shape {w.shape} do not broadcast to [..., γ] = "
                         f"{z.shape[:-1]}") from None
    mask = _position_mask(where, z.shape[:-1])
    t = dspark_loss_terms(z, target_probs, labels, confidence_logits, where=mask,
                          chunk_size=chunk_size)
    per_pos = ce_coef * t.ce + l1_coef * t.l1 + conf_coef * t.conf
    return jnp.sum(_masked(w * per_pos, mask), axis=-1)
