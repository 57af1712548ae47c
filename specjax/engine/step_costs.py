"""Step costs as the device loop pays them: each step timed inside one jitted ``fori_loop``.

A step dispatched from the host also pays for the dispatch and the host's own work, and on a small
model that is a large, noisy share of it. The device loop (:mod:`specjax.engine.device_loop`)
pays neither, so its scheduler's steps-per-second profile (DSpark §5.1, "SPS") is measured here
the same way: ``n`` steps back to back in one program, median over repetitions.

Used by :meth:`Engine.warmup <specjax.engine.engine.Engine.warmup>` for the device loop's
profile and by ``benchmarks/spec_vs_plain.py`` for its analytic prediction.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp

from specjax import scheduling
from specjax.engine.device_loop import LoopSpec, _plain_step, init_loop_state
from specjax.engine.steps import DeviceState, verify_finish, verify_forward


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of ``fn()`` over ``reps`` calls, after one untimed call (compiles)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def loop_time(fn: Callable, state, reps: int, n: int) -> float:
    """Seconds per iteration of ``fn(i, state) -> state`` run ``n`` times in one jitted
    ``fori_loop`` (no dispatch, no host work); median of ``reps`` calls."""
    # The barrier makes every iteration depend on the previous one: without it XLA hoists
    # work on loop-invariant state (a drafter whose propose does not change its state) out of
    # the loop, and the step looks nearly free.
    body = lambda i, st: fn(i, jax.lax.optimization_barrier(st))  # noqa: E731
    run = jax.jit(lambda st: jax.lax.fori_loop(0, n, body, st))
    return median_seconds(lambda: run(state), reps) / n


def device_loop_profile(eng, *, reps: int = 3, n: int = 16, key: str = "") -> scheduling.SPSProfile:
    """The engine's SPS profile measured in device loops, on its current (idle) state.

    Per verification bucket: the bucket's read-only forward and the verifier and commits, as the
    loop runs them, on a bucket of padding tokens (idle slots: nothing changes). ``draft_s``: one
    drafting call of every slot. ``plain_s``: the plain decode step production runs when it does
    not draft (target forward, sampling, drafter commit).
    """
    s, g = eng.config.num_slots, eng.config.gamma
    d, p, f = eng.drafter, eng.params, eng.frozen
    sampling = eng._sampling()
    keys = eng._slot_keys(0)
    state: DeviceState = eng.state
    dkey = eng._next_key()
    drafts, _ = jax.jit(lambda st: d.propose(p, f, st.drafter_state, dkey, gamma=g,
                                             sampling=sampling))(state)
    idle = jnp.full((s,), -1, jnp.int32)

    def verify(bucket):
        def step(i, st):
            fwd = verify_forward(eng.graphdef, eng.target_state, d, st, drafts.tokens, idle,
                                 bucket=bucket, gamma=g, write=False, pad_to=eng.buckets[-1])
            st2, _ = verify_finish(d, p, f, st, fwd, drafts.tokens, drafts.probs, idle, keys,
                                   sampling, method=eng.config.method,
                                   verify_impl=eng.verify_impl)
            return st2
        return step

    def draft(i, st):
        out, ds = d.propose(p, f, st.drafter_state, jax.random.fold_in(dkey, i), gamma=g,
                            sampling=sampling)
        # the tokens feed the next iteration, so the draft is never dead code
        return st._replace(drafter_state=ds, anchor=out.tokens[:, -1] * 0 + st.anchor)

    spec = LoopSpec(policy="production", gamma=g, buckets=tuple(eng.buckets), method="rejection",
                    max_steps=1)
    ls0 = init_loop_state(state, s, g, spec.out_len)
    lengths = state.cache.lengths

    def plain(i, st):
        ls = ls0._replace(dev=st, active=jnp.ones((s,), bool))
        dev, _ = _plain_step(eng.graphdef, eng.target_state, ls, sampling, keys, d, p, f)
        return dev._replace(cache=dev.cache.rollback(lengths), anchor=st.anchor)

    sps = [1.0 / loop_time(verify(b), state, reps, n) for b in eng.buckets]
    return scheduling.SPSProfile(tuple(eng.buckets), tuple(sps), key,
                                 draft_s=loop_time(draft, state, reps, n),
                                 plain_s=loop_time(plain, state, reps, n))
