"""DSpark: a parallel (DFlash) backbone plus a light sequential head and a confidence head.

Architecture (DSpark §2.2 and §3.1–3.2.1; DFlash eq. 2–3):

* **Context features** ``H_ctx = RMSNorm(W_c [h_{l1}; ...; h_{lm}])`` from chosen target layers,
  injected into every draft layer as extra keys / values: ``K = [W_K H_ctx; W_K H_d]``,
  ``V = [W_V H_ctx; W_V H_d]`` (the layer's own projections, k-norm and RoPE at the context
  tokens' positions; no input norm on ``H_ctx``, which is already normalised).
* **Parallel backbone**: ``num_layers`` target-style blocks over γ block tokens: the anchor
  (last emitted token, shared frozen embedding) followed by γ−1 copies of a learned mask
  embedding, at positions ``i+1 .. i+γ``; attention is bidirectional inside the block and sees
  the context of positions ``<= i``. The anchor slot predicts ``x_1`` (DSpark's variant of DFlash).
  Outputs ``h_k`` (after the drafter's own final norm) and base logits ``U_k`` from the shared
  frozen LM head.
* **Sequential head** (``head``): ``"markov"``: ``B_k = W1[x_{k-1}] W2`` (rank r, ``x_0`` = anchor);
  ``"rnn"``: ``z_k = [s_{k-1}; W1[x_{k-1}]; h_k]``, one linear map split into gate / candidate /
  output, ``s_k = σ(g) ⊙ s_{k-1} + (1 − σ(g)) ⊙ tanh(c)``, ``B_k = tanh(o) W2``, ``s_0 = 0``;
  ``"none"``: ``B_k = 0``. ``q_k = transform(U_k + B_k)`` sampled left to right: a ``lax.scan``
  over γ of a rank-r update, no backbone recompute.
* **Confidence head** (``confidence``): ``c_k = σ(wᵀ[h_k; W1[x_{k-1}]] + b)``.
* ``head="none", confidence=False`` is the **DFlash** parallel baseline (one pass, independent
  positions).

What it sees / caches. The drafter sees the *full prefix* through its own cache of context
keys / values: one KV cache of ``num_layers`` layers, ``[B, max_len]`` positions, holding
``W_K H_ctx`` / ``W_V H_ctx`` for every committed target position (``commit`` writes the verified
positions' features; nothing speculative is ever written, so there is nothing to roll back).
Teacher-forced training sees exactly the same thing (context of positions ``<= i``).

Cost per step: one backbone pass over γ tokens (attention against the smallest window bucket of
the context cache that holds every row's context), γ LM-head rows, a γ-step scan of rank-r
updates; ``commit`` projects the ``K + 1`` new positions' features (no attention).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import nnx

from specjax.drafters.base import (DraftOutput, Observation, Sampling, SharedHead, TeacherForced,
                                   default_anchors, draw, drop_invalid, gather_positions)
from specjax.drafters.blocks import block_forward, context_block_attention, project_kv
from specjax.models.attention import kv_windows, window_switch
from specjax.models.flops import (attention_flops_per_query, block_matmul_params,
                                  lm_head_flops_per_row)
from specjax.models.config import ModelConfig
from specjax.models.graphdef import GraphDefHolder
from specjax.models.layers import RMSNorm, param, rope_inv_freq
from specjax.models.transformer import Block

__all__ = ["DSparkConfig", "DSparkModule", "DSparkState", "DSparkDrafter", "dflash_config"]

HEADS = ("markov", "rnn", "none")


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """DSpark / DFlash drafter configuration.

    target_layers: target hidden states used as context (0 = embeddings, i = after block i,
      negative counts from the end: -1 = the last block).
    num_layers: backbone blocks.
    head: sequential head, ``"markov"``, ``"rnn"`` or ``"none"``.
    rank: r, width of the ``W1`` token embedding / ``W2`` projection (and of the RNN state).
    confidence: add the confidence head.
    intermediate_size, num_attention_heads, num_kv_heads, head_dim: backbone block shape
      (default: the target's).
    """

    target_layers: tuple[int, ...] = (-1,)
    num_layers: int = 1
    head: str = "markov"
    rank: int = 32
    confidence: bool = True
    intermediate_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None

    def __post_init__(self):
        if self.head not in HEADS:
            raise ValueError(f"DSparkConfig.head must be one of {HEADS}, got {self.head!r}")
        if self.num_layers < 1 or self.rank < 1 or not self.target_layers:
            raise ValueError("DSparkConfig needs num_layers >= 1, rank >= 1 and target_layers")
        object.__setattr__(self, "target_layers", tuple(self.target_layers))

    @property
    def uses_w1(self) -> bool:
        return self.head != "none" or self.confidence

    def block_config(self, target: ModelConfig) -> ModelConfig:
        return target.replace(
            num_layers=self.num_layers,
            intermediate_size=self.intermediate_size or target.intermediate_size,
            num_heads=self.num_attention_heads or target.num_heads,
            num_kv_heads=self.num_kv_heads or target.num_kv_heads,
            head_dim=self.head_dim or target.head_dim)


def dflash_config(**kwargs) -> DSparkConfig:
    """The DFlash parallel baseline: no sequential head, no confidence head."""
    return DSparkConfig(head="none", confidence=False, **kwargs)


class DSparkModule(nnx.Module):
    """Trainable parameters of the DSpark drafter (the embedding / LM head are the target's)."""

    def __init__(self, config: DSparkConfig, block_config: ModelConfig, vocab_size: int, *,
                 rngs: nnx.Rngs):
        c, d, r = block_config, block_config.hidden_size, config.rank
        wd, eps = c.weight_dtype, c.rms_norm_eps
        m = len(config.target_layers)
        self.ctx_proj = param(rngs, (m * d, d), ("mlp", "embed"), wd)
        self.ctx_norm = RMSNorm(d, eps, wd, rngs=rngs)
        self.mask_embed = param(rngs, (d,), ("embed",), wd)
        self.layers = nnx.List([Block(c, rngs=rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(d, eps, wd, rngs=rngs)
        self.w1 = param(rngs, (vocab_size, r), ("vocab", "rank"), wd) if config.uses_w1 else None
        self.w2 = (param(rngs, (r, vocab_size), ("rank", "vocab"), wd)
                   if config.head != "none" else None)
        self.rnn = (param(rngs, (2 * r + d, 3 * r), ("mlp", "rank"), wd)
                    if config.head == "rnn" else None)
        if config.confidence:
            self.conf_w = param(rngs, (d + r,), ("mlp",), wd)
            self.conf_b = nnx.Param(jnp.zeros((1,), wd), logical_axes=("norm",))
        else:
            self.conf_w = None
            self.conf_b = None

    def context_features(self, hidden: jax.Array) -> jax.Array:
        """``[m, B, T, D]`` target hidden states -> ``H_ctx [B, T, D]``."""
        x = rearrange(hidden, "m b t d -> b t (m d)")  # the m layers' features side by side
        return self.ctx_norm(x @ self.ctx_proj[...].astype(x.dtype))

    def seq_step(self, state, h, u, x_prev):
        """One sequential-head step: ``(s_{k-1}, h_k [.., D], U_k [.., V], x_{k-1} [..])`` ->
        ``(s_k, logits_k f32 [.., V], conf_logit_k f32 [..] or None)``."""
        if self.w1 is not None:
            e = jnp.take(self.w1[...], x_prev, axis=0).astype(h.dtype)
        logits = u
        if self.rnn is not None:
            z = jnp.concatenate([state, e, h], axis=-1)
            g, c, o = jnp.split(z @ self.rnn[...].astype(z.dtype), 3, axis=-1)
            gate = jax.nn.sigmoid(g)
            state = gate * state + (1.0 - gate) * jnp.tanh(c)
            logits = logits + (jnp.tanh(o) @ self.w2[...].astype(o.dtype)).astype(jnp.float32)
        elif self.w2 is not None:
            logits = logits + (e @ self.w2[...].astype(e.dtype)).astype(jnp.float32)
        conf = None
        if self.conf_w is not None:
            feat = jnp.concatenate([h, e], axis=-1)
            conf = (feat @ self.conf_w[...].astype(feat.dtype)).astype(jnp.float32)
            conf = conf + self.conf_b[...].astype(jnp.float32)[0]
        return state, logits, conf


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DSparkState:
    """Decoding state: context keys / values per backbone layer ``[B, max_len, KVH, Dh]``, the
    number of committed context positions ``ctx_len [B]`` (= target cache length) and the anchor
    ``[B]`` (last emitted token, at position ``ctx_len``)."""

    k: tuple
    v: tuple
    ctx_len: jax.Array
    anchor: jax.Array


@dataclasses.dataclass(frozen=True)
class DSparkDrafter(GraphDefHolder):
    """DSpark / DFlash drafter: static description (hashable) + pure functions.

    ``params`` is the :class:`DSparkModule` state; ``frozen`` the target's
    :class:`~specjax.drafters.base.SharedHead`.
    """

    config: DSparkConfig
    target_config: ModelConfig
    graphdef: nnx.GraphDef

    @staticmethod
    def create(target_config: ModelConfig, config: DSparkConfig = DSparkConfig(), seed: int = 0):
        """Returns ``(drafter, params)`` with freshly initialised params."""
        module = DSparkModule(config, config.block_config(target_config), target_config.vocab_size,
                              rngs=nnx.Rngs(params=seed))
        graphdef, params = nnx.split(module)
        drafter = DSparkDrafter(config, target_config, graphdef)
        drafter.hidden_layers  # validates the layer indices
        return drafter, params

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        n = self.target_config.num_layers
        out = tuple(l + n + 1 if l < 0 else l for l in self.config.target_layers)
        for l in out:
            if not 0 <= l <= n:
                raise ValueError(f"DSpark target layer outside [0, {n}]: {self.config.target_layers}")
        return out

    @property
    def has_confidence(self) -> bool:
        return self.config.confidence

    def _module(self, params) -> DSparkModule:
        return nnx.merge(self.graphdef, params)

    def _block_config(self) -> ModelConfig:
        return self.config.block_config(self.target_config)

    def _inv_freq(self):
        c = self._block_config()
        return rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)

    # -- the parallel backbone -------------------------------------------------------------------
    def _backbone(self, module: DSparkModule, frozen: SharedHead, anchor, anchor_pos, gamma,
                  ctx_kv, ctx_mask):
        """Blocks of ``gamma`` tokens (anchor + masks) at ``anchor_pos + arange(γ)``.

        anchor, anchor_pos: int32 ``[B, A]``; ctx_kv: per layer ``(k, v) [B, S, KVH, Dh]``;
        ctx_mask: bool ``[B, A, S]``. Returns normed ``h [B, A, γ, D]``.
        """
        b, a = anchor.shape
        d = frozen.hidden_size
        emb = frozen.embed_tokens(anchor)[:, :, None, :]
        mask = jnp.broadcast_to(module.mask_embed[...].astype(emb.dtype), (b, a, gamma - 1, d))
        # Blocks laid end to end along one token axis for the shared layers; split back per block
        # for the block attention.
        x = rearrange(jnp.concatenate([emb, mask], axis=2), "b a g d -> b (a g) d")
        pos = rearrange(anchor_pos[:, :, None] + jnp.arange(gamma, dtype=jnp.int32),
                        "b a g -> b (a g)")
        inv_freq = self._inv_freq()
        for layer, (kc, vc) in zip(module.layers, ctx_kv):
            def attend(q, k, v, kc=kc, vc=vc):
                split = lambda z: rearrange(z, "b (a g) ... -> b a g ...", a=a)
                out = context_block_attention(split(q), kc, vc, ctx_mask, split(k), split(v))
                return rearrange(out, "b a g ... -> b (a g) ...")
            x = block_forward(layer, x, pos, inv_freq, attend)
        return rearrange(module.norm(x), "b (a g) d -> b a g d", a=a)

    # -- decoding --------------------------------------------------------------------------------
    def init_state(self, batch: int, max_len: int, gamma: int,
                   max_verify: Optional[int] = None) -> DSparkState:
        del gamma, max_verify
        c = self._block_config()
        shape = (batch, max_len, c.num_kv_heads, c.head_dim)
        return DSparkState(
            k=tuple(jnp.zeros(shape, c.compute_dtype) for _ in range(c.num_layers)),
            v=tuple(jnp.zeros(shape, c.compute_dtype) for _ in range(c.num_layers)),
            ctx_len=jnp.zeros((batch,), jnp.int32), anchor=jnp.zeros((batch,), jnp.int32))

    def commit(self, params, frozen: SharedHead, state: DSparkState,
               obs: Observation) -> DSparkState:
        """Writes the context keys / values of the committed positions; sets the anchor."""
        del frozen
        module = self._module(params)
        b, t = obs.tokens.shape
        max_len = state.k[0].shape[1]
        idx = jnp.arange(t, dtype=jnp.int32)[None, :]
        positions = obs.start[:, None] + idx
        write_pos = drop_invalid(positions, idx < obs.num_valid[:, None], max_len)
        feats = module.context_features(obs.hidden)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        inv_freq = self._inv_freq()
        ks, vs = [], []
        for layer, ck, cv in zip(module.layers, state.k, state.v):
            k, v = project_kv(layer, feats, positions, inv_freq)
            ks.append(ck.at[rows, write_pos].set(k.astype(ck.dtype), mode="drop"))
            vs.append(cv.at[rows, write_pos].set(v.astype(cv.dtype), mode="drop"))
        return DSparkState(k=tuple(ks), v=tuple(vs),
                           ctx_len=(obs.start + obs.num_valid).astype(jnp.int32),
                           anchor=obs.next_token.astype(jnp.int32))

    prefill = commit

    def propose(self, params, frozen: SharedHead, state: DSparkState, key: jax.Array, *,
                gamma: int, sampling: Sampling = Sampling(), argmax: bool = False):
        """One backbone pass, then the sequential head left to right; ``(DraftOutput, state)``."""
        module = self._module(params)
        b = state.anchor.shape[0]
        max_len = state.k[0].shape[1]

        def window(w):  # the backbone reading only the first w context positions
            def run(ks, vs):
                cut = lambda c: jax.lax.slice_in_dim(c, 0, w, axis=1)
                ctx_mask = (jnp.arange(w, dtype=jnp.int32)[None, :] <
                            state.ctx_len[:, None])[:, None]
                return self._backbone(module, frozen, state.anchor[:, None],
                                      state.ctx_len[:, None], gamma,
                                      [(cut(k), cut(v)) for k, v in zip(ks, vs)], ctx_mask)
            return run

        h = window_switch(jnp.max(state.ctx_len), kv_windows(max_len), window,
                          state.k, state.v)[:, 0]  # [B, γ, D]
        u = frozen.lm_logits(h, normed=True)  # [B, γ, V]
        r = self.config.rank
        keys = jax.random.split(key, gamma)

        def step(carry, xs):
            s, x_prev = carry
            h_k, u_k, key_k = xs
            s, logits, conf = module.seq_step(s, h_k, u_k, x_prev)
            x, q = draw(key_k, logits, sampling, argmax)
            conf = jnp.zeros((b,), jnp.float32) if conf is None else jax.nn.sigmoid(conf)
            return (s, x), (x, q, conf)

        s0 = jnp.zeros((b, r), h.dtype)
        xs = (jnp.moveaxis(h, 1, 0), jnp.moveaxis(u, 1, 0), keys)
        _, (tok, q, conf) = jax.lax.scan(step, (s0, state.anchor), xs)
        out = DraftOutput(tokens=jnp.moveaxis(tok, 0, 1), probs=jnp.moveaxis(q, 0, 1),
                          confidences=jnp.moveaxis(conf, 0, 1) if self.config.confidence else None)
        return out, state

    # -- model FLOPs ----------------------------------------------------------------------------
    def _sequential_flops(self) -> float:
        """Forward FLOPs of one sequential-head step (``W2``, the RNN cell, the confidence head;
        ``W1`` is a lookup)."""
        c, r = self._block_config(), self.config.rank
        v = self.target_config.vocab_size
        out = 0.0
        if self.config.head == "rnn":
            out += 2 * (2 * r + c.hidden_size) * 3 * r
        if self.config.head != "none":
            out += 2 * r * v
        if self.config.confidence:
            out += 2 * (c.hidden_size + r)
        return out

    def propose_flops(self, context: int, gamma: int, max_verify: Optional[int] = None) -> float:
        """Forward FLOPs of one row's :meth:`propose`: the backbone over the γ block tokens, each
        attending to ``context`` context positions plus the block, γ rows of the shared LM head
        and γ sequential-head steps."""
        del max_verify
        c = self._block_config()
        backbone = 2 * c.num_layers * block_matmul_params(c) + \
            attention_flops_per_query(c, context + gamma)
        head = lm_head_flops_per_row(self.target_config)
        return gamma * (backbone + head + self._sequential_flops())

    def commit_flops(self, tokens: int, context: int, gamma: int) -> float:
        """Forward FLOPs of :meth:`commit` over ``tokens`` observed positions: the context
        features (``m d -> d``) and each backbone layer's context keys and values (no
        attention)."""
        del context, gamma
        c = self._block_config()
        d = c.hidden_size
        per_position = 2 * len(self.config.target_layers) * d * d + \
            2 * c.num_layers * d * c.head_dim * 2 * c.num_kv_heads
        return tokens * per_position

    def prefill_flops(self, rows: int, chunk: int, context: int, gamma: int) -> float:
        """:meth:`prefill` is :meth:`commit` over the ``rows x chunk`` prompt positions."""
        return self.commit_flops(rows * chunk, context, gamma)

    # -- training --------------------------------------------------------------------------------
    def train_flops(self, seq: int, anchors: int, gamma: int) -> float:
        """Model FLOPs of one training row of ``seq`` tokens (:meth:`teacher_forced`, forward and
        backward) with ``anchors`` blocks of ``gamma`` tokens.

        Over every position: the context features (``m d -> d``; forward and weight gradient,
        the target's hidden states carry no gradient) and each backbone layer's context keys /
        values. Per block token: the backbone blocks, their attention over the whole context plus
        the block (the mask is applied to a dense score matrix), the frozen shared head (forward
        and input gradient), the sequential head (``W2``, the RNN cell) and the confidence head.
        ``W1`` is a lookup, not a matmul. The frozen target's forward is the caller's."""
        c, r = self._block_config(), self.config.rank
        d, v, layers = c.hidden_size, self.target_config.vocab_size, c.num_layers
        tokens = anchors * gamma
        per_position = 4 * len(self.config.target_layers) * d * d + \
            6 * layers * d * c.head_dim * 2 * c.num_kv_heads
        per_token = 3 * (2 * layers * block_matmul_params(c)
                         + attention_flops_per_query(c, seq + gamma)) + 4 * v * d
        if self.config.head == "rnn":
            per_token += 6 * (2 * r + d) * 3 * r
        if self.config.head != "none":
            per_token += 6 * r * v
        if self.config.confidence:
            per_token += 6 * (d + r)
        return per_position * seq + per_token * tokens

    def teacher_forced(self, params, frozen: SharedHead, tokens: jax.Array, hidden: jax.Array, *,
                       gamma: int, anchors: Optional[jax.Array] = None) -> TeacherForced:
        """Teacher-forced blocks at A anchors per row (DSpark §3.3: γ-token blocks at sampled
        anchors).

        Args:
          tokens: int32 ``[B, T]`` (one document per row).
          hidden: ``[m, B, T, D]`` target hidden states for :attr:`hidden_layers`.
          gamma: block size γ.
          anchors: int32 ``[B, A]`` anchor positions i (default all T): block of anchor i has the
            anchor token ``t_{i+1}`` and sees context positions ``<= i``; the sequential and
            confidence heads use teacher-forced ``x_{k-1} = t_{i+k}``.
        Returns:
          :class:`TeacherForced`: logits ``[B, A, γ, V]`` (``U_k + B_k``) and, with the
          confidence head, confidence logits ``[B, A, γ]``.
        """
        module = self._module(params)
        b, t = tokens.shape
        if anchors is None:
            anchors = default_anchors(b, t)
        a = anchors.shape[1]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        feats = module.context_features(hidden)
        inv_freq = self._inv_freq()
        ctx_kv = [project_kv(layer, feats, positions, inv_freq) for layer in module.layers]
        ctx_mask = positions[:, None, :] <= anchors[:, :, None]
        # x_{k-1} = t_{i+k}, k = 1..γ (x_0 = anchor t_{i+1}); beyond T: 0 (masked by the labels).
        pos_prev = anchors[:, :, None] + 1 + jnp.arange(gamma, dtype=jnp.int32)
        x_prev = jnp.where(pos_prev < t, gather_positions(tokens, pos_prev.reshape(b, -1))
                           .reshape(b, a, gamma), 0).astype(jnp.int32)
        h = self._backbone(module, frozen, x_prev[:, :, 0], anchors + 1, gamma, ctx_kv, ctx_mask)
        u = frozen.lm_logits(h, normed=True)

        def step(s, xs):
            h_k, u_k, x_k = xs
            s, logits, conf = module.seq_step(s, h_k, u_k, x_k)
            return s, (logits, jnp.zeros(x_k.shape, jnp.float32) if conf is None else conf)

        s0 = jnp.zeros((b, a, self.config.rank), h.dtype)
        xs = (jnp.moveaxis(h, 2, 0), jnp.moveaxis(u, 2, 0), jnp.moveaxis(x_prev, 2, 0))
        _, (logits, conf) = jax.lax.scan(step, s0, xs)
        return TeacherForced(logits=jnp.moveaxis(logits, 0, 2),
                             confidence_logits=(jnp.moveaxis(conf, 0, 2)
                                                if self.config.confidence else None))
