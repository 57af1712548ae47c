"""The policy as the RL learner sees it: a thin nnx adapter over specjax's :class:`Transformer`.

Tunix's learner calls ``model(tokens, positions=, attention_mask=, cache=None) -> (logits, cache)``
with left-padded prompts next to right-padded completions, per-token ``positions`` that skip the
padding, and the mask ``causal & key_is_real`` (``attention_mask[b, i, j] = j <= i and token j is
not padding``). The adapter holds the Transformer as a submodule, so there is one copy of the
weights with the Transformer's own parameter names and logical sharding axes; the serving engine
runs on ``nnx.state(policy.model)``.

The mask is reduced to per-token segment ids (1 = real, 0 = padding: the mask's diagonal) and the
given positions, which the Transformer attends with as ``same segment & key position <= query
position``. For every real query this is exactly Tunix's mask (positions increase strictly over
the real tokens). Padding queries attend to padding instead of to earlier real tokens; their
outputs are never scored.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.transformer import Transformer

__all__ = ["TunixPolicy"]


class TunixPolicy(nnx.Module):
    """``TunixPolicy(transformer)``: Tunix's model calling convention over a specjax target."""

    def __init__(self, model: Transformer):
        if not isinstance(model, Transformer):
            raise TypeError(f"TunixPolicy wraps a specjax Transformer, got {type(model).__name__}")
        self.model = model

    @property
    def config(self):
        return self.model.config

    def __call__(self, tokens: jax.Array, positions: Optional[jax.Array] = None,
                 attention_mask: Optional[jax.Array] = None, cache=None):
        """Args: ``tokens`` int ``[B, T]``; ``positions`` int ``[B, T]`` (default ``arange``);
        ``attention_mask`` bool ``[B, T, S >= T]`` (Tunix's ``causal & key_is_real``; default
        plain causal). Returns ``(logits f32 [B, T, V], None)``."""
        if cache is not None:
            raise ValueError("TunixPolicy scores whole sequences: cache must be None (decoding "
                             "runs in the specjax engine)")
        tokens = jnp.asarray(tokens, jnp.int32)
        t = tokens.shape[1]
        segment_ids = None
        if attention_mask is not None:
            m = jnp.asarray(attention_mask)
            if m.ndim != 3 or m.shape[1] != t or m.shape[2] < t:
                raise ValueError(f"attention_mask must be [B, {t}, S >= {t}], got {m.shape}")
            segment_ids = jnp.diagonal(m[:, :, :t], axis1=1, axis2=2).astype(jnp.int32)
            if positions is None:
                positions = jnp.maximum(jnp.cumsum(segment_ids, axis=1) - 1, 0)
        out = self.model(tokens, positions=positions, segment_ids=segment_ids)
        return out.logits, None
