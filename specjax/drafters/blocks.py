"""Attention pieces shared by the neural drafters (reusing the target's :class:`Block`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange

from specjax.models.attention import kv_windows, window_switch
from specjax.models.layers import apply_rope
from specjax.models.transformer import Block, grouped_attention

_NEG_INF = -1e30


def block_forward(layer: Block, x: jax.Array, positions: jax.Array, inv_freq: jax.Array, attend,
                  queries: int | None = None):
    """One pre-norm block with a custom attention: ``attend(q, k, v) -> out``.

    ``x [B, T, D]``, ``positions int32 [B, T]``; q ``[B, Q, H, Dh]``, k/v ``[B, T, KVH, Dh]``
    (RoPE'd at ``positions``). ``queries``: only the last Q = ``queries`` positions are queries
    (default all T): every position's keys / values are still computed (for a cache), but the
    query projection, attention output and MLP run on the last Q, and the block returns
    ``[B, Q, D]``, equal to those positions of the full block's output.
    """
    h = layer.input_norm(x)
    if queries is None:
        q, k, v = layer.attn.project(h, positions, inv_freq)
    else:
        q = layer.attn.project(h[:, -queries:], positions[:, -queries:], inv_freq)[0]
        k, v = project_kv(layer, h, positions, inv_freq)
        x = x[:, -queries:]
    x = x + layer.attn.output(attend(q, k, v))
    return x + layer.mlp(layer.post_attn_norm(x))


def project_kv(layer: Block, x: jax.Array, positions: jax.Array, inv_freq: jax.Array):
    """Keys / values of ``x [B, T, D]`` under ``layer``'s attention (no input norm; the k path of
    ``layer.attn.project``): the DFlash context injection ``K = W_K H_ctx, V = W_V H_ctx`` (with
    the layer's k-norm and RoPE)."""
    attn = layer.attn
    dt = x.dtype
    k = jnp.einsum("btd,dhk->bthk", x, attn.k_proj[...].astype(dt))
    v = jnp.einsum("btd,dhk->bthk", x, attn.v_proj[...].astype(dt))
    if attn.k_norm is not None:
        k = attn.k_norm(k)
    return apply_rope(k, positions, inv_freq), v


def causal_self_attention(q, k, v, positions):
    """Causal attention by position inside one sequence (no cache); ``positions [B, T]``."""
    mask = positions[:, None, :] <= positions[:, :, None]
    return grouped_attention(q, k, v, mask)


def cached_attention(q, k, v, positions, cache_k, cache_v, write_positions):
    """Writes ``k, v`` at ``write_positions`` (out-of-range = dropped) into one layer's cache
    ``[B, S, KVH, Dh]`` and attends causally by position to the cache.

    Reads only the smallest window bucket (:func:`~specjax.models.attention.kv_windows`) that
    covers the latest query position of the batch, so a draft step's cost follows the context,
    not the cache size. Returns ``(out [B, T, H, Dh], cache_k, cache_v)``. Queries with no
    visible key give zeros.
    """
    b, s = cache_k.shape[:2]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], write_positions.shape)
    cache_k = cache_k.at[rows, write_positions].set(k.astype(cache_k.dtype), mode="drop")
    cache_v = cache_v.at[rows, write_positions].set(v.astype(cache_v.dtype), mode="drop")
    need = jnp.max(positions) + 1

    def branch(w):
        def run(ck, cv):
            ck = jax.lax.slice_in_dim(ck, 0, w, axis=1)
            cv = jax.lax.slice_in_dim(cv, 0, w, axis=1)
            mask = jnp.arange(w, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
            return grouped_attention(q, ck.astype(q.dtype), cv.astype(q.dtype), mask)
        return run

    out = window_switch(need, kv_windows(s), branch, cache_k, cache_v)
    return out, cache_k, cache_v


def context_block_attention(q, k_ctx, v_ctx, ctx_mask, k_blk, v_blk):
    """DFlash-style attention of draft blocks: each block's queries see the injected context keys
    allowed by ``ctx_mask`` and every key of their own block (bidirectional).

    Args:
      q: ``[B, A, G, H, Dh]`` queries of A blocks of G tokens.
      k_ctx, v_ctx: ``[B, S, KVH, Dh]`` context keys / values (shared by the blocks of a row).
      ctx_mask: bool ``[B, A, S]``: context key s visible to block a.
      k_blk, v_blk: ``[B, A, G, KVH, Dh]`` the blocks' own keys / values.
    Returns:
      ``[B, A, G, H, Dh]`` in q's dtype (softmax in f32 over context + block keys jointly).
    """
    dh = q.shape[-1]
    kvh = k_ctx.shape[2]
    # GQA: query head k * (H / KVH) + r reads key/value head k.
    qg = rearrange(q, "b a g (k r) d -> b a g k r d", k=kvh)
    scale = dh ** -0.5
    sc = jnp.einsum("bagkhd,bskd->bakhgs", qg, k_ctx.astype(q.dtype),
                    preferred_element_type=jnp.float32) * scale
    sc = jnp.where(ctx_mask[:, :, None, None, None, :], sc, _NEG_INF)
    sb = jnp.einsum("bagkhd,bajkd->bakhgj", qg, k_blk.astype(q.dtype),
                    preferred_element_type=jnp.float32) * scale
    probs = jax.nn.softmax(jnp.concatenate([sc, sb], axis=-1), axis=-1)
    s = k_ctx.shape[1]
    pc = jnp.where(ctx_mask[:, :, None, None, None, :], probs[..., :s], 0.0)
    pb = probs[..., s:]
    out = jnp.einsum("bakhgs,bskd->bagkhd", pc.astype(v_ctx.dtype), v_ctx.astype(q.dtype),
                     preferred_element_type=jnp.float32)
    out = out + jnp.einsum("bakhgj,bajkd->bagkhd", pb.astype(v_blk.dtype), v_blk.astype(q.dtype),
                           preferred_element_type=jnp.float32)
    return rearrange(out, "b a g k r d -> b a g (k r) d").astype(q.dtype)
