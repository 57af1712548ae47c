"""Independent small draft language model (vanilla speculative sampling baseline).

A small :class:`~specjax.models.Transformer` with the target's tokenizer (same vocabulary) and its
own parameters (embedding and LM head included) and its own KV cache. It sees the whole token
prefix through that cache, nothing of the target's hidden states.

Decoding. The draft cache holds every emitted token except the last one or two (``pending``).
``propose`` feeds the pending tokens (one ragged cached forward), samples ``x_1`` from the logits
at the last one, then feeds ``x_1 .. x_{γ-1}`` one token per step (a ``lax.scan``), sampling
``x_2 .. x_γ``. ``commit`` rolls the cache back to the accepted drafts (by lengths only) and sets
the pending tokens: the correction / bonus token, preceded by ``x_γ`` when every draft was accepted
(``x_γ`` was never fed). ``propose`` and ``commit`` must alternate.

Cost per step: one forward of 2 tokens and γ−1 forwards of 1 token of the draft model.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.drafters.base import (DraftOutput, Observation, Sampling, TeacherForced,
                                   default_anchors, draw, gather_positions)
from specjax.models.config import ModelConfig
from specjax.models.flops import (attention_flops_per_query, block_matmul_params,
                                  forward_flops_per_token, lm_head_flops_per_row)
from specjax.models.graphdef import GraphDefHolder
from specjax.models.kv_cache import KVCache, init_cache
from specjax.models.transformer import Transformer, apply

__all__ = ["DraftLMState", "DraftLMDrafter"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftLMState:
    """cache: the draft model's KV cache; pending: int32 ``[B, 2]`` emitted tokens not in the
    cache yet (the first ``num_pending [B]`` in {1, 2} of them)."""

    cache: KVCache
    pending: jax.Array
    num_pending: jax.Array


@dataclasses.dataclass(frozen=True)
class DraftLMDrafter(GraphDefHolder):
    """Draft-LM drafter; ``params`` is the draft :class:`Transformer`'s state, ``frozen`` unused."""

    config: ModelConfig
    graphdef: nnx.GraphDef

    @staticmethod
    def create(config: ModelConfig, seed: int = 0):
        """Returns ``(drafter, params)`` for a fresh draft model of ``config``."""
        return DraftLMDrafter.from_model(Transformer(config, rngs=nnx.Rngs(params=seed)))

    @staticmethod
    def from_model(model: Transformer):
        """Wraps an existing (e.g. trained or target-copy) model: ``(drafter, params)``."""
        graphdef, params = nnx.split(model)
        return DraftLMDrafter(model.config, graphdef), params

    hidden_layers: tuple = ()
    has_confidence: bool = False

    # -- decoding --------------------------------------------------------------------------------
    def init_state(self, batch: int, max_len: int, gamma: int,
                   max_verify: Optional[int] = None) -> DraftLMState:
        del gamma, max_verify
        return DraftLMState(cache=init_cache(self.config, batch, max_len),
                            pending=jnp.zeros((batch, 2), jnp.int32),
                            num_pending=jnp.ones((batch,), jnp.int32))

    def prefill(self, params, frozen, state: DraftLMState, obs: Observation) -> DraftLMState:
        """Feeds the prompt to the draft model; the first emitted token becomes pending."""
        del frozen
        cache = state.cache.rollback(obs.start)
        out = apply(self.graphdef, params, obs.tokens, cache=cache, num_valid=obs.num_valid)
        b = obs.tokens.shape[0]
        pending = jnp.stack([obs.next_token, jnp.zeros((b,), jnp.int32)], axis=1)
        return DraftLMState(cache=out.cache, pending=pending.astype(jnp.int32),
                            num_pending=jnp.ones((b,), jnp.int32))

    def propose(self, params, frozen, state: DraftLMState, key: jax.Array, *, gamma: int,
                sampling: Sampling = Sampling(), argmax: bool = False):
        del frozen
        keys = jax.random.split(key, gamma)
        out = apply(self.graphdef, params, state.pending, cache=state.cache,
                    num_valid=state.num_pending, logits_at=state.num_pending - 1)
        last = out.logits[:, 0]
        x1, q1 = draw(keys[0], last, sampling, argmax)
        if gamma == 1:
            return DraftOutput(x1[:, None], q1[:, None], None), \
                dataclasses.replace(state, cache=out.cache)

        def step(carry, key_k):
            cache, x = carry
            o = apply(self.graphdef, params, x[:, None], cache=cache)
            x, q = draw(key_k, o.logits[:, 0], sampling, argmax)
            return (o.cache, x), (x, q)

        (cache, _), (xs, qs) = jax.lax.scan(step, (out.cache, x1), keys[1:])
        tokens = jnp.concatenate([x1[:, None], jnp.moveaxis(xs, 0, 1)], axis=1)
        probs = jnp.concatenate([q1[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
        return DraftOutput(tokens, probs, None), dataclasses.replace(state, cache=cache)

    def commit(self, params, frozen, state: DraftLMState, obs: Observation) -> DraftLMState:
        del params, frozen
        n_last = (obs.start + obs.num_valid).astype(jnp.int32)  # position of next_token
        length = jnp.minimum(state.cache.lengths, n_last)
        # pending = emitted tokens at positions length .. n_last (one or two of them).
        first = jnp.where(length < n_last,
                          jnp.take_along_axis(obs.tokens, jnp.clip(length - obs.start, 0,
                                                                   obs.tokens.shape[1] - 1)[:, None],
                                              axis=1)[:, 0],
                          obs.next_token)
        num = n_last - length + 1
        second = jnp.where(num >= 2, obs.next_token, 0)
        pending = jnp.stack([first, second], axis=1).astype(jnp.int32)
        return DraftLMState(cache=state.cache.rollback(length), pending=pending,
                            num_pending=jnp.clip(num, 1, 2).astype(jnp.int32))

    # -- model FLOPs ----------------------------------------------------------------------------
    def propose_flops(self, context: int, gamma: int, max_verify: Optional[int] = None) -> float:
        """Forward FLOPs of one row's :meth:`propose`: the draft model over the two pending slots
        and then γ − 1 single tokens (γ + 1 positions attending to ``context`` cached ones), its LM
        head at γ of them (one per draft)."""
        del max_verify
        head = lm_head_flops_per_row(self.config)
        return (gamma + 1) * (forward_flops_per_token(self.config, context) - head) + gamma * head

    def prefill_flops(self, rows: int, chunk: int, context: int, gamma: int) -> float:
        """Forward FLOPs of :meth:`prefill` of ``rows`` prompt chunks of ``chunk`` tokens. Only
        the cache is kept: every block but the last in full, of the last only its keys and
        values, and no LM head (what nothing reads is not computed)."""
        del gamma
        c = self.config
        last = c.replace(num_layers=1)
        full = (forward_flops_per_token(c, context) - lm_head_flops_per_row(c)
                - 2 * block_matmul_params(last) - attention_flops_per_query(last, context))
        return rows * chunk * (full + 2 * 2 * c.hidden_size * c.num_kv_heads * c.head_dim)

    def commit_flops(self, tokens: int, context: int, gamma: int) -> float:
        """:meth:`commit` rolls the cache back by lengths: no matmul."""
        del tokens, context, gamma
        return 0.0

    # -- training --------------------------------------------------------------------------------
    def train_flops(self, seq: int, anchors: int, gamma: int) -> float:
        """Model FLOPs of one training row of ``seq`` tokens (:meth:`teacher_forced`, forward and
        backward): the draft model runs over every position and its logits are gathered at the
        anchors afterwards, so ``anchors`` and ``gamma`` do not change the count. It owns its LM
        head (counted in its forward); the frozen target's forward is the caller's."""
        del anchors, gamma
        return 3 * forward_flops_per_token(self.config, seq) * seq

    def teacher_forced(self, params, frozen, tokens: jax.Array, hidden=None, *, gamma: int,
                       anchors: Optional[jax.Array] = None) -> TeacherForced:
        """Draft k of anchor i is the draft model's next-token logits at position ``i + k``.

        ``hidden`` is ignored (the draft model reads tokens only). Logits ``[B, A, γ, V]``.
        """
        del frozen, hidden
        b, t = tokens.shape
        if anchors is None:
            anchors = default_anchors(b, t)
        logits = apply(self.graphdef, params, tokens).logits
        pos = anchors[:, :, None] + 1 + jnp.arange(gamma, dtype=jnp.int32)
        out = gather_positions(logits, pos.reshape(b, -1)).reshape(b, anchors.shape[1], gamma, -1)
        return TeacherForced(logits=out, confidence_logits=None)
