"""Activation memory of the target's training step: per-block remat and a chunked vocabulary loss.

Two things dominate the activation memory of a large-vocabulary decoder's train step:

* the per-block activations kept for the backward pass (``L`` blocks x several ``[B, T, D]`` /
  ``[B, T, F]`` tensors), and
* the f32 logits ``[B, T, V]`` (V = 151,936 for Qwen3: 0.6 MB per token) and their gradient.

:func:`hidden_states` runs the blocks with ``jax.checkpoint`` around each one under a named policy
(``config.train.remat``), and :func:`chunked_lm_loss` computes the cross-entropy over chunks of the
sequence, recomputing each chunk's logits in the backward pass, so at most one ``[B, Tc, V]``
block of logits is alive at a time (``config.train.logits_chunk = Tc``).

:func:`hidden_states` mirrors :meth:`specjax.models.Transformer.__call__` in training mode (no
cache) block for block; ``tests/test_training_memory.py`` checks that both give the same logits and
gradients, so the two cannot drift apart silently.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.transformer import Transformer, attention_weights_mask, grouped_attention

# config.train.remat values -> jax.checkpoint policies ("none" = no checkpointing).
REMAT_POLICIES = {
    "none": None,
    # Save nothing inside a block: recompute the whole block in the backward pass (least memory,
    # about one extra forward of FLOPs).
    "full": jax.checkpoint_policies.nothing_saveable,
    # Save the outputs of matmuls without batch dimensions (the projections and MLP), recompute
    # the elementwise ops and attention (the usual compromise on TPU).
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Save every matmul output, attention's batched ones included.
    "all_dots": jax.checkpoint_policies.checkpoint_dots,
}


def _mask(tokens: jax.Array, positions: jax.Array, segment_ids: Optional[jax.Array]):
    """The training-mode attention mask of :meth:`Transformer.__call__` (bool ``[B, T, T]``)."""
    b, t = tokens.shape
    if segment_ids is None:  # plain causal by index (positions may repeat across packed docs)
        idx = jnp.arange(t)
        return jnp.broadcast_to(idx[None, :] <= idx[:, None], (b, t, t))
    return attention_weights_mask(positions, positions, segment_ids, segment_ids)


def _block(layer, x, positions, inv_freq, mask):
    q, k, v = layer.attn.project(layer.input_norm(x), positions, inv_freq)
    x = x + layer.attn.output(grouped_attention(q, k, v, mask))
    return x + layer.mlp(layer.post_attn_norm(x))


def hidden_states(model: Transformer, tokens: jax.Array, *, positions: Optional[jax.Array] = None,
                  segment_ids: Optional[jax.Array] = None, remat: str = "none") -> jax.Array:
    """The last block's output (before the final norm) of a training-mode forward.

    Args:
      model: the transformer.
      tokens: int32 ``[B, T]``; positions / segment_ids: ``[B, T]`` as in
        :meth:`Transformer.__call__`.
      remat: a key of :data:`REMAT_POLICIES`.
    Returns:
      ``[B, T, D]`` in the compute dtype.
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}, got {remat!r}")
    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    positions = jnp.asarray(positions, jnp.int32)
    mask = _mask(tokens, positions, segment_ids)
    inv_freq = model.inv_freq()
    x = model.embed_tokens(tokens)
    for layer in model.layers:
        if remat == "none":
            x = _block(layer, x, positions, inv_freq, mask)
            continue
        graphdef, state = nnx.split(layer)

        def run(state, x, graphdef=graphdef):
            return _block(nnx.merge(graphdef, state), x, positions, inv_freq, mask)

        x = jax.checkpoint(run, policy=REMAT_POLICIES[remat])(state, x)
    return x


def _chunk_stats(h, targets, mask, head_fn):
    """Sums over one chunk: ``(ce, lse^2, correct)`` each weighted by ``mask``."""
    logits = head_fn(h)  # f32 [B, Tc, V]
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    return ((lse - tgt) * mask).sum(), ((lse ** 2) * mask).sum(), (correct * mask).sum()


def chunked_lm_loss(model: Transformer, h: jax.Array, targets: jax.Array, loss_mask=None, *,
                    chunk: int, z_loss: float = 0.0):
    """:func:`specjax.training.lm_task.lm_loss` of ``model.lm_logits(h)``, over sequence chunks.

    The sequence is cut into ``ceil(T / chunk)`` chunks of ``chunk`` positions (the tail padded
    with ``loss_mask = 0``); a ``lax.scan`` over them computes each chunk's logits inside
    ``jax.checkpoint``, so the backward pass recomputes them chunk by chunk: the peak holds one
    ``[B, chunk, V]`` f32 block instead of ``[B, T, V]``. The batch axis stays whole in each chunk,
    so a batch sharded over the mesh stays sharded.

    Args:
      model: supplies the final norm and the (tied or separate) LM head.
      h: ``[B, T, D]`` from :func:`hidden_states`; targets: int ``[B, T]``; loss_mask: ``[B, T]``.
      chunk: positions per chunk (> 0).
    Returns:
      ``(loss, metrics)`` exactly as :func:`~specjax.training.lm_task.lm_loss`.
    """
    from specjax.training.tasks import LOSS_WEIGHT

    if chunk <= 0:
        raise ValueError(f"chunk must be > 0, got {chunk}")
    b, t, d = h.shape
    mask = jnp.ones((b, t), jnp.float32) if loss_mask is None else loss_mask.astype(jnp.float32)
    targets = targets.astype(jnp.int32)
    n = -(-t // chunk)
    pad = n * chunk - t
    if pad:
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        mask = jnp.pad(mask, ((0, 0), (0, pad)))
    split = lambda x: jnp.moveaxis(x.reshape((b, n, chunk) + x.shape[2:]), 1, 0)
    graphdef, state = nnx.split(model)

    @jax.checkpoint
    def body_stats(state, hc, tc, mc):
        m = nnx.merge(graphdef, state)
        return _chunk_stats(hc, tc, mc, m.lm_logits)

    def body(carry, xs):
        stats = body_stats(state, *xs)
        return jax.tree.map(jnp.add, carry, stats), None

    zero = jnp.zeros((), jnp.float32)
    (ce_sum, z_sum, correct_sum), _ = jax.lax.scan(
        body, (zero, zero, zero), (split(h), split(targets), split(mask)))
    weight = mask.sum()
    denom = jnp.maximum(weight, 1.0)
    ce, zl = ce_sum / denom, z_loss * z_sum / denom
    metrics = {"ce": ce, "z_loss": zl, "accuracy": correct_sum / denom, LOSS_WEIGHT: weight}
    return ce + zl, metrics
