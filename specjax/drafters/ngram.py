"""N-gram / prompt-lookup drafter (training-free baseline; Saxena 2023, "prompt lookup decoding").

It sees the whole emitted sequence (prompt + generated) in a token buffer. To propose, it looks for
the most recent earlier occurrence of the last g tokens (g from ``max_ngram`` down to
``min_ngram``; the first g with a match wins) and copies the tokens that followed it. If the copy
runs into the end of the sequence it continues periodically (copying its own drafts), i.e. with
match end ``p`` and period ``d = n - 1 - p``, ``x_k = t_{p + 1 + ((k-1) mod d)}``. With no match
it proposes the last token repeated.

``q`` is the one-hot of the proposed token at every position: rejection sampling is exact for any
``q`` (accept with probability ``p(x)``, else resample from ``p`` with ``x`` removed), so the
emitted tokens are still distributed exactly as the target's. No confidences.

Cost per step: ``O(B · max_len · max_ngram)`` comparisons, no model.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from specjax.drafters.base import DraftOutput, Observation, Sampling, drop_invalid

__all__ = ["NGramState", "NGramDrafter"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NGramState:
    """history: int32 ``[B, max_len]`` emitted tokens; num_emitted: int32 ``[B]``."""

    history: jax.Array
    num_emitted: jax.Array


@dataclasses.dataclass(frozen=True)
class NGramDrafter:
    """Prompt-lookup drafter. ``params`` and ``frozen`` are unused (pass ``None``)."""

    vocab_size: int
    max_ngram: int = 3
    min_ngram: int = 1
    hidden_layers: tuple = ()
    has_confidence: bool = False

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, "
                             f"{self.max_ngram}")

    def init_state(self, batch: int, max_len: int, gamma: int,
                   max_verify: Optional[int] = None) -> NGramState:
        del gamma, max_verify
        return NGramState(history=jnp.zeros((batch, max_len), jnp.int32),
                          num_emitted=jnp.zeros((batch,), jnp.int32))

    # Model FLOPs: a lookup, no matmul anywhere.
    def propose_flops(self, context: int, gamma: int, max_verify: Optional[int] = None) -> float:
        return 0.0

    def prefill_flops(self, rows: int, chunk: int, context: int, gamma: int) -> float:
        return 0.0

    def commit_flops(self, tokens: int, context: int, gamma: int) -> float:
        return 0.0

    def commit(self, params, frozen, state: NGramState, obs: Observation) -> NGramState:
        del params, frozen
        b, t = obs.tokens.shape
        max_len = state.history.shape[1]
        idx = jnp.arange(t, dtype=jnp.int32)[None, :]
        pos = drop_invalid(obs.start[:, None] + idx, idx < obs.num_valid[:, None], max_len)
        rows = jnp.arange(b)
        hist = state.history.at[rows[:, None], pos].set(obs.tokens.astype(jnp.int32), mode="drop")
        n_last = obs.start + obs.num_valid
        hist = hist.at[rows, n_last].set(obs.next_token.astype(jnp.int32), mode="drop")
        return NGramState(history=hist, num_emitted=(n_last + 1).astype(jnp.int32))

    prefill = commit

    def propose(self, params, frozen, state: NGramState, key: jax.Array, *, gamma: int,
                sampling: Sampling = Sampling(), argmax: bool = False):
        del params, frozen, key, sampling, argmax
        hist, n = state.history, state.num_emitted
        b, max_len = hist.shape
        p = jnp.arange(max_len, dtype=jnp.int32)[None, :]  # candidate match end
        rows = jnp.arange(b)[:, None]
        found = jnp.zeros((b,), bool)
        best = jnp.zeros((b,), jnp.int32)
        for g in range(self.max_ngram, self.min_ngram - 1, -1):
            ok = (p >= g - 1) & (p <= n[:, None] - 2) & (n[:, None] >= g + 1)
            for i in range(g):
                suffix = jnp.take_along_axis(hist, jnp.clip(n - 1 - i, 0, max_len - 1)[:, None],
                                             axis=1)
                ok &= hist[rows, jnp.clip(p - i, 0, max_len - 1)] == suffix
            has = jnp.any(ok, axis=1)
            last = (max_len - 1 - jnp.argmax(ok[:, ::-1], axis=1)).astype(jnp.int32)
            best = jnp.where(~found & has, last, best)
            found |= has
        period = jnp.maximum(n - 1 - best, 1)
        k = jnp.arange(gamma, dtype=jnp.int32)[None, :]
        src = jnp.where(found[:, None], best[:, None] + 1 + k % period[:, None],
                        n[:, None] - 1)
        tokens = hist[rows, jnp.clip(src, 0, max_len - 1)]
        probs = jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32)
        return DraftOutput(tokens=tokens, probs=probs, confidences=None), state
