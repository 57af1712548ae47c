"""Multi-token-prediction (MTP) heads, DeepSeek-V3 / Qwen style (Bebop §2.1).

Architecture. Chain depth k (1-based) at sequence position j combines the previous depth's hidden
state and the embedding of token ``t_{j+k}``::

    x^k_j = W_k [RMSNorm(h^{k-1}_j); RMSNorm(emb(t_{j+k}))]        (W_k: 2d -> d)
    h^k_j = Block_k(x^k_{<=j})                                      (one causal transformer block)
    q^k_j = softmax(LMHead(RMSNorm_k(h^k_j)))                       predicts t_{j+k+1}

``h^0`` is a chosen target hidden state (default: the output of the target's last block, before
its final norm). The embedding and LM head are the target's, frozen and passed in
(:class:`~specjax.drafters.base.SharedHead`); the drafter owns the norms, ``W_k``, the block and
the output norm of each head. ``num_heads`` heads with separate parameters, or one shared head
(``shared=True``); a chain deeper than the number of heads reuses the last head recursively.

Inference. With ``n`` emitted tokens (target context through position ``n - 2``, anchor
``t_{n-1}``), draft k is depth k at position ``n - 2`` with input token ``t_{n-2+k}`` (the anchor for
k = 1, the previous draft ``x_{k-1}`` after that): each head consumes the previous head's hidden
state and the token it drafted.

What it sees / caches. Each depth's block attends causally over *its own* sequence, as in
DeepSeek-V3, so each chain depth has its own KV cache (one layer; depths share a cache only in
shape). A depth-k entry at position j is a function of the tokens through ``t_{j+k}`` and the
target hidden states through ``h^0_j``: with ``n`` emitted tokens it is *final* for
``j <= n - 1 - k``; the last ``k - 1`` positions before the query depend on drafts. Every
``propose`` recomputes a window of the last ``W`` positions at every depth, writing their
keys/values before attending, so that no cache entry is ever read stale and no rollback is needed.
``W = max(K + 1, γ)`` (K = most drafts verified per step, default γ) is the smallest window that
does this: after a step that emitted ``m <= K + 1`` tokens, the entries left to (re)write at depth
k are the ``m`` positions the last propose never reached and the ``k - 1`` non-final ones before
the query, together the last ``max(m, k)`` positions (an entry the last propose wrote from drafts
that were then accepted is already right); one width serves every depth because depth k reads
depth ``k - 1``'s hidden states over its whole window. ``commit`` only appends the verified
target hidden states and tokens to small rolling buffers (the last W of each). At inference,
positions ``j > n - 1 - k`` use the drafts where teacher-forced training uses the true tokens;
when the drafts are accepted the two coincide.

Cost per step: γ block applications on W = γ + 1 window tokens at the default K (attention against
the smallest window bucket of the cache that holds the context; the last depth, whose output is
read at its query position only, computes just keys / values at the other positions), plus γ
LM-head rows; state: γ single-layer KV caches.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.drafters.base import (DraftOutput, Observation, Sampling, SharedHead, TeacherForced,
                                   default_anchors, draw, drop_invalid, gather_positions)
from specjax.drafters.blocks import block_forward, cached_attention, causal_self_attention
from specjax.models.config import ModelConfig
from specjax.models.flops import (attention_flops_per_query, block_matmul_params,
                                  lm_head_flops_per_row)
from specjax.models.graphdef import GraphDefHolder
from specjax.models.layers import RMSNorm, param, rope_inv_freq
from specjax.models.transformer import Block

__all__ = ["MTPConfig", "MTPHead", "MTPHeads", "MTPState", "MTPDrafter"]


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """MTP drafter configuration.

    num_heads: number of heads with their own parameters (ignored when ``shared``).
    shared: one head (norms, projection, block, output norm) reused at every depth.
    target_layer: target hidden state used as ``h^0`` (0 = embeddings, i = after block i,
      -1 = the last block).
    intermediate_size, num_attention_heads, num_kv_heads, head_dim: the block's shape (default:
      the target's).
    """

    num_heads: int = 1
    shared: bool = False
    target_layer: int = -1
    intermediate_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None

    def block_config(self, target: ModelConfig) -> ModelConfig:
        return target.replace(
            num_layers=1,
            intermediate_size=self.intermediate_size or target.intermediate_size,
            num_heads=self.num_attention_heads or target.num_heads,
            num_kv_heads=self.num_kv_heads or target.num_kv_heads,
            head_dim=self.head_dim or target.head_dim)


class MTPHead(nnx.Module):
    """One MTP module: hidden / embedding norms, the ``2d -> d`` projection, a block, an output
    norm (the LM head itself is the target's)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, eps, wd = config.hidden_size, config.rms_norm_eps, config.weight_dtype
        self.hnorm = RMSNorm(d, eps, wd, rngs=rngs)
        self.enorm = RMSNorm(d, eps, wd, rngs=rngs)
        self.proj = param(rngs, (2 * d, d), ("mlp", "embed"), wd)
        self.block = Block(config, rngs=rngs)
        self.norm = RMSNorm(d, eps, wd, rngs=rngs)

    def combine(self, h: jax.Array, e: jax.Array) -> jax.Array:
        x = jnp.concatenate([self.hnorm(h), self.enorm(e.astype(h.dtype))], axis=-1)
        return x @ self.proj[...].astype(x.dtype)


class MTPHeads(nnx.Module):
    def __init__(self, block_config: ModelConfig, num_heads: int, *, rngs: nnx.Rngs):
        self.heads = nnx.List([MTPHead(block_config, rngs=rngs) for _ in range(num_heads)])

    def head(self, depth: int) -> MTPHead:
        """Head used at chain depth ``depth`` (1-based): the last one beyond the number of heads."""
        return self.heads[min(depth, len(self.heads)) - 1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPState:
    """Decoding state of the MTP chain for B rows.

    k, v: per chain depth, ``[B, max_len, KVH, Dh]`` keys / values of that depth's block.
    hidden: ``[B, W, D]`` target hidden states ``h^0`` at positions ``n-1-W .. n-2``.
    tokens: int32 ``[B, W]`` emitted tokens at positions ``n-W .. n-1`` (last = anchor).
    num_emitted: int32 ``[B]``, n.
    """

    k: tuple
    v: tuple
    hidden: jax.Array
    tokens: jax.Array
    num_emitted: jax.Array


def _depth(head: MTPHead, frozen: SharedHead, h_prev, toks, positions, inv_freq, cache=None,
           write_positions=None, queries=None):
    """One chain depth over ``[B, T]`` positions; returns ``(h^k [B, Q, D], (k, v) or None)``:
    ``Q = queries`` last positions (default all T; with a cache only) get the block's output,
    every position its keys / values."""
    x = head.combine(h_prev, frozen.embed_tokens(toks))
    written = []
    q_positions = positions if queries is None else positions[:, -queries:]

    def attend(q, k, v):
        if cache is None:
            return causal_self_attention(q, k, v, positions)
        out, ck, cv = cached_attention(q, k, v, q_positions, cache[0], cache[1], write_positions)
        written.append((ck, cv))
        return out

    if queries is not None and cache is None:
        raise ValueError("_depth: queries needs a cache (causal self-attention takes all T)")
    h = block_forward(head.block, x, positions, inv_freq, attend, queries=queries)
    return h, (written[0] if written else None)


def _roll(old: jax.Array, new: jax.Array, offset: jax.Array, width: int) -> jax.Array:
    """``concat(old, new)[b, offset[b] : offset[b] + width]`` along axis 1."""
    ext = jnp.concatenate([old, new.astype(old.dtype)], axis=1)
    idx = offset[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    return gather_positions(ext, idx)


@dataclasses.dataclass(frozen=True)
class MTPDrafter(GraphDefHolder):
    """MTP drafter: static description (hashable; pass as a static jit argument) + pure functions.

    ``params`` is the :class:`MTPHeads` state (``nnx.State`` or its pure dict); ``frozen`` is the
    target's :class:`~specjax.drafters.base.SharedHead`.
    """

    config: MTPConfig
    target_config: ModelConfig
    graphdef: nnx.GraphDef
    # Queries of the last depth's block in propose: 1, since only its output at the query position
    # is read (its keys / values are computed at every window position); None runs the whole
    # block at every position, as before (benchmarks/mtp_window.py times both).
    last_depth_queries: ClassVar[Optional[int]] = 1

    @staticmethod
    def create(target_config: ModelConfig, config: MTPConfig = MTPConfig(), seed: int = 0):
        """Returns ``(drafter, params)`` with freshly initialised params."""
        n = 1 if config.shared else config.num_heads
        if n < 1:
            raise ValueError(f"MTPConfig.num_heads must be >= 1, got {config.num_heads}")
        module = MTPHeads(config.block_config(target_config), n, rngs=nnx.Rngs(params=seed))
        graphdef, params = nnx.split(module)
        return MTPDrafter(config, target_config, graphdef), params

    # -- static properties -----------------------------------------------------------------------
    @property
    def hidden_layers(self) -> tuple[int, ...]:
        layer = self.config.target_layer
        layer = self.target_config.num_layers if layer < 0 else layer
        return (layer,)

    @property
    def has_confidence(self) -> bool:
        return False

    def _module(self, params) -> MTPHeads:
        return nnx.merge(self.graphdef, params)

    def _inv_freq(self):
        c = self.config.block_config(self.target_config)
        return rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)

    # -- decoding --------------------------------------------------------------------------------
    @staticmethod
    def window(gamma: int, max_verify: Optional[int] = None) -> int:
        """W, the positions every depth recomputes per :meth:`propose`: ``max(K + 1, γ)`` for at
        most ``K = max_verify`` (default γ) drafts verified per step (module docstring)."""
        k = gamma if max_verify is None else max_verify
        if gamma < 1 or k < 0:
            raise ValueError(f"MTP window: need gamma >= 1 and max_verify >= 0, got gamma={gamma}, "
                             f"max_verify={max_verify}")
        return max(k + 1, gamma)

    def init_state(self, batch: int, max_len: int, gamma: int,
                   max_verify: Optional[int] = None) -> MTPState:
        """Empty state for ``gamma``-token drafts verified ``max_verify`` (default γ) at a time."""
        c = self.config.block_config(self.target_config)
        w = self.window(gamma, max_verify)
        shape = (batch, max_len, c.num_kv_heads, c.head_dim)
        zeros = tuple(jnp.zeros(shape, c.compute_dtype) for _ in range(gamma))
        return MTPState(
            k=zeros, v=tuple(jnp.zeros(shape, c.compute_dtype) for _ in range(gamma)),
            hidden=jnp.zeros((batch, w, c.hidden_size), c.compute_dtype),
            tokens=jnp.zeros((batch, w), jnp.int32),
            num_emitted=jnp.zeros((batch,), jnp.int32))

    def prefill(self, params, frozen: SharedHead, state: MTPState, obs: Observation) -> MTPState:
        """Runs every depth over the prompt (writing the caches), then fills the buffers.

        Takes the whole prompt in one call (from ``start = 0``): the last ``k - 1`` depth-k entries
        of a chunk need tokens after it, so a chunked prefill would leave stale entries below the
        first decoding window.
        """
        module = self._module(params)
        gamma = len(state.k)
        b, t = obs.tokens.shape
        max_len = state.k[0].shape[1]
        idx = jnp.arange(t, dtype=jnp.int32)[None, :]
        positions = obs.start[:, None] + idx
        write_pos = drop_invalid(positions, idx < obs.num_valid[:, None], max_len)
        # ext[:, j] = the token following position j (next_token after the last prompt token).
        shifted = jnp.concatenate([obs.tokens[:, 1:], jnp.zeros((b, gamma), jnp.int32)], axis=1)
        idx_e = jnp.arange(t - 1 + gamma, dtype=jnp.int32)[None, :]
        last = obs.num_valid[:, None] - 1
        ext = jnp.where(idx_e < last, shifted,
                        jnp.where(idx_e == last, obs.next_token[:, None], 0)).astype(jnp.int32)
        h = obs.hidden[0]
        inv_freq = self._inv_freq()
        ks, vs = [], []
        for depth in range(1, gamma + 1):
            toks = ext[:, depth - 1: depth - 1 + t]
            h, (ck, cv) = _depth(module.head(depth), frozen, h, toks, positions, inv_freq,
                                 (state.k[depth - 1], state.v[depth - 1]), write_pos)
            ks.append(ck)
            vs.append(cv)
        state = dataclasses.replace(state, k=tuple(ks), v=tuple(vs))
        return self.commit(params, frozen, state, obs)

    def commit(self, params, frozen: SharedHead, state: MTPState, obs: Observation) -> MTPState:
        """Appends the committed target hidden states and tokens to the rolling buffers."""
        del params, frozen
        w = state.tokens.shape[1]
        b, t = obs.tokens.shape
        v = obs.num_valid.astype(jnp.int32)
        hidden = _roll(state.hidden, obs.hidden[0], v, w)
        ext = jnp.concatenate([state.tokens[:, :w - 1], obs.tokens.astype(jnp.int32),
                               jnp.zeros((b, 1), jnp.int32)], axis=1)
        ext = ext.at[jnp.arange(b), w - 1 + v].set(obs.next_token.astype(jnp.int32))
        tokens = gather_positions(ext, v[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :])
        return dataclasses.replace(state, hidden=hidden, tokens=tokens,
                                   num_emitted=(obs.start + v + 1).astype(jnp.int32))

    def propose(self, params, frozen: SharedHead, state: MTPState, key: jax.Array, *, gamma: int,
                sampling: Sampling = Sampling(), argmax: bool = False):
        """Drafts ``gamma`` tokens by chaining the heads; returns ``(DraftOutput, state)``."""
        if gamma != len(state.k):
            raise ValueError(f"state was built for gamma={len(state.k)}, got gamma={gamma}")
        module = self._module(params)
        b, w = state.tokens.shape
        max_len = state.k[0].shape[1]
        positions = state.num_emitted[:, None] - 1 - w + jnp.arange(w, dtype=jnp.int32)[None, :]
        write_pos = drop_invalid(positions, jnp.ones_like(positions, bool), max_len)
        inv_freq = self._inv_freq()
        keys = jax.random.split(key, gamma)
        h = state.hidden
        drafts, probs, ks, vs = [], [], [], []
        for depth in range(1, gamma + 1):
            toks = jnp.concatenate([state.tokens] + [x[:, None] for x in drafts], axis=1)
            toks = toks[:, depth - 1: depth - 1 + w]
            head = module.head(depth)
            # the last depth's output is read at the query position only (its cache everywhere)
            h, (ck, cv) = _depth(head, frozen, h, toks, positions, inv_freq,
                                 (state.k[depth - 1], state.v[depth - 1]), write_pos,
                                 queries=self.last_depth_queries if depth == gamma else None)
            ks.append(ck)
            vs.append(cv)
            logits = frozen.lm_logits(head.norm(h[:, -1]), normed=True)
            x, q = draw(keys[depth - 1], logits, sampling, argmax)
            drafts.append(x)
            probs.append(q)
        out = DraftOutput(tokens=jnp.stack(drafts, axis=1), probs=jnp.stack(probs, axis=1),
                          confidences=None)
        return out, dataclasses.replace(state, k=tuple(ks), v=tuple(vs))

    # -- model FLOPs ----------------------------------------------------------------------------
    def _depth_flops(self, context: int, *, cache_only: bool = False) -> float:
        """Forward FLOPs of one chain depth at one position: the ``2d -> d`` projection and the
        block, attending to ``context`` positions of that depth's cache; ``cache_only``: the
        projection and the block's keys / values alone (what a depth whose output is unused must
        still compute for its cache)."""
        c = self.config.block_config(self.target_config)
        d = c.hidden_size
        if cache_only:
            return 2 * (2 * d * d + 2 * d * c.num_kv_heads * c.head_dim)
        return 2 * (2 * d * d + block_matmul_params(c)) + attention_flops_per_query(c, context)

    def propose_flops(self, context: int, gamma: int, max_verify: Optional[int] = None) -> float:
        """Forward FLOPs of one row's :meth:`propose`: every depth recomputes the window of
        ``W = max(max_verify + 1, γ)`` positions (:meth:`window`), attending to ``context`` cached
        positions, and runs the shared LM head at its last position; of the last depth, whose
        output only its last position reads, the other ``W - 1`` positions compute their cache
        entries alone."""
        w = self.window(gamma, max_verify)
        q = w if self.last_depth_queries is None else min(self.last_depth_queries, w)
        depths = ((gamma - 1) * w + q) * self._depth_flops(context) + \
            (w - q) * self._depth_flops(context, cache_only=True)
        return depths + gamma * lm_head_flops_per_row(self.target_config)

    def prefill_flops(self, rows: int, chunk: int, context: int, gamma: int) -> float:
        """Forward FLOPs of :meth:`prefill` of ``rows`` prompt chunks of ``chunk`` tokens: each
        depth's projection and block at every position, but of the last depth, whose output
        nothing reads, only what its cache needs (no LM head anywhere)."""
        per_position = (gamma - 1) * self._depth_flops(context) + \
            self._depth_flops(context, cache_only=True)
        return rows * chunk * per_position

    def commit_flops(self, tokens: int, context: int, gamma: int) -> float:
        """:meth:`commit` only moves buffers: no matmul."""
        del tokens, context, gamma
        return 0.0

    # -- training --------------------------------------------------------------------------------
    def train_flops(self, seq: int, anchors: int, gamma: int) -> float:
        """Model FLOPs of one training row of ``seq`` tokens (:meth:`teacher_forced`, forward and
        backward) with ``anchors`` anchors and chain depth ``gamma``.

        Each depth runs one head's ``2d -> d`` projection and block over *every* position, not
        at the anchors alone (the block's attention at depth k reads the depth-k states of every
        earlier position): ``6 (2 d^2 + N_block) + 12 H Dh seq`` per position and depth. The
        frozen shared head runs at the anchors of each depth, forward and input gradient
        (``4 V d``). The frozen target's forward is the caller's."""
        c = self.config.block_config(self.target_config)
        d = c.hidden_size
        position = 2 * (2 * d * d + block_matmul_params(c)) + attention_flops_per_query(c, seq)
        return gamma * (3 * position * seq + 4 * c.vocab_size * d * anchors)

    def teacher_forced(self, params, frozen: SharedHead, tokens: jax.Array,
                       hidden: jax.Array, *, gamma: int,
                       anchors: Optional[jax.Array] = None) -> TeacherForced:
        """Teacher-forced chain over full sequences.

        Args:
          tokens: int32 ``[B, T]`` (one document per row; right padding is harmless).
          hidden: ``[1, B, T, D]`` target hidden states for :attr:`hidden_layers`.
          gamma: chain depth.
          anchors: int32 ``[B, A]`` anchor positions i (default all T).
        Returns:
          :class:`TeacherForced` with logits ``[B, A, γ, V]`` (depth k at position i, input
          ``t_{i+k}``, predicting ``t_{i+1+k}``; see :func:`~specjax.drafters.teacher_forced_targets`).
        """
        module = self._module(params)
        b, t = tokens.shape
        if anchors is None:
            anchors = default_anchors(b, t)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        ext = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, gamma), tokens.dtype)], axis=1)
        h = hidden[0]
        inv_freq = self._inv_freq()
        logits = []
        for depth in range(1, gamma + 1):
            head = module.head(depth)
            h, _ = _depth(head, frozen, h, ext[:, depth - 1: depth - 1 + t], positions, inv_freq)
            logits.append(frozen.lm_logits(head.norm(gather_positions(h, anchors)), normed=True))
        return TeacherForced(logits=jnp.stack(logits, axis=2), confidence_logits=None)
