"""Building blocks of the Qwen3 / Llama decoder: RMSNorm, RoPE, dense kernels with logical axes.

Every parameter carries ``logical_axes`` metadata (a tuple of names, one per dimension). The one
table that maps these names to mesh axes lives in :mod:`specjax.training.sharding`. Names used:

  vocab, embed, heads, kv_heads, head_dim, mlp, norm
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.config import RopeScaling


def param(rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str], dtype, *, std: float = 0.02,
          init: str = "normal") -> nnx.Param:
    """Creates a parameter with ``logical_axes`` metadata (normal(0, std) or ones)."""
    if len(shape) != len(axes):
        raise ValueError(f"shape {shape} and logical axes {axes} differ in rank")
    if init == "ones":
        value = jnp.ones(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=tuple(axes))


class RMSNorm(nnx.Module):
    """RMSNorm as in Llama / Qwen3: statistics in f32, scale applied in the input dtype."""

    def __init__(self, dim: int, eps: float, dtype, *, rngs: nnx.Rngs, axis_name: str = "norm"):
        self.eps = eps
        self.scale = param(rngs, (dim,), (axis_name,), dtype, init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * xf.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[RopeScaling] = None) -> jax.Array:
    """Inverse frequencies ``[head_dim // 2]`` (f32), with optional Llama-3 scaling.

    Llama-3 scaling (HF ``_compute_llama3_parameters``): wavelengths longer than
    ``orig / low_freq_factor`` are divided by ``factor``; shorter than ``orig / high_freq_factor``
    are kept; in between they are interpolated smoothly.
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    orig = scaling.original_max_position_embeddings
    low_wavelen = orig / scaling.low_freq_factor
    high_wavelen = orig / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (orig / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding in the HF "rotate_half" convention.

    Args:
      x: ``[B, T, heads, head_dim]``.
      positions: ``int32 [B, T]``.
      inv_freq: ``f32 [head_dim // 2]``.
    """
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
