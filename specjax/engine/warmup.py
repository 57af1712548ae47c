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

import os

from typing import Optional

import jax
import numpy as np

from specjax.buckets import SPSProfile, profile_sps
from specjax.engine.loop_profile import production_loop_profile
from specjax.engine.loop_rows import prefill_rows
from specjax.engine.step_costs import default_context, device_loop_profile
from specjax.engine.steps import merge_rows, prefill_step, verify_step


def row_cache_path(path: Optional[str], rows: int) -> Optional[str]:
    """Where the ``rows``-row profile is kept beside ``EngineConfig.sps_cache``:
    ``sps.json`` -> ``sps.rows4.json``."""
    if not path:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rows{rows}{ext}"


class WarmupMixin:
    """Compilation and SPS profiling of :class:`~specjax.engine.engine.Engine`."""

    def warmup(self, *, profile: bool = True) -> None:
        """Compiles every prefill chunk bucket and the step programs (host loop: drafting and every
        verification bucket; device loop: the loop), on idle slots (nothing changes); then profiles
        SPS per bucket unless ``profile=False`` (the device loop profiles only for the policies
        that read SPS)."""
        if self.num_active or self.queue:
            raise RuntimeError("warmup() must run before requests are submitted")
        s, g = self.config.num_slots, self.config.gamma
        sampling = self._sampling()
        keys = self._slot_keys(0)
        for c in self.prefill_buckets:
            z = np.zeros(s, np.int32)
            self.state, _ = prefill_step(
                self.graphdef, self.target_state, self.drafter, self.params, self.frozen,
                self.state, np.zeros((s, c), np.int32), z, np.zeros(s, bool), z,
                np.zeros(s, bool), keys, sampling, max_len=self.config.max_len, gamma=g)
            for r in self.config.loop_row_buckets:  # admission into r rows (engine._admit)
                z = np.zeros(r, np.int32)
                self.state, _ = prefill_rows(
                    self.graphdef, self.target_state, self.drafter, self.params, self.frozen,
                    self.state, self._put(np.arange(r, dtype=np.int32)),
                    np.zeros((r, c), np.int32), z, np.zeros(r, bool), z, np.zeros(r, bool), keys,
                    sampling, max_len=self.config.max_len, gamma=g)
        policy = self.config.scheduler.policy
        key = (f"{jax.devices()[0].device_kind}/{self.model_config}/"
               f"{type(self.drafter).__name__}/S{s}/g{g}/L{self.config.max_len}")
        if self.config.loop == "device":
            self._warmup_device_loop()
            ctx = default_context(self.config)
            reps = self.config.profile_reps
            if profile and policy == "production":
                key += f"/production-loop/ctx{ctx}"
                measure = production_loop_profile
            elif profile and policy in ("dspark", "retrospective"):
                key += f"/device-loop/ctx{ctx}"
                measure = device_loop_profile
            else:
                return
            path = self.config.sps_cache
            full = self._cached_profile(key, lambda k: measure(self, reps=reps, key=k), path)
            by_rows = {r: self._cached_profile(
                f"{key}/rows{r}", lambda k, r=r: measure(self, reps=reps, key=k, rows=r),
                row_cache_path(path, r)) for r in self.config.loop_row_buckets}
            self.set_sps(full, by_rows=by_rows)
            return
        draft, dstate = self._draft()
        if self.config.loop == "host" and self.config.overlap:  # admissions under overlap merge pre-dispatched drafter rows
            merge_rows(self.drafter, np.zeros(s, bool), self.state.drafter_state, dstate,
                       max_len=self.config.max_len, gamma=g)
        idle = np.full(s, -1, np.int32)

        def run_bucket(b):
            self.state, res = verify_step(
                self.graphdef, self.target_state, self.drafter, self.params, self.frozen,
                self.state, draft.tokens, draft.probs, idle, keys, sampling, bucket=b, gamma=g,
                method=self.config.method, verify_impl=self.verify_impl)
            jax.block_until_ready(res.tokens)

        for b in self.buckets:
            run_bucket(b)
        if profile:
            self.set_sps(profile_sps(
                run_bucket, self.buckets, key=key, reps=self.config.profile_reps, warmup=0,
                cache_path=self.config.sps_cache,
                run_draft=lambda: jax.block_until_ready(self._draft())))

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
