"""Warm-up: compile every program an engine runs, then measure SPS per token bucket.

After :meth:`WarmupMixin.warmup` a run compiles nothing (``tests/test_engine.py`` counts
compilations). The SPS profile (steps per second of each verification bucket) is what the
confidence policies trade acceptance against: the host loop times each bucket's verify step
(:func:`specjax.buckets.profile_sps`), the device loop times steps inside device-loop programs
(:func:`~specjax.engine.step_costs.device_loop_profile`; production: its own loop,
:func:`~specjax.engine.loop_profile.production_loop_profile`), and with row buckets once more per
row count, on that count's program (``Engine.sps_rows``: a call on ``R`` rows reads the ``R``-row
profile). ``EngineConfig.sps_cache`` keeps a profile on disk under a key naming the device kind,
model, drafter, slots, γ and ``max_len`` (row profiles beside it: :func:`row_cache_path`).
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Optional

import jax
import numpy as np

from specjax.buckets import SPSProfile, profile_sps
from specjax.engine.loop_profile import production_loop_profile
from specjax.engine.loop_rows import prefill_rows
from specjax.engine.step_costs import default_context, device_loop_profile
from specjax.engine.steps import (merge_rows, plain_commit_step, plain_decode_step, prefill_step,
                                  verify_step)


def row_cache_path(path: Optional[str], rows: int) -> Optional[str]:
    """Where the ``rows``-row profile is kept beside ``EngineConfig.sps_cache``:
    ``sps.json`` -> ``sps.rows4.json``."""
    if not path:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rows{rows}{ext}"


class WarmupMixin:
    """Compilation and SPS profiling of :class:`~specjax.engine.engine.Engine`."""

    def warmup(self, *, profile: bool = True,
               progress: Optional[Callable[[int, int, str], None]] = None) -> None:
        """Compiles every prefill chunk bucket and the step programs (host loop: drafting and every
        verification bucket; device loop: the loop, and its program per row bucket), on idle
        slots (nothing changes); then profiles SPS per bucket unless ``profile=False`` (the
        device loop profiles only for the policies that read SPS, once per row bucket too).

        ``progress(done, total, label)`` is called after each stage (a compiled program or a
        profile), e.g. to show a progress bar: warm-up takes seconds to minutes."""
        if self.num_active or self.queue:
            raise RuntimeError("warmup() must run before requests are submitted")
        stages = self._warmup_stages(profile)
        for i, (label, run) in enumerate(stages):
            run()
            if progress is not None:
                progress(i + 1, len(stages), label)

    def _warmup_stages(self, profile: bool) -> list[tuple[str, Callable[[], None]]]:
        """What :meth:`warmup` runs, in order: ``[(label, thunk)]``."""
        s, g = self.config.num_slots, self.config.gamma
        rows = self.config.loop_row_buckets
        sampling = self._sampling()
        keys = self._slot_keys(0)
        stages = []

        def on(r):
            return f" on {r} row{'s' if r > 1 else ''}"

        def prefill(c, r=None):
            n = s if r is None else r
            z = np.zeros(n, np.int32)
            chunk = (np.zeros((n, c), np.int32), z, np.zeros(n, bool), z, np.zeros(n, bool))
            weights = (self.graphdef, self.target_state, self.drafter, self.params, self.frozen)
            if r is None:
                self.state, _ = prefill_step(*weights, self.state, *chunk, keys, sampling,
                                             max_len=self.config.max_len, gamma=g,
                                             feed_drafter=self.feeds_drafter)
            else:  # admission into r rows (engine._admit)
                self.state, _ = prefill_rows(*weights, self.state,
                                             self._put(np.arange(r, dtype=np.int32)), *chunk,
                                             keys, sampling, max_len=self.config.max_len,
                                             gamma=g, feed_drafter=self.feeds_drafter)

        for c in self.prefill_buckets:
            stages.append((f"prefill chunk {c}", functools.partial(prefill, c)))
            stages += [(f"prefill chunk {c}{on(r)}", functools.partial(prefill, c, r))
                       for r in rows]
        policy = self.config.scheduler.policy
        key = (f"{jax.devices()[0].device_kind}/{self.model_config}/"
               f"{type(self.drafter).__name__}/S{s}/g{g}/L{self.config.max_len}")
        if self.config.loop == "device":
            stages.append(("device loop", lambda: self._run_loop(stop_on_finish=False,
                                                                 rows=range(s))))
            stages += [(f"device loop{on(r)}",
                        functools.partial(self._run_loop, stop_on_finish=False,
                                          rows=list(range(r)))) for r in rows]
            ctx = default_context(self.config)
            reps = self.config.profile_reps
            if profile and policy == "production":
                key += f"/production-loop/ctx{ctx}"
                measure = production_loop_profile
            elif profile and policy in ("dspark", "retrospective"):
                key += f"/device-loop/ctx{ctx}"
                measure = device_loop_profile
            else:
                return stages
            path = self.config.sps_cache
            found: dict = {}

            def profile_rows(r):
                k, cache = (key, path) if r is None else (f"{key}/rows{r}", row_cache_path(path, r))
                found[r] = self._cached_profile(
                    k, lambda k: measure(self, reps=reps, key=k, rows=r), cache)
                if len(found) == 1 + len(rows):
                    full = found.pop(None)
                    self.set_sps(full, by_rows=found)

            stages.append(("SPS profile", functools.partial(profile_rows, None)))
            stages += [(f"SPS profile{on(r)}", functools.partial(profile_rows, r))
                       for r in rows]
            return stages
        if policy == "none":  # the host loop's plain decode step: no drafter, no buckets
            def plain():
                self.state, tok = plain_decode_step(self.graphdef, self.target_state, self.state,
                                                    np.zeros(s, bool), keys, sampling)
                jax.block_until_ready(tok)
            stages.append(("plain decode step", plain))
            return stages
        held = {}

        def draft():
            held["draft"], dstate = self._draft()
            if self.config.overlap:  # admissions under overlap merge pre-dispatched drafter rows
                merge_rows(self.drafter, np.zeros(s, bool), self.state.drafter_state, dstate,
                           max_len=self.config.max_len, gamma=g)

        idle = np.full(s, -1, np.int32)

        def run_bucket(b):
            d = held["draft"]
            self.state, res = verify_step(
                self.graphdef, self.target_state, self.drafter, self.params, self.frozen,
                self.state, d.tokens, d.probs, idle, keys, sampling, bucket=b, gamma=g,
                method=self.config.method, verify_impl=self.verify_impl)
            jax.block_until_ready(res.tokens)

        stages.append(("drafting step", draft))
        stages += [(f"verification bucket {b}", functools.partial(run_bucket, b))
                   for b in self.buckets]
        def plain():  # production's steps at budget 0 (host_loop._plain_step)
            self.state, tok = plain_commit_step(self.graphdef, self.target_state, self.drafter,
                                                self.params, self.frozen, self.state,
                                                np.zeros(s, bool), keys, sampling)
            jax.block_until_ready(tok)

        run_plain = plain if policy == "production" else None
        if run_plain is not None:
            stages.append(("plain step", run_plain))
            key += "/host-plain"  # profiles saved without plain_s are measured again
        if profile:
            stages.append(("SPS profile", lambda: self.set_sps(profile_sps(
                run_bucket, self.buckets, key=key, reps=self.config.profile_reps, warmup=0,
                cache_path=self.config.sps_cache,
                run_draft=lambda: jax.block_until_ready(self._draft()), run_plain=run_plain))))
        return stages

    def _cached_profile(self, key: str, measure, path: Optional[str]) -> SPSProfile:
        """The device loop's SPS profile: ``measure(key)`` (production: its own loop timed,
        :func:`~specjax.engine.loop_profile.production_loop_profile`; Algorithm 1: steps timed
        inside device loops, :func:`~specjax.engine.step_costs.device_loop_profile`), or the one
        saved at ``path`` under the same key (then re-saved there)."""
        if path and os.path.exists(path):
            saved = SPSProfile.load(path)
            if saved.key == key and list(saved.buckets) == self.buckets:
                return saved
        prof = measure(key)
        if path:
            prof.save(path)
        return prof

    def set_sps(self, profile: SPSProfile,
                by_rows: Optional[dict[int, SPSProfile]] = None) -> None:
        """Uses a given SPS profile (e.g. a hand-made one in tests), and for the device loop's
        row buckets the profiles in ``by_rows`` (row count -> profile; a row count left out,
        or ``by_rows=None``, reads ``profile``)."""
        by_rows = dict(by_rows or {})
        for r, prof in [(None, profile), *by_rows.items()]:
            if list(prof.buckets) != self.buckets:
                raise ValueError(f"profile buckets {prof.buckets} != engine buckets "
                                 f"{self.buckets}" + ("" if r is None else f" (rows {r})"))
        bad = sorted(set(by_rows) - set(self.config.loop_row_buckets))
        if bad:
            raise ValueError(f"profiles for rows {bad}: the engine's row buckets are "
                             f"{self.config.loop_row_buckets}")
        self.sps, self.sps_table = profile, profile.table()
        self.sps_table_draft = profile.table_with_draft()
        self.sps_rows = by_rows
        if self.config.loop == "device":  # committed now, so the first call compiles nothing
            for r in (None, *self.config.loop_row_buckets):
                self._device_sps(r)
