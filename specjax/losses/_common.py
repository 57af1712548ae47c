"""Shared argument checks and masking of the loss functions (``specjax.losses``)."""
from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

ArrayLike = Union[jax.Array, np.ndarray, float]


def _check_float(name: str, x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}")


def _compute_dtype(*xs: jax.Array):
    """float32 at least: bf16 logits / probs are upcast inside the (fused) computation."""
    return jnp.result_type(jnp.float32, *[x.dtype for x in xs])


def _check_same_shape(a: jax.Array, b: jax.Array, an: str, bn: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{an} {a.shape} and {bn} {b.shape} must have the same shape")


def _position_mask(where: Optional[ArrayLike], shape: tuple,
                   name: str = "where") -> Optional[jax.Array]:
    """``where`` broadcast to the per-position shape (bool), or None."""
    if where is None:
        return None
    w = jnp.asarray(where)
    if w.dtype != jnp.bool_:
        raise TypeError(f"{name} must be a boolean array, got dtype {w.dtype}")
    try:
        return jnp.broadcast_to(w, shape)
    except ValueError:
        raise ValueError(
            f"{name} of shape {w.shape} does not broadcast to the per-position shape {shape} "
            "(it masks positions, not vocabulary entries)"
        ) from None


def _masked(loss: jax.Array, mask: Optional[jax.Array]) -> jax.Array:
    return loss if mask is None else jnp.where(mask, loss, jnp.zeros((), loss.dtype))


def _vocab_last(x: jax.Array, axis: int) -> jax.Array:
    axis = axis % x.ndim if x.ndim else 0
    return x if axis == x.ndim - 1 else jnp.moveaxis(x, axis, -1)
