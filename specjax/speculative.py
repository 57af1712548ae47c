"""Reference speculative decoding loop (batched, static shapes, jitted steps).

One step for B rows with independent lengths::

    draft      x_1..x_γ, q, c  = drafter.propose(...)               (drafter state updated)
    verify     target forward over [anchor, x_1..x_γ] with the KV cache (+ the hidden states the
               drafter needs); p = logits_to_probs(logits, same sampling settings as q)
    accept     rejection_sample | target_only_sample | greedy_verify   (per-row num_draft ≤ γ)
    commit     target cache lengths += accepted + 1 (rollback by lengths);
               drafter.commit(Observation(anchor + drafts, accepted + 1, start, next token, hidden))

Everything in a step is one ``jax.jit`` function of pytrees (target params, drafter params, frozen
shared head, :class:`SpecState`), donating the state. :func:`generate` drives it from the host
for offline evaluation and tests: it prefills the prompts (one ragged target forward; the first
new token is sampled from the target alone), steps until every row has ``max_new_tokens``, and
returns the emitted tokens per row and per-step acceptance statistics. Rows that are finished keep
stepping with the batch (static shapes); their outputs are discarded and their cache writes past
``max_len`` are dropped. The serving engine (scheduling, buckets, flattened verification) reuses
the same pieces.

Methods: ``"rejection"`` (lossless for any temperature / top-k / top-p), ``"target_only"`` (drafts
are ``argmax q``; lossless), ``"greedy"`` (temperature 0 for drafter and target; reproduces greedy
decoding token for token).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters.base import Observation, Sampling
from specjax.models.graphdef import hash_once
from specjax.models.kv_cache import KVCache, init_cache
from specjax.models.transformer import apply
from specjax.sampling import sample
from specjax.verify import greedy_verify, rejection_sample, target_only_sample

__all__ = ["METHODS", "SpecState", "StepOutput", "SpecResult", "prefill", "step", "generate"]

METHODS = ("rejection", "target_only", "greedy")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """Decoding state of B rows.

    cache: the target's KV cache; ``cache.lengths[b]`` = tokens of row b consumed by the target.
    drafter_state: the drafter's own state pytree.
    anchor: int32 ``[B]``: last emitted token (position ``cache.lengths``), fed at the next verify.
    """

    cache: KVCache
    drafter_state: Any
    anchor: jax.Array


class StepOutput(NamedTuple):
    """One step's results (all ``[B, ...]``).

    tokens: int32 ``[B, γ+1]``: ``tokens[b, :num_accepted[b] + 1]`` were emitted, the rest are -1.
    num_accepted: int32 ``[B]``.
    num_draft: int32 ``[B]``: drafts verified (≤ γ).
    draft_tokens: int32 ``[B, γ]``.
    confidences: f32 ``[B, γ]`` or ``None``.
    """

    tokens: jax.Array
    num_accepted: jax.Array
    num_draft: jax.Array
    draft_tokens: jax.Array
    confidences: Optional[jax.Array]


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


@functools.partial(jax.jit, static_argnames=("target_graphdef", "drafter", "max_len", "gamma",
                                             "method"))
def prefill(target_graphdef: nnx.GraphDef, target_state, drafter, params, frozen,
            tokens: jax.Array, lengths: jax.Array, key: jax.Array, sampling: Sampling = Sampling(),
            *, max_len: int, gamma: int, method: str = "rejection"):
    """Prefills the target and the drafter with ragged prompts.

    Args:
      target_graphdef, target_state: the target (``nnx.split``).
      drafter, params, frozen: the drafter (static), its params and the frozen shared head.
      tokens: int32 ``[B, T]`` right-padded prompts; lengths: int32 ``[B]`` (>= 1).
      key: PRNG key for the first token.
      sampling: sampling settings (ignored for ``method="greedy"``: temperature 0).
      max_len: cache positions per row; gamma: draft length (fixes the drafter state's shapes).
    Returns:
      ``(SpecState, first_token int32 [B])``: the first new token, sampled from the target alone.
    """
    _check_method(method)
    target = nnx.merge(target_graphdef, target_state)
    b = tokens.shape[0]
    lengths = jnp.asarray(lengths, jnp.int32)
    cache = init_cache(target.config, b, max_len)
    out = target(tokens, cache=cache, num_valid=lengths, hidden_layers=drafter.hidden_layers,
                 logits_at=lengths - 1)
    last = out.logits[:, 0]
    if method == "greedy":
        first = jnp.argmax(last, axis=-1).astype(jnp.int32)
    else:
        first = sample(key, sampling.probs(last))
    dstate = drafter.init_state(b, max_len, gamma)
    obs = Observation(tokens=jnp.asarray(tokens, jnp.int32), num_valid=lengths,
                      start=jnp.zeros((b,), jnp.int32), next_token=first, hidden=out.hidden)
    dstate = drafter.prefill(params, frozen, dstate, obs)
    return SpecState(cache=out.cache, drafter_state=dstate, anchor=first), first


@functools.partial(jax.jit, static_argnames=("target_graphdef", "drafter", "gamma", "method"),
                   donate_argnames=("state",))
def step(target_graphdef: nnx.GraphDef, target_state, drafter, params, frozen, state: SpecState,
         key: jax.Array, sampling: Sampling = Sampling(), num_draft: Optional[jax.Array] = None, *,
         gamma: int, method: str = "rejection"):
    """One speculative step (draft γ → verify → accept → commit); donates ``state``.

    ``num_draft`` (int32 ``[B]``, default γ) limits how many drafts each row verifies (a scheduler's
    choice; it must not depend on the drafts it admits — docs/DESIGN.md, "Invariants" 1). Returns
    ``(SpecState, StepOutput)``.
    """
    _check_method(method)
    if method == "greedy":
        sampling = Sampling(temperature=0.0)
    key_draft, key_verify = jax.random.split(key)
    draft, dstate = drafter.propose(params, frozen, state.drafter_state, key_draft, gamma=gamma,
                                    sampling=sampling, argmax=(method == "target_only"))
    b = state.anchor.shape[0]
    nd = (jnp.full((b,), gamma, jnp.int32) if num_draft is None
          else jnp.clip(jnp.asarray(num_draft, jnp.int32), 0, gamma))
    verify_tokens = jnp.concatenate([state.anchor[:, None], draft.tokens], axis=1)
    start = state.cache.lengths
    out = apply(target_graphdef, target_state, verify_tokens, cache=state.cache,
                hidden_layers=drafter.hidden_layers)
    if method == "greedy":
        ver = greedy_verify(draft.tokens, out.logits, nd)
    else:
        target_probs = sampling.probs(out.logits)
        if method == "rejection":
            ver = rejection_sample(key_verify, draft.tokens, draft.probs, target_probs, nd)
        else:
            ver = target_only_sample(key_verify, draft.tokens, target_probs, nd)
    a = ver.num_accepted
    nxt = jnp.take_along_axis(ver.tokens, a[:, None], axis=1)[:, 0]
    cache = out.cache.rollback(start + a + 1)
    obs = Observation(tokens=verify_tokens, num_valid=a + 1, start=start, next_token=nxt,
                      hidden=out.hidden)
    dstate = drafter.commit(params, frozen, dstate, obs)
    new_state = SpecState(cache=cache, drafter_state=dstate, anchor=nxt)
    return new_state, StepOutput(tokens=ver.tokens, num_accepted=a, num_draft=nd,
                                 draft_tokens=draft.tokens, confidences=draft.confidences)


@dataclasses.dataclass
class SpecResult:
    """Output of :func:`generate`.

    tokens: new tokens per row (``max_new_tokens`` each, fewer if EOS stopped the row; EOS kept).
    num_accepted, num_draft, num_emitted: int ``[steps, B]`` per step (the prefill is not a step).
    active: bool ``[steps, B]``: the row still needed tokens at that step (stats should use these).
    confidences: float ``[steps, B, γ]`` or ``None``.
    """

    tokens: list
    num_accepted: np.ndarray
    num_draft: np.ndarray
    num_emitted: np.ndarray
    active: np.ndarray
    confidences: Optional[np.ndarray]

    @property
    def mean_accepted(self) -> float:
        """Mean accepted drafts per (active row, step)."""
        return float(self.num_accepted[self.active].mean()) if self.active.any() else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean emitted tokens per (active row, step) = accepted + 1 (τ)."""
        return float(self.num_emitted[self.active].mean()) if self.active.any() else 0.0

    def acceptance_by_position(self) -> np.ndarray:
        """``[γ]``: P(draft k accepted | drafts < k accepted and k verified), over active steps."""
        a = self.num_accepted[self.active]
        nd = self.num_draft[self.active]
        g = int(self.num_draft.max()) if self.num_draft.size else 0
        out = np.zeros(g)
        for k in range(g):
            reached = (a >= k) & (nd > k)
            out[k] = (a[reached] > k).mean() if reached.any() else np.nan
        return out


def generate(target, drafter, params, frozen, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, *, gamma: int = 4, method: str = "rejection",
             sampling: Sampling = Sampling(), seed: int = 0, eos_id: Optional[int] = None,
             max_len: Optional[int] = None) -> SpecResult:
    """Speculative decoding of a batch of prompts (host loop over jitted steps).

    Args:
      target: the target :class:`~specjax.models.Transformer` or its ``(graphdef, state)``.
      drafter, params, frozen: the drafter, its params and its frozen inputs
        (:func:`~specjax.drafters.shared_head` for MTP / DSpark, else ``None``).
      prompts: B non-empty token lists (different lengths allowed).
      max_new_tokens: new tokens per row (the first comes from the prefill).
      gamma: draft length; method: ``"rejection"``, ``"target_only"`` or ``"greedy"``.
      sampling: shared sampling settings (scalars or ``[B]`` arrays).
      seed: PRNG seed; eos_id: stop a row after this token (kept in its output).
      max_len: cache positions per row (default: longest prompt + max_new_tokens + γ + 1).
    """
    _check_method(method)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    graphdef, state = target if isinstance(target, tuple) else nnx.split(target)
    graphdef = hash_once(graphdef)  # a static argument of every step
    b = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    need = int(lengths.max()) + max_new_tokens + gamma + 1
    max_len = need if max_len is None else max_len
    if max_len < need:
        raise ValueError(f"max_len {max_len} < longest prompt + max_new_tokens + gamma + 1 = {need}")
    t_pad = -(-int(lengths.max()) // 8) * 8
    tokens = np.zeros((b, t_pad), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    base = jax.random.key(seed)
    spec, first = prefill(graphdef, state, drafter, params, frozen, jnp.asarray(tokens),
                          jnp.asarray(lengths), jax.random.fold_in(base, 0), sampling,
                          max_len=max_len, gamma=gamma, method=method)
    out_tokens = [[int(t)] for t in np.asarray(first)]
    done = np.array([eos_id is not None and t[0] == eos_id for t in out_tokens]) | (max_new_tokens <= 1)
    acc, nds, emitted, active, confs = [], [], [], [], []
    i = 0
    while not done.all():
        i += 1
        spec, out = step(graphdef, state, drafter, params, frozen, spec,
                         jax.random.fold_in(base, i), sampling, gamma=gamma, method=method)
        toks, a = np.asarray(out.tokens), np.asarray(out.num_accepted)
        act = ~done
        acc.append(a)
        nds.append(np.asarray(out.num_draft))
        emitted.append(a + 1)
        active.append(act)
        if out.confidences is not None:
            confs.append(np.asarray(out.confidences))
        for r in np.flatnonzero(act):
            for t in toks[r, :a[r] + 1]:
                out_tokens[r].append(int(t))
                if (eos_id is not None and t == eos_id) or len(out_tokens[r]) >= max_new_tokens:
                    done[r] = True
                    break
    stack = lambda xs, dt: np.stack(xs) if xs else np.zeros((0, b), dt)
    return SpecResult(tokens=out_tokens, num_accepted=stack(acc, np.int32),
                      num_draft=stack(nds, np.int32), num_emitted=stack(emitted, np.int32),
                      active=stack(active, bool), confidences=np.stack(confs) if confs else None)
