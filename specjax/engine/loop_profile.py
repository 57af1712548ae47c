"""Production's step costs measured on the device loop itself (its own compiled program).

The production policy chooses, per step, between a plain decode step and a drafting step whose
verification fills a token bucket, by comparing tokens per second of each. The piece timings of
:mod:`specjax.engine.step_costs` (a draft, a verification, a plain step, each alone in a loop)
leave out what the loop adds around them (the policy, emitting tokens, the confidence history,
the conditional steps), and on a small model that is a large share of a step: in the serving
benchmark on the 2-core CPU (docs/SERVING.md) a drafting step of the loop cost 1.0-2.0x its
pieces' sum (median 1.5x), a plain step 1.0-1.9x the timed plain step (median 1.6x).

So the production engine times its own loop program: the budget search reads its SPS tables as
inputs, and tables that make exactly one choice win force the loop into that choice, with no new
compilation. Per token bucket ``b``: a drafting step whose verification fills ``b`` (``R`` active
slots, budget ``b - R``); and a plain step with every slot active. Each runs ``n`` steps per call
from ``EngineConfig.profile_context`` cached positions (``n`` chosen so the caches never overflow),
at temperature 1, median over repetitions. A check that the forced choice really happened (the
loop's drafting count) guards against a forcing that silently stops working.

With row buckets (``EngineConfig.row_buckets``) a call on ``R`` rows runs another program, whose
steps cost less than the all-slot program's; ``rows=R`` times that program (its reachable token
buckets only) so that the policy prices the steps it actually runs (``Engine.sps_rows``).
"""
from __future__ import annotations

import statistics
import time
from typing import Optional

import jax
import numpy as np

from specjax.buckets import SPSProfile
from specjax.engine.device_driver import STOP_WIDTH
from specjax.engine.device_loop import init_loop_state, run_loop
from specjax.engine.loop_rows import row_bucket_spec, run_loop_rows
from specjax.engine.step_costs import default_context, fill_unreachable

_HUGE, _TINY = 1e30, 1e-30


def production_loop_profile(eng, *, reps: int = 3, key: str = "",
                            rows: Optional[int] = None) -> SPSProfile:
    """The production engine's SPS profile, timed on its device loop (module docstring).

    Returns an :class:`~specjax.buckets.SPSProfile` whose ``steps_per_s[b]`` is the rate of a
    whole drafting step (draft, policy, verification in bucket ``b``, commits, emit), so
    ``draft_s = 0``, and ``plain_s`` the time of a plain step. Bucket 1 cannot hold a drafting
    step (a draft needs its anchor too) and copies the plain rate. ``rows``: time the program of
    that row bucket (``run_loop_rows`` on slots ``0..rows-1``) instead of the all-slot one;
    buckets it can never fill copy the rate of the largest it can
    (:func:`~specjax.engine.step_costs.fill_unreachable`). Leaves the engine idle.
    """
    cfg, spec = eng.config, eng._loop_spec
    if cfg.loop != "device" or spec.policy != "production":
        raise ValueError("production_loop_profile needs a device-loop engine with policy "
                         f"'production', got loop={cfg.loop!r}, policy={spec.policy!r}")
    if eng.num_active or eng.queue:
        raise RuntimeError("production_loop_profile must run on an idle engine")
    s, g = cfg.num_slots, cfg.gamma
    r = s if rows is None else rows
    run_spec = spec if rows is None else row_bucket_spec(cfg.loop_row_buckets, spec, rows)
    buckets = list(eng.buckets)
    ctx = default_context(cfg)
    n = int(np.clip((cfg.max_len - 1 - ctx) // (g + 1), 1, spec.max_steps))
    sampling = eng._sampling()
    sampling = eng._put(sampling._replace(temperature=np.ones(s, np.float32)))
    seeds = eng._put(np.arange(s, dtype=np.uint32))
    stops = eng._put(np.full((s, STOP_WIDTH), -1, np.int32))
    no_stop = eng._put(np.bool_(False))
    ones = eng._put(np.ones(buckets[-1] + 1, np.float32))

    def call(active_rows: int, sps_draft: np.ndarray, plain: float) -> tuple[float, int]:
        # fresh host copies of every field (init shares one zeros buffer between fields, and the
        # loop donates its state)
        ls = jax.device_get(init_loop_state(eng.state, s, g, spec.out_len,
                                            spec.explore_every)._replace(dev=None))
        dev = eng.state._replace(cache=eng.state.cache.rollback(np.full(s, ctx, np.int32)))
        ls = ls._replace(
            dev=dev, active=np.arange(s) < active_rows,
            remaining=np.full(s, 1 << 20, np.int32),
            t=np.int32(spec.max_steps - n),  # run n steps
            explore_gap=np.int32(1 << 30),  # never explore ...
            prior_seen=np.bool_(True))  # ... not even the cold start's first step
        t0 = time.perf_counter()
        args = (eng.graphdef, eng.target_state, eng.drafter, eng.params, eng.frozen, eng._put(ls))
        # the argument types the engine's calls pass (device_driver._run_loop: a committed int32
        # shrink point), so the profile runs the engine's compiled programs and compiles none
        rest = (sampling, seeds, stops, ones, eng._put(sps_draft.astype(np.float32)),
                eng._put(np.float32(plain)), eng._key, no_stop, eng._put(np.int32(-1)))
        if rows is None:
            out = run_loop(*args, *rest, spec=spec)
        else:
            out = run_loop_rows(*args, row_ids, *rest, spec=run_spec)
        steps, draws = (int(x) for x in jax.device_get((out.t, out.draws)))
        dt = time.perf_counter() - t0
        eng.state = out.dev
        if steps != spec.max_steps:
            raise RuntimeError(f"profile call ran {steps - spec.max_steps + n} of {n} steps")
        return dt / n, draws

    def timed(active_rows, sps_draft, plain, expect_draws):
        call(active_rows, sps_draft, plain)  # warm (no compilation: the loop's own program)
        times = []
        for _ in range(reps):
            dt, draws = call(active_rows, sps_draft, plain)
            if draws != expect_draws:
                raise RuntimeError(f"the forced choice did not hold: {draws} drafting steps of "
                                   f"{n}, expected {expect_draws}")
            times.append(dt)
        return statistics.median(times)

    row_ids = None if rows is None else eng._put(np.arange(rows, dtype=np.int32))
    zeros = np.zeros(buckets[-1] + 1)
    plain_s = timed(r, zeros, _HUGE, 0)
    rates = []
    for b in run_spec.buckets:
        if b < 2:
            rates.append(1.0 / plain_s)
            continue
        table = zeros.copy()
        table[b] = 1.0  # only a budget that fills bucket b scores above "no draft"
        rates.append(1.0 / timed(min(r, b - 1), table, _TINY, n))
    # committed to the engine's device like every other state array (an uncommitted one would
    # make the next prefill compile again)
    eng.state = eng.state._replace(
        cache=eng.state.cache.rollback(eng._put(np.zeros(s, np.int32))))
    eng._carry = None
    return SPSProfile(tuple(buckets), fill_unreachable(rates, len(buckets)), key, draft_s=0.0,
                      plain_s=plain_s)
