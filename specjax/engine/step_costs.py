"""Step costs as the device loop pays them: each step timed inside one jitted ``fori_loop``.

A step dispatched from the host also pays for the dispatch and the host's own work, and on a small
model that is a large, noisy share of it. The device loop (:mod:`specjax.engine.device_loop`)
pays neither, so its scheduler's steps-per-second profile (DSpark §5.1, "SPS") is measured here
the same way: ``n`` steps back to back in one program, median over repetitions.

Everything a timed step reads (state, drafts, draft lengths, keys, sampling parameters) travels in
the loop's carry, and every output stays in it: a step input that is a compile-time constant, or
an output nobody reads, lets XLA fold or delete the work, and the step looks nearly free
(``tests/test_production_plain.py`` checks the compiled programs' flops).

Used by :meth:`Engine.warmup <specjax.engine.engine.Engine.warmup>` for the device loop's
profile (with row buckets, one per row count: the steps on ``R`` gathered slots) and by
``benchmarks/spec_vs_plain.py`` for its analytic prediction.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from specjax.buckets import SPSProfile
from specjax.engine.device_loop import LoopSpec, plain_step, bucketed_verify, init_loop_state
from specjax.engine.loop_rows import device_state_axes, row_bucket_spec, slot_args, take_rows
from specjax.engine.steps import DeviceState


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of ``fn()`` over ``reps`` calls, after one untimed call (compiles)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def loop_program(fn: Callable, n: int):
    """The jitted program ``carry -> carry`` that runs ``fn(i, carry) -> carry`` ``n`` times in a
    ``fori_loop`` and returns the whole final carry (so no output of a step is dead code)."""
    # The barrier makes every iteration depend on the previous one: without it XLA hoists
    # work on loop-invariant inputs (a drafter whose propose does not change its state) out of
    # the loop, and the step looks nearly free.
    body = lambda i, c: fn(i, jax.lax.optimization_barrier(c))  # noqa: E731
    return jax.jit(lambda c: jax.lax.fori_loop(0, n, body, c))


def loop_time(fn: Callable, carry, reps: int, n: int) -> float:
    """Seconds per iteration of ``fn(i, carry) -> carry`` run ``n`` times in one jitted
    ``fori_loop`` (no dispatch, no host work); median of ``reps`` calls. ``carry`` is a pytree of
    arrays passed as the program's argument: put every input of the step in it, not in a closure."""
    run = loop_program(fn, n)
    return median_seconds(lambda: run(carry), reps) / n


class ProfileAux(NamedTuple):
    """The non-state inputs of the profiled steps, carried through the loop.

    tokens int32 [S, γ], probs [S, γ, V]: a draft (the draft step replaces them with its own).
    num_draft int32 [S]: ℓ per slot (−1 = idle slot). keys: per-slot sampling keys. sampling: the
    engine's sampling parameters. lengths int32 [S]: the context the cache is rolled back to after
    each step. weights: ``(target_state, drafter params, drafter frozen)``.
    """
    tokens: jax.Array
    probs: jax.Array
    num_draft: jax.Array
    keys: jax.Array
    sampling: object
    lengths: jax.Array
    weights: tuple


def _keep_positions(new, old):
    """``new`` drafter state with every integer leaf (positions, tokens, lengths) taken from
    ``old``: the float leaves (caches, hidden states) keep the commit's writes, the positions
    stay where they were, so a timed step reads and writes the same context every iteration."""
    return jax.tree.map(lambda n, o: o if jnp.issubdtype(o.dtype, jnp.integer) else n, new, old)


def bucket_draft_lengths(num_slots: int, gamma: int, bucket: int) -> jax.Array:
    """ℓ per slot for a verification that fills ``bucket`` tokens: the bucket's tokens spread over
    the slots (each verifies ℓ + 1 ≤ γ + 1 tokens; −1 marks a slot with none)."""
    per = [bucket // num_slots + (i < bucket % num_slots) for i in range(num_slots)]
    return jnp.asarray([min(t, gamma + 1) - 1 for t in per], jnp.int32)


def fill_unreachable(rates: Sequence[float], num_buckets: int) -> tuple:
    """``rates`` of the first buckets, padded to ``num_buckets`` with the last one: a row
    bucket's program never fills the buckets past the first that holds all its tokens
    (:func:`~specjax.engine.loop_rows.spec_for_rows`), and this keeps its profile the engine's
    shape (the policies never read those entries: no budget reaches them)."""
    rates = tuple(float(x) for x in rates)
    if not 0 < len(rates) <= num_buckets:
        raise ValueError(f"{len(rates)} rates for {num_buckets} buckets")
    return rates + (rates[-1],) * (num_buckets - len(rates))


def profile_steps(eng, context: int, rows: Optional[int] = None) -> tuple[dict, tuple]:
    """The device loop's steps as ``fn(i, carry) -> carry``, each with ``carry = (state, aux)``
    (:class:`ProfileAux`).

    Returns ``({name: fn}, {name: carry})`` with names ``"verify/<bucket>"`` (the bucket's forward in the
    loop's switch over buckets, the verifier and the commits, for slots whose ℓ fill the bucket),
    ``"draft"`` (one drafting call of every slot) and ``"plain"`` (production's non-drafting step:
    target forward, sampling, drafter commit). Every slot's cache holds ``context`` positions; the
    target cache is rolled back to it after each step, and a verification keeps the drafter's
    positions (:func:`_keep_positions`). ``rows``: the steps of a call on that many rows (slots
    ``0..rows-1`` gathered, as :mod:`specjax.engine.loop_rows` runs them), and only the buckets
    such a call can fill.
    """
    s, g = eng.config.num_slots, eng.config.gamma
    d, p, f = eng.drafter, eng.params, eng.frozen
    buckets = tuple(eng.buckets)
    state: DeviceState = eng.state._replace(
        cache=eng.state.cache.rollback(jnp.full((s,), context, jnp.int32)))
    sampling, keys = eng._sampling(), eng._slot_keys(0)
    if rows is not None:  # the call's rows, gathered as run_loop_rows gathers them
        ids = jnp.arange(rows)
        state = take_rows(state, ids, device_state_axes(d, state, g))
        sampling, keys = slot_args(sampling, ids), keys[ids]
        buckets = row_bucket_spec(eng.config.loop_row_buckets, eng._loop_spec, rows).buckets
        s = rows
    lengths = jnp.full((s,), context, jnp.int32)
    dkey = eng._next_key()
    drafts, _ = jax.jit(lambda st, sm: d.propose(p, f, st.drafter_state, dkey, gamma=g,
                                                 sampling=sm))(state, sampling)
    aux = ProfileAux(drafts.tokens, drafts.probs, jnp.full((s,), -1, jnp.int32),
                     keys, sampling, lengths, (eng.target_state, p, f))

    def verify(i, carry):
        st, ax = carry
        ts, p, f = ax.weights
        st2, _ = bucketed_verify(eng.graphdef, ts, d, p, f, st, ax.tokens, ax.probs,
                                 ax.num_draft, ax.keys, ax.sampling, buckets=buckets, gamma=g,
                                 method=eng.config.method, verify_impl=eng.verify_impl)
        # the target cache back to the context; the drafter keeps its committed caches (live: carried)
        # but not its advanced positions, so its context does not drift either
        return st2._replace(cache=st2.cache.rollback(ax.lengths),
                            drafter_state=_keep_positions(st2.drafter_state,
                                                          st.drafter_state)), ax

    def draft(i, carry):
        st, ax = carry
        _, p, f = ax.weights
        out, ds = d.propose(p, f, st.drafter_state, jax.random.fold_in(dkey, i), gamma=g,
                            sampling=ax.sampling)
        return st._replace(drafter_state=ds), ax._replace(tokens=out.tokens, probs=out.probs)

    spec = LoopSpec(policy="production", gamma=g, buckets=buckets, method="rejection",
                    max_steps=1)
    ls0 = init_loop_state(state, s, g, spec.out_len)

    def plain(i, carry):
        st, ax = carry
        ts, p, f = ax.weights
        ls = ls0._replace(dev=st, active=jnp.ones((s,), bool))
        dev, _ = plain_step(eng.graphdef, ts, ls, ax.sampling, ax.keys, d, p, f)
        return dev._replace(cache=dev.cache.rollback(ax.lengths)), ax

    fns = {f"verify/{b}": verify for b in buckets}
    fns.update(draft=draft, plain=plain)
    carries = {f"verify/{b}": (state, aux._replace(num_draft=bucket_draft_lengths(s, g, b)))
               for b in buckets}
    carries.update(draft=(state, aux), plain=(state, aux))
    return fns, carries


def default_context(config) -> int:
    """The context the profile is timed at: ``config.profile_context``, else ``max_len // 4``."""
    if config.profile_context is not None:
        return config.profile_context
    return min(config.max_len // 4, config.max_len - config.gamma - 1)


def device_loop_profile(eng, *, reps: int = 3, n: int = 16, key: str = "",
                        context: int | None = None, rows: Optional[int] = None) -> SPSProfile:
    """The engine's SPS profile measured in device loops (see :func:`profile_steps`).

    Per verification bucket: steps/s of a verification whose drafts fill the bucket. ``draft_s``:
    one drafting call of every slot. ``plain_s``: the plain decode step production runs when it
    does not draft. All at ``context`` cached positions per slot (default
    :func:`default_context`). ``rows``: the same for a call on that row bucket; buckets it can
    never fill copy the last it can (:func:`fill_unreachable`).
    """
    ctx = default_context(eng.config) if context is None else context
    fns, carries = profile_steps(eng, ctx, rows)
    t = {name: loop_time(fn, carries[name], reps, n) for name, fn in fns.items()}
    timed = [b for b in eng.buckets if f"verify/{b}" in t]
    return SPSProfile(tuple(eng.buckets),
                      fill_unreachable([1.0 / t[f"verify/{b}"] for b in timed], len(eng.buckets)),
                      key, draft_s=t["draft"], plain_s=t["plain"])
