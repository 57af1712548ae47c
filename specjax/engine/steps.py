"""Device steps of the serving engine: draft, flattened verification, prefill (all jitted).

The host loop (:mod:`specjax.engine.engine`) dispatches them one by one; the device loop
(:mod:`specjax.engine.device_loop`) traces the same verification in two halves
(:func:`verify_forward` in a bucket branch, then :func:`verify_finish`) inside ``lax.while_loop``.

Static shapes everywhere: S slots, γ drafts, a token bucket N for the flattened verification batch
and a chunk bucket C for prefill are the only shape parameters; every step is compiled once per
bucket (at engine warm-up) and never again.

Flattened verification (docs/DESIGN.md, "Flattened verification"; DSpark §5.3): slot s verifies
``num_draft[s] = ℓ_s`` drafts (``-1`` = slot idle this step). Its ``1 + ℓ_s`` tokens
``[anchor, x_1..x_ℓ]`` are packed contiguously, slot by slot, into a 1-D batch of N tokens
(segment id = slot, padding = S). One target forward (:meth:`Transformer.forward_flat`) runs the
dense layers on those N tokens and attends each slot's tokens to the slot's cache. The logits are
gathered back to ``[S, γ+1, V]``, the request's sampling transform is applied, and the verifier
decides; the cache and the drafter are committed by lengths (rejected tokens are rolled back).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.drafters.base import Observation, Sampling
from specjax.models.kv_cache import KVCache, NewKV
from specjax.sampling import all_greedy, sample
from specjax.verify import (rejection_sample, rejection_sample_with_noise, target_only_sample,
                            target_only_sample_with_noise)


class DeviceState(NamedTuple):
    """Everything the engine keeps on the device for S slots.

    cache: target :class:`KVCache` (``lengths [S]`` = tokens each slot's target has consumed).
    drafter_state: the drafter's state pytree for S rows.
    anchor: int32 ``[S]``: last emitted token of each slot (fed to the target at the next verify).
    """

    cache: KVCache
    drafter_state: Any
    anchor: jax.Array


class VerifyResult(NamedTuple):
    """tokens int32 ``[S, γ+1]`` (emitted ``tokens[s, :num_accepted[s]+1]``; -1 after),
    num_accepted int32 ``[S]`` (0 for idle slots)."""

    tokens: jax.Array
    num_accepted: jax.Array


@functools.partial(jax.jit, static_argnames=("drafter", "gamma", "argmax"))
def draft_step(drafter, params, frozen, drafter_state, key, sampling: Sampling, *, gamma: int,
               argmax: bool):
    """All slots draft γ tokens: returns ``(DraftOutput, drafter_state)`` (not donated)."""
    return drafter.propose(params, frozen, drafter_state, key, gamma=gamma, sampling=sampling,
                           argmax=argmax)


def flat_layout(num_draft: jax.Array, bucket: int):
    """Packing of ``1 + ℓ_s`` tokens per active slot into N = ``bucket`` flat entries.

    Returns ``(slot [N], rank [N], offsets [S], valid [N])``: flat entry n holds token ``rank[n]``
    (0 = anchor, j = draft j) of slot ``slot[n]``; ``offsets[s]`` is where slot s starts.
    """
    s = num_draft.shape[0]
    count = jnp.where(num_draft >= 0, num_draft + 1, 0)
    ends = jnp.cumsum(count)
    offsets = ends - count
    n = jnp.arange(bucket, dtype=jnp.int32)
    slot = jnp.searchsorted(ends, n, side="right").astype(jnp.int32)
    valid = slot < s
    slot_c = jnp.minimum(slot, s - 1)
    rank = n - offsets[slot_c]
    return jnp.where(valid, slot, s), jnp.where(valid, rank, 0), offsets, valid


class VerifyForward(NamedTuple):
    """What the flattened target forward of a verification step produces, on the per-slot grid.

    logits: f32 ``[S, γ+1, V]`` (row j of slot s: the target's logits after its token j).
    hidden: ``[n, S, γ+1, D]`` hidden states for the drafter, or None.
    cache: the cache with the new tokens' keys/values written (``write=True``), or None.
    new_kv: those keys/values unwritten (:class:`~specjax.models.kv_cache.NewKV`;
      ``write=False``), or None.
    """

    logits: jax.Array
    hidden: Any
    cache: Optional[KVCache]
    new_kv: Optional[NewKV]


def verify_forward(target_graphdef: nnx.GraphDef, target_state, drafter, state: DeviceState,
                   draft_tokens, num_draft, *, bucket: int, gamma: int, write: bool = True,
                   pad_to: Optional[int] = None) -> VerifyForward:
    """The target forward of a flattened verification in a token bucket.

    ``write=False`` only reads the cache: the device loop runs it inside its ``lax.switch``
    over buckets (``pad_to`` = the largest bucket, so every branch returns the same shapes) and
    the keys/values are written after the switch (:func:`verify_finish`). A branch that wrote
    the cache made XLA copy the whole cache into and out of the conditional on every step.
    ``write=True`` (the host loop's jitted step, no conditional around it) writes them during
    the forward (:meth:`~specjax.models.Transformer.forward_flat`).
    """
    cache = state.cache
    s = cache.num_slots
    slot, rank, offsets, valid = flat_layout(num_draft, bucket)
    slot_c = jnp.minimum(slot, s - 1)
    seq = jnp.concatenate([state.anchor[:, None], draft_tokens], axis=1)  # [S, γ+1]
    flat_tokens = jnp.where(valid, seq[slot_c, jnp.minimum(rank, gamma)], 0)
    target = nnx.merge(target_graphdef, target_state)
    if write:
        out = target.forward_flat(flat_tokens, slot, cache, grid_len=gamma + 1,
                                  hidden_layers=drafter.hidden_layers)
        new_kv = None
    else:
        out, new_kv = target.forward_flat_kv(flat_tokens, slot, cache, grid_len=gamma + 1,
                                             hidden_layers=drafter.hidden_layers)
        if pad_to is not None:
            new_kv = new_kv.pad(pad_to, cache.max_len)
    # Back to the per-slot grid [S, γ+1] (entries past 1 + ℓ_s are never read by the verifier).
    grid = jnp.minimum(offsets[:, None] + jnp.arange(gamma + 1)[None, :], bucket - 1)
    hidden = None if out.hidden is None else out.hidden[:, grid]
    return VerifyForward(logits=out.logits[grid], hidden=hidden, cache=out.cache, new_kv=new_kv)


def verify_finish(drafter, params, frozen, state: DeviceState, fwd: VerifyForward, draft_tokens,
                  draft_probs, num_draft, verify_keys, sampling: Sampling, *, method: str,
                  verify_impl: str = "jnp"):
    """Verifies on the grid logits, writes the new keys/values, commits caches and drafter.

    Returns ``(DeviceState, VerifyResult)`` (arguments as :func:`verify_core`).
    """
    cache = state.cache
    active = num_draft >= 0
    nd = jnp.maximum(num_draft, 0)
    target_probs = sampling.probs(fwd.logits)

    def noisy():
        if method == "rejection":
            return rejection_sample(verify_keys, draft_tokens, draft_probs, target_probs, nd,
                                    impl=verify_impl)
        return target_only_sample(verify_keys, draft_tokens, target_probs, nd)

    def quiet():  # every active row greedy: p and q one-hot, the noise decides nothing
        b, k = draft_tokens.shape
        u = jnp.zeros((b, k), jnp.float32)
        e = jnp.ones((b, target_probs.shape[-1]), jnp.float32)
        if method == "rejection":
            return rejection_sample_with_noise(draft_tokens, draft_probs, target_probs, u, e, nd)
        return target_only_sample_with_noise(draft_tokens, target_probs, u, e, nd)

    ver = jax.lax.cond(all_greedy(sampling.temperature, where=active), quiet, noisy)
    accepted = jnp.where(active, ver.num_accepted, 0)
    nxt = jnp.take_along_axis(ver.tokens, accepted[:, None], axis=1)[:, 0]
    nxt = jnp.where(active, nxt, state.anchor)
    start = cache.lengths
    lengths = jnp.where(active, start + accepted + 1, start)
    seq = jnp.concatenate([state.anchor[:, None], draft_tokens], axis=1)
    obs = Observation(tokens=seq, num_valid=jnp.where(active, accepted + 1, 0), start=start,
                      next_token=nxt, hidden=fwd.hidden)
    dstate = drafter.commit(params, frozen, state.drafter_state, obs)
    written = fwd.cache if fwd.cache is not None else fwd.new_kv.write(cache)
    new_state = DeviceState(cache=written.rollback(lengths), drafter_state=dstate, anchor=nxt)
    tokens = jnp.where(active[:, None], ver.tokens, -1)
    return new_state, VerifyResult(tokens=tokens, num_accepted=accepted)


def verify_core(target_graphdef: nnx.GraphDef, target_state, drafter, params, frozen,
                state: DeviceState, draft_tokens, draft_probs, num_draft, verify_keys,
                sampling: Sampling, *, bucket: int, gamma: int, method: str,
                verify_impl: str = "jnp", write_during: bool = True):
    """Flattened verification of every slot's admitted drafts, then commit.

    :func:`verify_forward` then :func:`verify_finish`; jitted as :func:`verify_step` for the
    host loop (the device loop calls the two halves around its bucket switch).

    Args:
      draft_tokens: int32 ``[S, γ]``; draft_probs: f32 ``[S, γ, V]`` (the q they were drawn from).
      num_draft: int32 ``[S]``: drafts to verify per slot, ``-1`` for idle slots;
        ``Σ_{s active} (1 + ℓ_s) ≤ bucket``.
      verify_keys: ``[S]`` PRNG keys (one per slot: a request's verification noise depends only on
        its own key).
      sampling: per-slot sampling settings (``[S]`` fields); temperature 0 rows are greedy.
      method: "rejection" or "target_only".
      verify_impl: rejection sampler, "jnp" or "pallas" (resolved by the engine from
        ``EngineConfig.verify_impl``).
      write_during: True (the host loop) writes the new keys/values inside the forward, layer by
        layer; False reads the cache only and writes them all after it, the order of the device
        loop's step. Same results; ahead-of-time reports compile both (``specjax.aot``).
    Returns:
      ``(DeviceState, VerifyResult)``.
    """
    fwd = verify_forward(target_graphdef, target_state, drafter, state, draft_tokens, num_draft,
                         bucket=bucket, gamma=gamma, write=write_during)
    return verify_finish(drafter, params, frozen, state, fwd, draft_tokens, draft_probs,
                         num_draft, verify_keys, sampling, method=method, verify_impl=verify_impl)


verify_step = functools.partial(jax.jit, static_argnames=(
    "target_graphdef", "drafter", "bucket", "gamma", "method", "verify_impl", "write_during"),
    donate_argnames=("state",))(
        verify_core)
verify_step.__doc__ = "Jitted :func:`verify_core` (donates ``state``)."


def batch_axes(drafter, state_like, num_slots: int, max_len: int, gamma: int):
    """Which axis of each leaf of the drafter state is the slot axis (found from shapes alone).

    Compares abstract states for ``S`` and ``S + 1`` rows; leaves without a slot axis get ``None``.
    """
    a = jax.eval_shape(lambda: drafter.init_state(num_slots, max_len, gamma))
    b = jax.eval_shape(lambda: drafter.init_state(num_slots + 1, max_len, gamma))

    def axis(x, y):
        diff = [i for i, (m, n) in enumerate(zip(x.shape, y.shape)) if m != n]
        return diff[0] if diff else None

    return jax.tree.map(axis, a, b)


def select_rows(mask: jax.Array, new, old, axes):
    """Per leaf: rows (along its slot axis) where ``mask`` from ``new``, the others from ``old``."""
    def pick(n, o, ax):
        if ax is None:
            return o
        shape = [1] * n.ndim
        shape[ax] = mask.shape[0]
        return jnp.where(mask.reshape(shape), n, o)

    return jax.tree.map(pick, new, old, axes)


@functools.partial(jax.jit, static_argnames=("drafter", "max_len", "gamma"))
def merge_rows(drafter, mask: jax.Array, new, old, *, max_len: int, gamma: int):
    """Drafter state with the rows where ``mask`` (bool ``[S]``) from ``new``, the rest from ``old``."""
    axes = batch_axes(drafter, old, mask.shape[0], max_len, gamma)
    return select_rows(mask, new, old, axes)


def sample_rows(keys, logits: jax.Array, sampling: Sampling, greedy=False) -> jax.Array:
    """One token per row from ``logits [S, V]`` under each row's sampling, with its own key
    (``keys``: ``[S]`` keys, or a function that makes them). Returns int32 ``[S]``.

    ``greedy`` (bool scalar: every row that matters is at temperature 0) takes the argmax of the
    logits and builds neither the probabilities nor the keys: at temperature 0
    :func:`~specjax.sampling.logits_to_probs` is the one-hot of the first argmax of the logits,
    whatever the filters, so the tokens are the same. (Inside the device loop the keys'
    derivation, two threefry loops per slot, would otherwise run every step.)
    """
    def draw():
        row_keys = keys() if callable(keys) else keys
        return jax.vmap(sample)(row_keys, sampling.probs(logits))

    return jax.lax.cond(jnp.asarray(greedy, bool),
                        lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32), draw)


def plain_forward(target_graphdef: nnx.GraphDef, target_state, state: DeviceState, active,
                  sampling: Sampling, keys, hidden_layers: tuple = ()):
    """One dense ``[S, 1]`` decode step of the target: each active slot (bool ``[S]``) consumes
    its anchor and draws the next token from the target's distribution (as the bonus token of a
    verification of no drafts is, without the flattened layout or the verifier). ``keys``: as
    :func:`sample_rows`. Returns ``(forward output, tokens int32 [S], new anchors int32 [S])``;
    the output's cache holds the new keys / values, its ``hidden`` the ``hidden_layers``."""
    target = nnx.merge(target_graphdef, target_state)
    res = target(state.anchor[:, None], cache=state.cache, num_valid=active.astype(jnp.int32),
                 hidden_layers=hidden_layers)
    tok = sample_rows(keys, res.logits[:, 0], sampling,
                      all_greedy(sampling.temperature, where=active))
    return res, tok, jnp.where(active, tok, state.anchor)


def plain_commit(target_graphdef: nnx.GraphDef, target_state, state: DeviceState, active,
                 sampling: Sampling, keys, drafter, params, frozen):
    """:func:`plain_forward`, then the drafter's state committed as after a verification of no
    drafts (the anchor and the target's hidden states at it): production's steps that do not
    draft. Returns ``(DeviceState, tokens int32 [S])``."""
    res, tok, anchor = plain_forward(target_graphdef, target_state, state, active, sampling, keys,
                                     drafter.hidden_layers)
    obs = Observation(tokens=state.anchor[:, None], num_valid=active.astype(jnp.int32),
                      start=state.cache.lengths, next_token=anchor, hidden=res.hidden)
    dstate = drafter.commit(params, frozen, state.drafter_state, obs)
    return DeviceState(res.cache, dstate, anchor), tok


@functools.partial(jax.jit, static_argnames=("target_graphdef", "drafter"),
                   donate_argnames=("state",))
def plain_commit_step(target_graphdef: nnx.GraphDef, target_state, drafter, params, frozen,
                      state: DeviceState, active, keys, sampling: Sampling):
    """The host loop's production step at budget 0: :func:`plain_commit` (the device loop runs
    the same function). ``active`` bool ``[S]``, ``keys`` ``[S]``. Returns ``(DeviceState,
    tokens int32 [S])``."""
    return plain_commit(target_graphdef, target_state, state, active, sampling, keys, drafter,
                        params, frozen)


def plain_decode(target_graphdef: nnx.GraphDef, target_state, state: DeviceState, active,
                 sampling: Sampling, keys):
    """:func:`plain_forward` with the drafter state passed through untouched: policy "none".
    Returns ``(DeviceState, tokens int32 [S])``."""
    res, tok, anchor = plain_forward(target_graphdef, target_state, state, active, sampling, keys)
    return DeviceState(res.cache, state.drafter_state, anchor), tok


@functools.partial(jax.jit, static_argnames=("target_graphdef",), donate_argnames=("state",))
def plain_decode_step(target_graphdef: nnx.GraphDef, target_state, state: DeviceState, active,
                      keys, sampling: Sampling):
    """The host loop's step under policy "none": :func:`plain_decode` (the device loop runs the
    same function; nothing reads the drafter state). Returns ``(DeviceState, tokens int32 [S])``."""
    return plain_decode(target_graphdef, target_state, state, active, sampling, keys)


@functools.partial(jax.jit, static_argnames=("target_graphdef", "drafter", "max_len", "gamma",
                                             "feed_drafter"), donate_argnames=("state",))
def prefill_step(target_graphdef: nnx.GraphDef, target_state, drafter, params, frozen,
                 state: DeviceState, tokens, num_valid, reset, next_prompt_token, is_last,
                 first_keys, sampling: Sampling, *, max_len: int, gamma: int,
                 feed_drafter: bool = True):
    """Feeds one prompt chunk per prefilling slot; samples the first token where the prompt ends.

    Args:
      tokens: int32 ``[S, C]`` chunk per slot (C = chunk bucket); num_valid: int32 ``[S]`` real
        tokens (0 for slots not prefilling).
      reset: bool ``[S]``: a new request starts in this slot (its lengths restart at 0).
      next_prompt_token: int32 ``[S]``: the prompt token after this chunk (slots not finishing).
      is_last: bool ``[S]``: the chunk ends the prompt (then the first new token is sampled from
        the target alone at the last prompt position).
      first_keys: ``[S]`` PRNG keys for that first token.
      feed_drafter: False skips the drafter (no hidden states, no drafter prefill: its state is
        returned as it came). For engines that never draft (policy "none"): they never read it
        (the host loop's verification commits it, as after ℓ = 0, into a state nothing reads).
    Returns:
      ``(DeviceState, first_token int32 [S])`` (first_token valid where ``is_last``).
    """
    target = nnx.merge(target_graphdef, target_state)
    cache = state.cache
    start = jnp.where(reset, 0, cache.lengths)
    cache = cache.rollback(start)
    out = target(tokens, cache=cache, num_valid=num_valid,
                 hidden_layers=drafter.hidden_layers if feed_drafter else (),
                 logits_at=jnp.maximum(num_valid - 1, 0))
    last = out.logits[:, 0]
    first = sample_rows(first_keys, last, sampling,
                        all_greedy(sampling.temperature, where=num_valid > 0))
    prefilling = num_valid > 0
    nxt = jnp.where(is_last, first, jnp.where(prefilling, next_prompt_token, state.anchor))
    if not feed_drafter:
        return DeviceState(cache=out.cache, drafter_state=state.drafter_state, anchor=nxt), first
    obs = Observation(tokens=tokens, num_valid=num_valid, start=start, next_token=nxt,
                      hidden=out.hidden)
    dstate = drafter.prefill(params, frozen, state.drafter_state, obs)
    # Slots that are not prefilling keep their drafter state exactly (a drafter's prefill may
    # reset buffers it would otherwise update incrementally).
    axes = batch_axes(drafter, state.drafter_state, cache.num_slots, max_len, gamma)
    dstate = select_rows(prefilling, dstate, state.drafter_state, axes)
    return DeviceState(cache=out.cache, drafter_state=dstate, anchor=nxt), first
