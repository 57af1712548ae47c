"""End-to-end TV (Bebop eq. 12-13): one minus the normalised expected acceptance length."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from specjax.losses._common import ArrayLike, _position_mask
from specjax.losses.tv import tv_loss


def e2e_tv_from_tv(tv: jax.Array, *, where: Optional[ArrayLike] = None) -> jax.Array:
    r"""End-to-end TV from per-position TV distances: ``1 − (1/γ) Σ_j Π_{i≤j} (1 − tv_i)``.

    ``Σ_j Π_{i≤j} α_i`` is the expected number of accepted drafts of a γ-chain under rejection
    sampling (Bebop eq. 12), so this is ``1 −`` the normalised expected acceptance length.

    With ``where`` (bool, broadcastable to ``[..., γ]``): a masked position i is skipped, i.e. it
    neither adds a term ``j = i`` nor a factor (``α_i := 1``), and the sum is divided by the number
    of unmasked positions instead of γ. For the usual *prefix* mask (the first n positions valid)
    this is exactly the e2e loss of the shorter n-chain. A row with no valid position gives 0.

    Args:
      tv: ``[..., γ]`` per-position TV distances (differentiable).
      where: optional bool mask, broadcastable to ``[..., γ]``.

    Returns:
      ``[...]``; the gradient flows through every factor of every prefix product.
    """
    tv = jnp.asarray(tv)
    if tv.ndim < 1:
        raise ValueError(f"tv must have a draft-position axis, got shape {tv.shape}")
    mask = _position_mask(where, tv.shape)
    alpha = 1.0 - tv
    if mask is not None:
        alpha = jnp.where(mask, alpha, 1.0)
    # cumprod differentiates through an associative scan of products (no division), so an α = 0
    # factor gives correct, finite gradients.
    survive = jnp.cumprod(alpha, axis=-1)
    if mask is None:
        return 1.0 - jnp.mean(survive, axis=-1)
    count = jnp.sum(mask, axis=-1)
    total = jnp.sum(jnp.where(mask, survive, 0.0), axis=-1)
    return jnp.where(count > 0, 1.0 - total / jnp.maximum(count, 1), 0.0)


def e2e_tv_loss(
    draft_logits: jax.Array,
    target_probs: jax.Array,
    *,
    where: Optional[ArrayLike] = None,
    chunk_size: Optional[int] = None,
) -> jax.Array:
    r"""End-to-end TV loss (Bebop eq. 13): ``1 − (1/γ) Σ_{j=1..γ} Π_{i≤j} (1 − tv_i)``.

    Args:
      draft_logits: ``[..., γ, V]`` draft logits of the γ chained draft positions.
      target_probs: ``[..., γ, V]`` target probabilities, detached inside.
      where: optional bool broadcastable to ``[..., γ]`` (see :func:`e2e_tv_from_tv` for how masked
        positions enter the product and the normalisation).
      chunk_size: passed to :func:`tv_loss`.

    Returns:
      ``[...]``. The gradient flows through the whole prefix product into every position's logits:
      ``∂L/∂tv_i = (1/γ) Σ_{j≥i} Π_{l≤j, l≠i} α_l``, then Bebop eq. 11 per position, so memory is
      that of :func:`tv_loss`.

    References: Bebop §4.2 eq. 12–13.
    """
    z = jnp.asarray(draft_logits)
    if z.ndim < 2:
        raise ValueError(f"draft_logits must be [..., γ, V], got shape {z.shape}")
    mask = _position_mask(where, z.shape[:-1])
    tv = tv_loss(z, target_probs, where=mask, chunk_size=chunk_size)
    return e2e_tv_from_tv(tv, where=mask)
