"""Qwen3 / Llama-family decoder-only transformer in ``flax.nnx``.

One forward path serves every mode the project needs:

* **train / score** (``cache=None``): ``tokens [B, T]``, causal attention, optionally restricted to
  packed documents by ``segment_ids [B, T]`` with per-document ``positions``.
* **prefill / decode / verify** (``cache`` given, rows = cache slots): the T new tokens of row b go
  to positions ``cache.lengths[b] + t``. Prefill is T = prompt chunk, decode is T = 1, verify is
  T = K + 1 (last emitted token + K drafts). ``num_valid [B]`` says how many of the T tokens of each
  row are real (rows of different lengths in one batch); the returned cache has
  ``lengths + num_valid``. Rejected drafts are rolled back with ``cache.rollback(lengths)``.
* **flat** (:meth:`Transformer.forward_flat`): tokens of many slots packed in one 1-D batch with a
  segment id (slot) and a position per token, for the serving engine's bucketed verification.

Logits are returned in float32 whatever the compute dtype. The hidden states of chosen layers can be
returned (``hidden_layers``; index 0 is the embedding output, i the output of block i, before the
final norm), which is what drafters condition on.

Functional use at a jit boundary (flax performance guide)::

    graphdef, state = nnx.split(model)
    out = apply(graphdef, state, tokens, cache=cache)     # jit / donate around this
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.config import ModelConfig
from specjax.models.attention import (attention_weights_mask, block_cached_attention,
                                      grouped_attention, kv_windows, windowed_attention, write_kv)
from specjax.models.kv_cache import KVCache, NewKV
from specjax.models.partitioning import constrain_batch
from specjax.models.layers import RMSNorm, apply_rope, param, rope_inv_freq

class ForwardOutput(NamedTuple):
    """Result of a forward pass.

    logits: f32 ``[B, T, V]``.
    cache: updated :class:`KVCache` (``None`` without a cache).
    hidden: ``[len(hidden_layers), B, T, D]`` in the compute dtype, or ``None``.
    """

    logits: jax.Array
    cache: Optional[KVCache]
    hidden: Optional[jax.Array]


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        wd = c.weight_dtype
        self.config = c
        self.q_proj = param(rngs, (c.hidden_size, c.num_heads, c.head_dim),
                            ("embed", "heads", "head_dim"), wd)
        self.k_proj = param(rngs, (c.hidden_size, c.num_kv_heads, c.head_dim),
                            ("embed", "kv_heads", "head_dim"), wd)
        self.v_proj = param(rngs, (c.hidden_size, c.num_kv_heads, c.head_dim),
                            ("embed", "kv_heads", "head_dim"), wd)
        self.o_proj = param(rngs, (c.num_heads, c.head_dim, c.hidden_size),
                            ("heads", "head_dim", "embed"), wd)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, wd, rngs=rngs, axis_name="head_dim")
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, wd, rngs=rngs, axis_name="head_dim")
        else:
            self.q_norm = None
            self.k_norm = None

    def project(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array):
        """Returns RoPE'd ``q [B,T,H,Dh]``, ``k, v [B,T,KVH,Dh]`` for ``x [B,T,D]``."""
        dt = x.dtype
        q = jnp.einsum("btd,dhk->bthk", x, self.q_proj[...].astype(dt))
        k = jnp.einsum("btd,dhk->bthk", x, self.k_proj[...].astype(dt))
        v = jnp.einsum("btd,dhk->bthk", x, self.v_proj[...].astype(dt))
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def output(self, attn: jax.Array) -> jax.Array:
        return jnp.einsum("bthk,hkd->btd", attn, self.o_proj[...].astype(attn.dtype))


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        self.gate_proj = param(rngs, (c.hidden_size, c.intermediate_size), ("embed", "mlp"),
                               c.weight_dtype)
        self.up_proj = param(rngs, (c.hidden_size, c.intermediate_size), ("embed", "mlp"),
                             c.weight_dtype)
        self.down_proj = param(rngs, (c.intermediate_size, c.hidden_size), ("mlp", "embed"),
                               c.weight_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = x.dtype
        gate = x @ self.gate_proj[...].astype(dt)
        up = x @ self.up_proj[...].astype(dt)
        return (jax.nn.silu(gate) * up) @ self.down_proj[...].astype(dt)


class Block(nnx.Module):
    """Pre-norm transformer block: x + Attn(norm(x)); x + MLP(norm(x))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        wd = config.weight_dtype
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, wd, rngs=rngs)
        self.attn = Attention(config, rngs=rngs)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, wd, rngs=rngs)
        self.mlp = MLP(config, rngs=rngs)


def embed_lookup(embed: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
    """Embedding rows of ``tokens int [B, ...]`` from ``embed [V, D]``: ``[B, ..., D]`` in
    ``dtype``. The batch stays split on a mesh (``specjax.models.partitioning``: under FSDP the
    partitioner would otherwise keep the table's sharding of ``D`` and replicate the batch)."""
    return constrain_batch(jnp.take(embed, tokens, axis=0).astype(dtype))


def head_logits(h: jax.Array, embed: jax.Array, lm_head: Optional[jax.Array]) -> jax.Array:
    """LM head: ``h [B, ..., D]`` -> float32 ``[B, ..., V]`` through ``lm_head [D, V]``, or the
    tied ``embed [V, D]`` when ``lm_head`` is None; the batch stays split on a mesh."""
    if lm_head is None:
        logits = jnp.einsum("...d,vd->...v", h, embed.astype(h.dtype),
                            preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("...d,dv->...v", h, lm_head.astype(h.dtype),
                            preferred_element_type=jnp.float32)
    return constrain_batch(logits)


def _rows_at(x: jax.Array, index: Optional[jax.Array]) -> jax.Array:
    """``x [B, T, D]`` at ``index int [B]`` of each row as ``[B, 1, D]`` (all of x if None)."""
    if index is None:
        return x
    return jnp.take_along_axis(x, jnp.asarray(index, jnp.int32)[:, None, None], axis=1)


class Transformer(nnx.Module):
    """Decoder-only Qwen3 / Llama model. See the module docstring for the forward modes."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.embed = param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"),
                           c.weight_dtype)
        self.layers = nnx.List([Block(c, rngs=rngs) for _ in range(c.num_layers)])
        self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.weight_dtype, rngs=rngs)
        self.lm_head = None if c.tie_embeddings else param(
            rngs, (c.hidden_size, c.vocab_size), ("embed", "vocab"), c.weight_dtype)

    # -- pieces reused by drafters -------------------------------------------------------------
    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """``int [...]`` -> ``[..., D]`` in the compute dtype."""
        return embed_lookup(self.embed[...], tokens, self.config.compute_dtype)

    def lm_logits(self, h: jax.Array, *, normed: bool = False) -> jax.Array:
        """Final norm (unless ``normed``) and LM head: ``[..., D]`` -> f32 ``[..., V]``."""
        if not normed:
            h = self.final_norm(h)
        return head_logits(h, self.embed[...], None if self.lm_head is None else self.lm_head[...])

    def inv_freq(self) -> jax.Array:
        c = self.config
        return rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)

    # -- forward -------------------------------------------------------------------------------
    def __call__(self, tokens: jax.Array, *, cache: Optional[KVCache] = None,
                 positions: Optional[jax.Array] = None, segment_ids: Optional[jax.Array] = None,
                 num_valid: Optional[jax.Array] = None,
                 hidden_layers: Sequence[int] = (),
                 logits_at: Optional[jax.Array] = None) -> ForwardOutput:
        """Runs the model.

        Args:
          tokens: ``int32 [B, T]``.
          cache: optional :class:`KVCache` with ``num_slots == B``.
          positions: ``int32 [B, T]``; without a cache defaults to ``arange(T)`` (pass
            per-document positions for packed rows); with a cache it is always
            ``cache.lengths[:, None] + arange(T)`` and must not be given.
          segment_ids: ``int32 [B, T]`` document ids of packed rows (no cache only).
          num_valid: ``int32 [B]`` real tokens per row (cache only; default T).
          hidden_layers: which hidden states to return (0 = embeddings, i = after block i).
          logits_at: optional ``int32 [B]``: the LM head runs at this index of each row only,
            and ``logits`` is ``[B, 1, V]`` (a prompt chunk needs the last real position's
            logits alone; the head over ``[B, T, V]`` would be most of the work at a large V).
        """
        c = self.config
        tokens = jnp.asarray(tokens, jnp.int32)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
        b, t = tokens.shape
        for i in hidden_layers:
            if not 0 <= i <= c.num_layers:
                raise ValueError(f"hidden layer {i} outside [0, {c.num_layers}]")
        if cache is not None:
            if positions is not None or segment_ids is not None:
                raise ValueError("positions/segment_ids are implied by the cache in cached mode")
            if cache.num_slots != b:
                raise ValueError(f"batch {b} != cache slots {cache.num_slots}")
            if cache.num_layers != c.num_layers:
                raise ValueError(f"cache has {cache.num_layers} layers, model {c.num_layers}")
            positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
            if num_valid is None:
                num_valid = jnp.full((b,), t, jnp.int32)
        else:
            if num_valid is not None:
                raise ValueError("num_valid is only meaningful with a cache")
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        positions = jnp.asarray(positions, jnp.int32)

        if cache is None:
            seg = segment_ids
            mask = attention_weights_mask(positions, positions, seg, seg)
            if seg is None:  # plain causal by index (positions may repeat across packed docs)
                idx = jnp.arange(t)
                mask = jnp.broadcast_to(idx[None, :] <= idx[:, None], (b, t, t))

            def attend(i, q, k, v, carry):
                return grouped_attention(q, k, v, mask), carry

            x, _, hid = self._run_layers(tokens, positions, attend, hidden_layers, None)
            return ForwardOutput(logits=self.lm_logits(_rows_at(x, logits_at)), cache=None,
                                 hidden=hid)

        # Cached: write this call's keys/values in place, attend over the smallest window bucket
        # that holds every row's last real query (padding rows/tokens past num_valid excluded).
        rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
        real = jnp.arange(t, dtype=jnp.int32)[None, :] < num_valid[:, None]
        need = jnp.max(jnp.where(real, positions + 1, 1))
        windows = kv_windows(cache.max_len)

        def attend(i, q, k, v, carry):
            k_all, v_all = write_kv(*carry, i, rows, positions, k, v)
            out = windowed_attention(q, positions, k_all, v_all, i, windows, need)
            return out, (k_all, v_all)

        x, (k_all, v_all), hid = self._run_layers(tokens, positions, attend, hidden_layers,
                                                  (cache.k, cache.v))
        new_cache = KVCache(k=k_all, v=v_all,
                            lengths=cache.lengths + num_valid.astype(jnp.int32))
        return ForwardOutput(logits=self.lm_logits(_rows_at(x, logits_at)), cache=new_cache,
                             hidden=hid)

    def _run_layers(self, tokens, positions, attend, hidden_layers, carry):
        """Embeds and runs every block; ``attend(i, q, k, v, carry) -> (out, carry)`` is the mode
        (``carry``: the layered cache arrays being written, or None).

        Returns the last block's output, the final ``carry`` and the stacked hidden states
        requested (or None).
        """
        inv_freq = self.inv_freq()
        x = self.embed_tokens(tokens)
        hidden = {0: x}
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attn.project(layer.input_norm(x), positions, inv_freq)
            attn, carry = attend(i, q, k, v, carry)
            x = x + layer.attn.output(attn)
            x = x + layer.mlp(layer.post_attn_norm(x))
            if i + 1 in hidden_layers:
                hidden[i + 1] = x
        hid = jnp.stack([hidden[i] for i in hidden_layers]) if hidden_layers else None
        return x, carry, hid

    def forward_flat(self, tokens: jax.Array, segment_ids: jax.Array, cache: KVCache, *,
                     grid_len: int, hidden_layers: Sequence[int] = ()) -> ForwardOutput:
        """Flattened ragged forward for bucketed verification (DSpark §5.3 "marker tensor").

        The tokens of many slots are packed in one 1-D batch: token n belongs to slot
        ``segment_ids[n]`` (``>= num_slots`` marks padding) and sits at position
        ``cache.lengths[slot] + j`` where j is its rank among that slot's tokens (tokens of one
        slot are contiguous and in order). Dense work (projections, MLP, LM head) runs on the
        flat ``[N]`` tokens, so its cost follows N; for attention the queries are laid out on a
        ``[slots, grid_len]`` grid and attend to the used window of each slot's cache row
        (:func:`~specjax.models.attention.windowed_attention`), then gathered back. Keys/values
        are written in place at ``(layer, slot, position)`` before attending. Cache lengths are
        NOT advanced: the caller commits ``lengths`` after verification (rollback by lengths).

        Args:
          tokens: ``int32 [N]`` packed tokens (N is the bucket size).
          segment_ids: ``int32 [N]`` slot of each token; padding uses any value ``>= num_slots``.
          cache: the slots' cache.
          grid_len: static bound on tokens per slot in this call (e.g. 1 + max draft length).
          hidden_layers: as in ``__call__``.
        Returns:
          ForwardOutput with logits f32 ``[N, V]``, the written cache, hidden ``[n, N, D]``.
        """
        out, _ = self._flat(tokens, segment_ids, cache, grid_len, hidden_layers, write=True)
        return out

    def forward_flat_kv(self, tokens: jax.Array, segment_ids: jax.Array, cache: KVCache, *,
                        grid_len: int, hidden_layers: Sequence[int] = ()
                        ) -> tuple[ForwardOutput, "NewKV"]:
        """:meth:`forward_flat` that only *reads* the cache: each slot's tokens attend to its
        committed positions plus the slot's own new tokens
        (:func:`~specjax.models.attention.block_cached_attention`).

        Returns ``(ForwardOutput with cache=None, NewKV)``: the new keys/values still to be
        written (:meth:`~specjax.models.kv_cache.NewKV.write`). For a caller inside a
        ``lax.switch`` (the device loop's verification buckets): a branch that writes the cache
        makes XLA copy the whole cache in and out of the conditional. Outside a conditional, use :meth:`forward_flat`: there
        XLA:CPU copies the cache when it is read and then written in the same program.
        """
        return self._flat(tokens, segment_ids, cache, grid_len, hidden_layers, write=False)

    def _flat(self, tokens, segment_ids, cache: KVCache, grid_len: int, hidden_layers,
              *, write: bool):
        """Both flat modes; returns ``(ForwardOutput, NewKV or None)``."""
        tokens = jnp.asarray(tokens, jnp.int32)
        seg = jnp.asarray(segment_ids, jnp.int32)
        if tokens.ndim != 1 or seg.shape != tokens.shape:
            raise ValueError(f"tokens and segment_ids must be equal 1-D shapes, got "
                             f"{tokens.shape} and {seg.shape}")
        s, n = cache.num_slots, tokens.shape[0]
        valid = seg < s
        seg_c = jnp.where(valid, seg, 0)
        # Rank of each token inside its (contiguous) segment: distance to the run's start.
        idx = jnp.arange(n, dtype=jnp.int32)
        is_start = jnp.concatenate([jnp.ones((1,), bool), seg[1:] != seg[:-1]])
        rank = idx - jax.lax.cummax(jnp.where(is_start, idx, 0))
        positions = jnp.where(valid, cache.lengths[seg_c] + rank, cache.max_len)
        grid_slot = jnp.where(valid & (rank < grid_len), seg_c, s)  # s = dropped
        q_pos_grid = cache.lengths[:, None] + jnp.arange(grid_len, dtype=jnp.int32)[None, :]
        # grid_src[s, j]: the flat entry holding token j of slot s (n = N: none). One scatter of
        # indices here; each layer then gathers its grid rows (cheaper than a scatter per layer).
        grid_src = jnp.full((s, grid_len), n, jnp.int32).at[grid_slot, rank].set(idx, mode="drop")
        grid_valid = grid_src < n
        windows = kv_windows(cache.max_len)

        def to_grid(x):  # [N, ...] -> [S, grid_len, ...] (zeros where no token)
            return jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])[grid_src]

        if write:
            need = jnp.max(jnp.where(valid, positions + 1, 1))

            def attend(i, q, k, v, carry):  # q, k, v: [1, N, heads, Dh]
                k_all, v_all = write_kv(*carry, i, seg_c, positions, k[0], v[0])
                out = windowed_attention(to_grid(q[0]), q_pos_grid, k_all, v_all, i, windows,
                                         need)
                return out.at[grid_slot, rank].get(mode="fill", fill_value=0)[None], (k_all, v_all)
            carry = (cache.k, cache.v)
        else:
            def attend(i, q, k, v, carry):
                out = block_cached_attention(to_grid(q[0]), q_pos_grid, to_grid(k[0]),
                                             to_grid(v[0]), grid_valid, cache.k, cache.v, i,
                                             windows, cache.lengths)
                flat = out.at[grid_slot, rank].get(mode="fill", fill_value=0)
                return flat[None], carry + ((k[0], v[0]),)
            carry = ()

        x, carry, hid = self._run_layers(tokens[None], positions[None], attend, hidden_layers,
                                         carry)
        out = ForwardOutput(logits=self.lm_logits(x[0]), cache=None,
                            hidden=None if hid is None else hid[:, 0])
        if write:
            return out._replace(cache=cache.replace(k=carry[0], v=carry[1])), None
        new_kv = NewKV(k=jnp.stack([k for k, _ in carry]), v=jnp.stack([v for _, v in carry]),
                       slots=seg_c, positions=positions)
        return out, new_kv


def apply(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, **kwargs) -> ForwardOutput:
    """Pure functional forward: ``nnx.merge`` then call. Wrap in ``jax.jit`` at the boundary."""
    return nnx.merge(graphdef, state)(tokens, **kwargs)


def apply_flat(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array,
               segment_ids: jax.Array, cache: KVCache, *, grid_len: int,
               hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
    """Pure functional :meth:`Transformer.forward_flat`."""
    return nnx.merge(graphdef, state).forward_flat(tokens, segment_ids, cache, grid_len=grid_len,
                                                   hidden_layers=hidden_layers)


# Jitted forms (no donation): convenient for scoring and tests. Static: graphdef, hidden_layers.
apply_jit = jax.jit(apply, static_argnames=("graphdef", "hidden_layers"))
apply_flat_jit = jax.jit(apply_flat, static_argnames=("graphdef", "grid_len", "hidden_layers"))


@functools.partial(jax.jit, static_argnames=("graphdef", "hidden_layers"),
                   donate_argnames=("cache",))
def cached_forward(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, cache: KVCache,
                   num_valid: Optional[jax.Array] = None,
                   hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
    """Jitted cached forward (prefill / decode / verify) that donates the cache buffers."""
    return apply(graphdef, state, tokens, cache=cache, num_valid=num_valid,
                 hidden_layers=hidden_layers)


def init_model(config: ModelConfig, seed: int = 0) -> Transformer:
    """Builds a randomly initialised model (normal(0, 0.02) weights, unit norms)."""
    return Transformer(config, rngs=nnx.Rngs(params=seed))
