"""The device loop on the active slots only: row buckets (``EngineConfig.row_buckets``).

Every step of :func:`~specjax.engine.device_loop.run_loop` computes all ``S`` slots: an idle
slot still drafts, still sits in the verification's attention grid and still reads its cache
window, and an admission feeds a ``[S, C]`` prompt chunk that is mostly padding. On a lightly
loaded server that is most of the work (``docs/SERVING.md``, "Idle slots", measures it). Slots
only *leave* during a device-loop call (admission happens between calls), so the host knows
before each call how many rows the call can need. With row buckets it picks the smallest
compiled row count ``R >= active`` and :func:`run_loop_rows` gathers those ``R`` slots (the
active ones, padded with distinct idle ones) out of every per-slot array, runs the same loop on
them, and scatters the rows back, in one program: two copies of ``R`` cache rows per call instead
of ``S - R`` idle rows in every step. Admission does the same: :func:`prefill_rows` feeds a
prompt chunk to the admitted slots only, padded to a row bucket. A call also returns as soon as
the slots still active fit the next smaller row bucket (:func:`shrink_point`), so that a batch
whose requests end at different times (RL rollouts) runs its tail on fewer rows without waiting
for ``loop_steps``.

Exactness: a row's computation never reads another row (verification noise is keyed by each
request's seed and step count), so the loop on a subset of rows emits what it would emit on all
``S``, except that drafting noise is drawn per row of the batch: drafts are still drawn from the
q returned with them, which is all the verifier needs (``tests/test_engine_rows.py`` checks
equal greedy outputs, equal sampled outputs with a deterministic drafter, and the output
distribution with a sampling one). The confidence policies read the SPS profile of the program
they run in: warm-up times one per row bucket (``Engine.sps_rows``), since a step on ``R`` rows
costs less than one on all ``S``, and the policies weigh a drafting step against a plain one and
one token bucket against another by those costs.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.engine.device_loop import LoopSpec, LoopState, run_loop
from specjax.engine.steps import DeviceState, batch_axes, prefill_step

# LoopState fields with a leading slot axis (the rest are scalars or per-position [γ] arrays
# shared by all slots: they pass through whole).
_ROW_FIELDS = ("active", "remaining", "steps", "out", "out_len", "drafted", "accepted",
               "reached", "conf_hist", "hist_n")


def pick_rows(active: Sequence[bool], row_buckets: Sequence[int]) -> Optional[list]:
    """The slots a call runs: the active ones, then idle ones up to the smallest row bucket that
    holds them; ``None`` when no bucket does (the call runs every slot).

    Args:
      active: ``[S]`` slot holds a running request.
      row_buckets: ascending row counts (``EngineConfig.loop_row_buckets``).
    Returns:
      distinct slot indices (active first, ascending), or ``None``.
    """
    busy = [i for i, a in enumerate(active) if a]
    r = next((b for b in row_buckets if b >= len(busy)), None)
    if r is None:
        return None
    idle = [i for i, a in enumerate(active) if not a]
    return busy + idle[:r - len(busy)]


def shrink_point(rows: Optional[int], row_buckets: Sequence[int]) -> int:
    """How few active slots make a call on ``rows`` rows (``None``: every slot) return, so that
    the next call runs on a smaller row bucket: the largest bucket below ``rows`` (-1: none)."""
    below = [b for b in row_buckets if rows is None or b < rows]
    return below[-1] if below else -1


def spec_for_rows(spec: LoopSpec, rows: int) -> LoopSpec:
    """The loop spec for ``rows`` slots: verification buckets past the first that holds
    ``rows · (γ + 1)`` tokens can never be chosen, so they are not compiled."""
    need = rows * (spec.gamma + 1)
    first = next((i for i, b in enumerate(spec.buckets) if b >= need), len(spec.buckets) - 1)
    return dataclasses.replace(spec, buckets=tuple(spec.buckets[:first + 1]))


def row_bucket_spec(row_buckets: Sequence[int], spec: LoopSpec, rows: int) -> LoopSpec:
    """:func:`spec_for_rows` for one of the engine's row buckets (``EngineConfig.
    loop_row_buckets``); ``ValueError`` for any other row count (no program is compiled for it)."""
    if rows not in row_buckets:
        raise ValueError(f"rows={rows} is not one of the engine's row buckets {tuple(row_buckets)}")
    return spec_for_rows(spec, rows)


def device_state_axes(drafter, dev: DeviceState, gamma: int) -> DeviceState:
    """The slot axis of every leaf of ``dev`` (``None``: shared by all slots)."""
    cache = dev.cache
    dstate_axes = batch_axes(drafter, dev.drafter_state, cache.num_slots, cache.max_len, gamma)
    return DeviceState(cache=cache.replace(k=1, v=1, lengths=0), drafter_state=dstate_axes,
                       anchor=0)


def loop_state_axes(drafter, ls: LoopState, gamma: int) -> LoopState:
    """The slot axis of every leaf of ``ls`` (``None``: shared by all slots)."""
    dev = device_state_axes(drafter, ls.dev, gamma)
    shared = {f: None for f in LoopState._fields if f not in _ROW_FIELDS + ("dev",)}
    return LoopState(dev=dev, **{f: 0 for f in _ROW_FIELDS}, **shared)


def _drafter_state_whole(axes: DeviceState) -> DeviceState:
    """``axes`` with the drafter state marked shared: take/put pass it through whole (for
    programs that never read it; gathering and scattering it costs a copy of every buffer)."""
    return axes._replace(drafter_state=jax.tree.map(lambda _: None, axes.drafter_state))


def take_rows(tree, rows: jax.Array, axes):
    """Per leaf: the ``rows`` along its slot axis (leaves with axis ``None`` whole)."""
    return jax.tree.map(lambda x, ax: x if ax is None else jnp.take(x, rows, axis=ax), tree, axes)


def put_rows(full, sub, rows: jax.Array, axes):
    """Per leaf: ``full`` with its ``rows`` (along the slot axis) replaced by ``sub``'s; leaves
    with axis ``None`` are ``sub``'s (the loop's shared counters and statistics)."""
    def put(f, s, ax):
        if ax is None:
            return s
        return f.at[(slice(None),) * ax + (rows,)].set(s)
    return jax.tree.map(put, full, sub, axes)


def slot_args(tree, rows):
    """The ``rows`` of per-slot loop arguments (sampling fields: ``[S]`` arrays); scalars
    apply to every row and pass whole."""
    return jax.tree.map(lambda x: x[rows] if jnp.ndim(x) else x, tree)


@functools.partial(jax.jit, static_argnames=("target_graphdef", "drafter", "spec"),
                   donate_argnames=("ls",))
def run_loop_rows(target_graphdef: nnx.GraphDef, target_state, drafter, params, frozen,
                  ls: LoopState, rows: jax.Array, sampling, seeds, stop_tokens, sps, sps_draft,
                  sps_plain, key, stop_on_finish, shrink_at=-1, *,
                  spec: LoopSpec) -> LoopState:
    """:func:`~specjax.engine.device_loop.run_loop` on the slots ``rows`` (int32 ``[R]``,
    distinct) of the ``S``-slot loop state ``ls`` (donated); the other slots are left as they
    are. ``spec`` is the loop spec for ``R`` rows (:func:`spec_for_rows`); the other arguments
    are ``run_loop``'s, with their ``[S]`` slot axis. Returns the whole ``S``-slot state."""
    axes = loop_state_axes(drafter, ls, spec.gamma)
    if spec.policy == "none":  # never drafts: the drafter state rides along, not gathered
        axes = axes._replace(dev=_drafter_state_whole(axes.dev))
    sub = take_rows(ls, rows, axes)
    # run_loop's undecorated function: traced into this program, not a nested jit call
    sub = run_loop.__wrapped__(target_graphdef, target_state, drafter, params, frozen, sub,
                               slot_args(sampling, rows), seeds[rows], stop_tokens[rows], sps,
                               sps_draft, sps_plain, key, stop_on_finish, shrink_at, spec=spec)
    return put_rows(ls, sub, rows, axes)


@functools.partial(jax.jit, static_argnames=("target_graphdef", "drafter", "max_len", "gamma",
                                             "feed_drafter"), donate_argnames=("state",))
def prefill_rows(target_graphdef: nnx.GraphDef, target_state, drafter, params, frozen,
                 state: DeviceState, rows: jax.Array, tokens, num_valid, reset,
                 next_prompt_token, is_last, first_keys, sampling, *, max_len: int, gamma: int,
                 feed_drafter: bool = True):
    """:func:`~specjax.engine.steps.prefill_step` on the slots ``rows`` (int32 ``[R]``, distinct)
    of the ``S``-slot ``state`` (donated): the chunk arrays (``tokens [R, C]``, ``num_valid``,
    ``reset``, ``next_prompt_token``, ``is_last``) are per row already; ``first_keys`` and
    ``sampling`` keep their ``[S]`` slot axis. A row with ``num_valid = 0`` is left as it is.
    ``feed_drafter``: as ``prefill_step``'s (False: the drafter state is not gathered either).
    Returns ``(DeviceState for all S slots, first_token int32 [R])``."""
    axes = device_state_axes(drafter, state, gamma)
    if not feed_drafter:
        axes = _drafter_state_whole(axes)
    sub, first = prefill_step.__wrapped__(
        target_graphdef, target_state, drafter, params, frozen, take_rows(state, rows, axes),
        tokens, num_valid, reset, next_prompt_token, is_last, first_keys[rows],
        slot_args(sampling, rows), max_len=max_len, gamma=gamma, feed_drafter=feed_drafter)
    return put_rows(state, sub, rows, axes), first
