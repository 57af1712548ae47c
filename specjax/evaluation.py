"""Offline evaluation of drafters at held-out anchors: one real draft-and-verify step per anchor.

How acceptance is measured ("teacher-forced contexts, real drafting, real verification"). For a
held-out row ``t_0 .. t_{L-1}`` and an *anchor* position ``i`` (sampled per row), the speculative
state is exactly the one the decoding loop would be in after emitting ``t_0 .. t_{i+1}``: the
target's KV cache holds ``t_0 .. t_i`` and ``t_{i+1}`` is the anchor (the last emitted token); the
drafter's state is its prefill / commit on the same prefix. From that state one speculative step is
run with the same pieces as :func:`specjax.speculative.step`: the drafter *samples* ``γ`` drafts
from its own chain (each conditioned on its previous drafts, not on ground truth), the target scores
``[anchor, x_1 .. x_γ]`` in one cached forward, and the verifier (``rejection_sample`` /
``target_only_sample`` / ``greedy_verify`` of :mod:`specjax.verify`) accepts a prefix. So every
number is a real draft-and-verify outcome; only the *context* is held-out text instead of the
model's own earlier output (which is what makes thousands of independent steps cheap: one target
forward per row gives every anchor's cache and hidden states; see :func:`prefix_states`).

Per step the evaluation records ``num_accepted`` and, per draft position, the analytic acceptance
probability, TV, target entropy and the drafter's confidences (:func:`verify_at_anchors`), gathered
by :func:`evaluate_drafter` into :class:`~specjax.evaluation_stats.StepRecords` per (rule,
temperature) cell of the grid (:data:`DEFAULT_GRID`).

The statistics of those records (acceptance per position, τ, predicted E[τ], entropy fits:
:func:`~specjax.evaluation_stats.summarize`) live in :mod:`specjax.evaluation_stats`, and reports
(JSON, markdown tables, figures) in :mod:`specjax.evaluation_report`; both are re-exported here.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters import (DraftLMDrafter, DSparkDrafter, MTPDrafter, NGramDrafter,
                              Observation, Sampling)
from specjax.drafters.draft_lm import DraftLMState
from specjax.drafters.dspark import DSparkState
from specjax.drafters.mtp import MTPState
from specjax.drafters.ngram import NGramState
from specjax.evaluation_report import (plot_acceptance_per_position,  # noqa: F401 (re-exported)
                                       plot_acceptance_vs_entropy, results_markdown, to_jsonable,
                                       write_json)
from specjax.evaluation_stats import (ENTROPY_EDGES, StepRecords,  # noqa: F401 (re-exported)
                                      acceptance_by_position, binned_means, entropy, expected_tau,
                                      linear_fit, mean_accepted_length, summarize)
from specjax.models.graphdef import hash_once
from specjax.models.kv_cache import KVCache, init_cache
from specjax.models.transformer import apply
from specjax.verify import greedy_verify, rejection_sample, target_only_sample

__all__ = [
    "RULES", "DEFAULT_GRID", "anchor_positions", "prefix_states", "verify_at_anchors",
    "evaluate_drafter",
    # statistics (specjax.evaluation_stats)
    "acceptance_by_position", "mean_accepted_length", "expected_tau", "linear_fit", "entropy",
    "binned_means", "StepRecords", "ENTROPY_EDGES", "summarize",
    # reports (specjax.evaluation_report)
    "results_markdown", "plot_acceptance_per_position", "plot_acceptance_vs_entropy",
    "to_jsonable", "write_json",
]

RULES = ("rejection", "target_only", "greedy")
# (rule, temperature) pairs evaluated by default. At temperature 0 the target's and the drafter's
# distributions are one-hot, so rejection and target-only sampling *are* greedy verification.
DEFAULT_GRID = (("greedy", 0.0), ("rejection", 0.6), ("rejection", 1.0),
                ("target_only", 0.6), ("target_only", 1.0))


# ------------------------------------------------------------------------------------------------
# speculative states at teacher-forced anchors (jax)
# ------------------------------------------------------------------------------------------------
def anchor_positions(lengths, anchors_per_row: int, *, min_context: int = 4, seed: int = 0,
                     max_anchor: Optional[int] = None) -> np.ndarray:
    """``int32 [R, A]`` anchor positions ``i`` (``-1`` = none), uniformly without replacement
    among ``min_context − 1 ≤ i ≤ L − 2`` (the anchor token ``t_{i+1}`` is the row's last or an
    earlier token; at least ``min_context`` tokens precede it)."""
    lengths = np.asarray(lengths)
    rng = np.random.default_rng(seed)
    out = np.full((len(lengths), anchors_per_row), -1, np.int32)
    lo = max(min_context - 1, 0)
    for r, length in enumerate(lengths):
        hi = int(length) - 2 if max_anchor is None else min(int(length) - 2, max_anchor)
        if hi < lo:
            continue
        cand = np.arange(lo, hi + 1)
        pick = rng.choice(cand, size=min(anchors_per_row, cand.size), replace=False)
        out[r, :pick.size] = np.sort(pick)
    return out


def _take_rows(x: jax.Array, rows: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.take(x, rows, axis=axis)


@functools.partial(jax.jit, static_argnames=("target_graphdef", "drafter", "gamma", "max_len",
                                             "generic"))
def prefix_states(target_graphdef, target_params, drafter, params, frozen, tokens: jax.Array,
                  lengths: jax.Array, anchors: jax.Array, *, gamma: int, max_len: int,
                  generic: bool = False):
    """The speculative state of every anchor of every row, as after emitting ``t_0..t_{i+1}``.

    Args:
      tokens: int32 ``[R, T]`` rows; lengths: int32 ``[R]``; anchors: int32 ``[R, A]``
        (negative = unused; such slots get anchor 0 and must be ignored by the caller).
      gamma: draft length (fixes the drafter state's shapes); max_len: cache positions
        (``>= T + γ + 1``).
      generic: use each drafter's own ``prefill`` on every slot's prefix (slow, any drafter)
        instead of the fast per-drafter construction (one target / drafter pass per row, then
        per-anchor views; equal to the generic path, tested).
    Returns:
      ``(target_cache, drafter_state, anchor_token)`` for ``S = R·A`` slots (row-major).
    """
    r, t = tokens.shape
    a = anchors.shape[1]
    slot_row = jnp.repeat(jnp.arange(r), a)
    i = jnp.maximum(anchors.reshape(-1), 0)
    anchor_tok = tokens[slot_row, jnp.minimum(i + 1, t - 1)]
    target = nnx.merge(target_graphdef, target_params)
    tcache = init_cache(target.config, r, max_len)
    out = target(tokens, cache=tcache, num_valid=lengths, hidden_layers=drafter.hidden_layers)
    cache = KVCache(k=_take_rows(out.cache.k, slot_row, 1), v=_take_rows(out.cache.v, slot_row, 1),
                    lengths=(i + 1).astype(jnp.int32))
    hidden = out.hidden
    s = slot_row.shape[0]
    if generic:
        obs = Observation(tokens=tokens[slot_row], num_valid=(i + 1).astype(jnp.int32),
                          start=jnp.zeros((s,), jnp.int32), next_token=anchor_tok,
                          hidden=None if hidden is None else hidden[:, slot_row])
        state = drafter.prefill(params, frozen, drafter.init_state(s, max_len, gamma), obs)
        return cache, state, anchor_tok
    full = Observation(tokens=tokens, num_valid=lengths.astype(jnp.int32),
                       start=jnp.zeros((r,), jnp.int32), next_token=jnp.zeros((r,), jnp.int32),
                       hidden=hidden)
    if isinstance(drafter, DSparkDrafter):
        st = drafter.commit(params, frozen, drafter.init_state(r, max_len, gamma), full)
        state = DSparkState(k=tuple(x[slot_row] for x in st.k), v=tuple(x[slot_row] for x in st.v),
                            ctx_len=(i + 1).astype(jnp.int32), anchor=anchor_tok)
    elif isinstance(drafter, MTPDrafter):
        st = drafter.prefill(params, frozen, drafter.init_state(r, max_len, gamma), full)
        w = st.tokens.shape[1]
        n = i + 2
        ar = jnp.arange(w, dtype=jnp.int32)[None, :]
        pos_h = (n - 1 - w)[:, None] + ar
        h0 = hidden[0][slot_row[:, None], jnp.clip(pos_h, 0, t - 1)]
        h0 = jnp.where((pos_h >= 0)[..., None], h0, 0).astype(st.hidden.dtype)
        pos_t = (n - w)[:, None] + ar
        toks = jnp.where(pos_t >= 0, tokens[slot_row[:, None], jnp.clip(pos_t, 0, t - 1)], 0)
        state = MTPState(k=tuple(x[slot_row] for x in st.k), v=tuple(x[slot_row] for x in st.v),
                         hidden=h0, tokens=toks.astype(jnp.int32),
                         num_emitted=n.astype(jnp.int32))
    elif isinstance(drafter, DraftLMDrafter):
        dcache = init_cache(drafter.config, r, max_len)
        d_out = apply(drafter.graphdef, params, tokens, cache=dcache, num_valid=lengths)
        c = d_out.cache
        state = DraftLMState(
            cache=KVCache(k=_take_rows(c.k, slot_row, 1), v=_take_rows(c.v, slot_row, 1),
                          lengths=(i + 1).astype(jnp.int32)),
            pending=jnp.stack([anchor_tok, jnp.zeros_like(anchor_tok)], axis=1),
            num_pending=jnp.ones((s,), jnp.int32))
    elif isinstance(drafter, NGramDrafter):
        hist = jnp.zeros((s, max_len), jnp.int32).at[:, :t].set(tokens[slot_row])
        keep = jnp.arange(max_len)[None, :] <= (i + 1)[:, None]
        state = NGramState(history=jnp.where(keep, hist, 0), num_emitted=(i + 2).astype(jnp.int32))
    else:  # unknown drafter: fall back to its own prefill per slot
        obs = Observation(tokens=tokens[slot_row], num_valid=(i + 1).astype(jnp.int32),
                          start=jnp.zeros((s,), jnp.int32), next_token=anchor_tok,
                          hidden=None if hidden is None else hidden[:, slot_row])
        state = drafter.prefill(params, frozen, drafter.init_state(s, max_len, gamma), obs)
    return cache, state, anchor_tok


@functools.partial(jax.jit, static_argnames=("target_graphdef", "drafter", "gamma", "method"))
def verify_at_anchors(target_graphdef, target_params, drafter, params, frozen, cache: KVCache,
                      dstate, anchor_tok: jax.Array, key: jax.Array, temperature, *, gamma: int,
                      method: str = "rejection") -> dict:
    """One speculative step from every slot's state (nothing donated, nothing committed).

    Mirrors :func:`specjax.speculative.step` (draft with the drafter's own sampler → one target
    forward over ``[anchor, x_1..x_γ]`` → the verifier) and also returns the analytic quantities
    of :class:`~specjax.evaluation_stats.StepRecords`. Returns a dict of ``[S]`` / ``[S, γ]``
    arrays.
    """
    if method not in RULES:
        raise ValueError(f"method must be one of {RULES}, got {method!r}")
    sampling = Sampling(temperature=0.0 if method == "greedy" else temperature)
    k_draft, k_verify = jax.random.split(key)
    draft, _ = drafter.propose(params, frozen, dstate, k_draft, gamma=gamma, sampling=sampling,
                               argmax=(method == "target_only"))
    vt = jnp.concatenate([anchor_tok[:, None], draft.tokens], axis=1)
    logits = apply(target_graphdef, target_params, vt, cache=cache).logits  # [S, γ+1, V]
    p = sampling.probs(logits)
    if method == "greedy":
        ver = greedy_verify(draft.tokens, logits)
    elif method == "rejection":
        ver = rejection_sample(k_verify, draft.tokens, draft.probs, p)
    else:
        ver = target_only_sample(k_verify, draft.tokens, p)
    pk = p[:, :gamma]
    tv = 1.0 - jnp.sum(jnp.minimum(pk, draft.probs), axis=-1)
    p_x = jnp.take_along_axis(pk, draft.tokens[..., None], axis=-1)[..., 0]
    acc = 1.0 - tv if method == "rejection" else p_x
    raw = jax.nn.softmax(logits[:, :gamma].astype(jnp.float32), axis=-1)
    h_raw = entropy(raw)
    out = {"num_accepted": ver.num_accepted, "accept_prob": acc, "tv": tv,
           "entropy": h_raw if method == "greedy" else entropy(pk), "entropy_raw": h_raw}
    if draft.confidences is not None:
        out["confidences"] = draft.confidences
    return out


def evaluate_drafter(target, drafter, params, frozen, tokens, lengths, *, gamma: int,
                     grid: Sequence[tuple[str, float]] = DEFAULT_GRID, anchors_per_row: int = 8,
                     min_context: int = 4, seed: int = 0, max_slots: int = 256,
                     generic: bool = False) -> dict[tuple[str, float], StepRecords]:
    """Runs :func:`verify_at_anchors` over held-out rows for every (rule, temperature) in ``grid``.

    Args:
      target: ``(graphdef, params)`` of the target.
      drafter, params, frozen: the drafter (``frozen`` = its shared head, or None).
      tokens, lengths: held-out rows ``[R, T]`` / ``[R]`` (one sequence per row).
      gamma: draft length.
      grid: ``(rule, temperature)`` pairs.
      anchors_per_row: A (fewer where a row is short); min_context: tokens before the anchor.
      seed: anchor choice and sampling seed.
      max_slots: rows are processed in chunks of ``max_slots // A`` rows (memory: one target
        cache of ``T + γ + 1`` positions per slot).
      generic: see :func:`prefix_states`.
    Returns:
      ``{(rule, temperature): StepRecords}`` over the valid anchors.
    """
    graphdef, tparams = target
    graphdef = hash_once(graphdef)  # a static argument of every chunk's calls
    tokens = np.asarray(tokens, np.int32)
    lengths = np.asarray(lengths, np.int32)
    r, t = tokens.shape
    anchors = anchor_positions(lengths, anchors_per_row, min_context=min_context, seed=seed)
    max_len = t + gamma + 1
    rows_per_chunk = max(1, max_slots // anchors_per_row)
    n_chunks = -(-r // rows_per_chunk)
    rows_per_chunk = -(-r // n_chunks)  # balanced chunks: little padding in the last one
    base = jax.random.key(seed)
    parts: dict = {cell: [] for cell in grid}
    for c, s in enumerate(range(0, r, rows_per_chunk)):
        sel = np.arange(s, min(s + rows_per_chunk, r))
        tok, ln, an = tokens[sel], lengths[sel], anchors[sel]
        if len(sel) < rows_per_chunk:  # pad to a static chunk shape
            pad = rows_per_chunk - len(sel)
            tok = np.concatenate([tok, np.zeros((pad, t), np.int32)])
            ln = np.concatenate([ln, np.ones(pad, np.int32)])
            an = np.concatenate([an, np.full((pad, anchors_per_row), -1, np.int32)])
        valid = an.reshape(-1) >= 0
        row_of_step = np.repeat(np.pad(sel, (0, rows_per_chunk - len(sel)), constant_values=-1),
                                anchors_per_row)
        if not valid.any():
            continue
        cache, state, anchor_tok = prefix_states(
            graphdef, tparams, drafter, params, frozen, jnp.asarray(tok), jnp.asarray(ln),
            jnp.asarray(an), gamma=gamma, max_len=max_len, generic=generic)
        for j, (rule, temp) in enumerate(grid):
            key = jax.random.fold_in(jax.random.fold_in(base, c), j)
            out = verify_at_anchors(graphdef, tparams, drafter, params, frozen, cache, state,
                                    anchor_tok, key, jnp.float32(temp), gamma=gamma, method=rule)
            out = jax.device_get(out)
            parts[(rule, temp)].append(StepRecords(
                num_accepted=np.asarray(out["num_accepted"])[valid],
                accept_prob=np.asarray(out["accept_prob"], np.float64)[valid],
                tv=np.asarray(out["tv"], np.float64)[valid],
                entropy=np.asarray(out["entropy"], np.float64)[valid],
                entropy_raw=np.asarray(out["entropy_raw"], np.float64)[valid],
                confidences=(np.asarray(out["confidences"], np.float64)[valid]
                             if "confidences" in out else None),
                row=row_of_step[valid]))
    return {cell: StepRecords.concat(p) for cell, p in parts.items() if p}
