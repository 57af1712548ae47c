"""Host side of the device loop (``EngineConfig.loop="device"``): admit, call, stream, finish.

Each call of :meth:`DeviceLoopMixin._device_call` admits queued requests (prefill), hands the
slots' budgets, step counts, seeds and stop tokens to :func:`specjax.engine.device_loop.run_loop`,
and reads back once: the tokens each slot emitted, its new step count and per-position
acceptance. It returns early when a slot finishes while requests wait, so that admission is
never delayed by more than one device step.
"""
from __future__ import annotations

import functools
import time
from typing import Optional

import jax
import numpy as np

from specjax.engine.device_loop import LoopSpec, LoopState, init_loop_state, run_loop
from specjax.engine.loop_rows import pick_rows, run_loop_rows, shrink_point, spec_for_rows
from specjax.engine.requests import LoopStats

# Stop tokens per request are padded to a multiple of this (a request with more stop tokens
# compiles the loop once more for the larger width).
STOP_WIDTH = 4


class DeviceLoopMixin:
    """The device-loop half of :class:`~specjax.engine.engine.Engine`."""

    @functools.cached_property
    def _loop_spec(self) -> LoopSpec:
        """The loop's static spec (fixed by the engine's config: built once)."""
        cfg = self.config
        sch = cfg.scheduler
        return LoopSpec(policy=sch.policy, gamma=cfg.gamma, buckets=tuple(self.buckets),
                        method=cfg.method, max_steps=cfg.loop_steps, k=sch.k,
                        threshold=sch.threshold, explore_every=sch.explore_every,
                        stale_decay=sch.stale_decay,
                        verify_impl=self.verify_impl, calibrate=cfg.online_calibration)

    def _put(self, x):
        return jax.device_put(x, self._device)

    def _loop_inputs(self, stop_on_finish: bool):
        """Host arrays for one call: the loop state around ``self.state`` and the per-slot
        seeds / stop tokens / stop flag (:meth:`_run_loop` commits the host arrays among them to
        the engine's device, with the rest of the call's inputs, in one transfer)."""
        s, g = self.config.num_slots, self.config.gamma
        spec = self._loop_spec
        carry = self._carry
        if carry is None:
            # committed to the engine's device, as every later carry (a call's output) is
            carry = self._put(init_loop_state(self.state, s, g, spec.out_len, spec.explore_every))
        active = np.zeros(s, bool)
        remaining = np.zeros(s, np.int32)
        steps = np.zeros(s, np.int32)
        seeds = np.zeros(s, np.uint32)
        width = max([len(l.request.stop_tokens) for l in self.slots if l is not None] + [1])
        width = -(-width // STOP_WIDTH) * STOP_WIDTH
        stops = np.full((s, width), -1, np.int32)
        for i, live in enumerate(self.slots):
            if live is None:
                continue
            r = live.request
            active[i] = True
            remaining[i] = r.max_new_tokens - live.generated
            steps[i] = live.verify_steps
            seeds[i] = r.seed
            stops[i, :len(r.stop_tokens)] = r.stop_tokens
        hist_n = np.asarray(carry.hist_n) * ~self._new_rows  # admitted rows start a history
        self._new_rows[:] = False
        ls = LoopState(
            dev=self.state, active=active, remaining=remaining, steps=steps,
            out=np.full((s, spec.out_len), -1, np.int32), out_len=np.zeros(s, np.int32),
            drafted=np.zeros((s, g), np.int32), accepted=np.zeros((s, g), np.int32),
            reached=np.zeros((s, g), np.int32),
            conf_hist=carry.conf_hist, hist_n=hist_n.astype(np.int32), prior=carry.prior,
            prior_seen=carry.prior_seen, cal_acc=carry.cal_acc, cal_pred=carry.cal_pred,
            since_draft=carry.since_draft,
            explore_gap=carry.explore_gap, draws=carry.draws,
            t=np.int32(0), finished=np.bool_(False))
        return ls, (seeds, stops, np.bool_(stop_on_finish))

    def _device_call(self) -> Optional[LoopStats]:
        """Admits, runs up to ``loop_steps`` steps on the device, emits. Returns the call's stats."""
        t0 = time.perf_counter()
        self._admit()
        if self.num_active == 0:
            return None
        active_in = self.num_active
        draws_in = 0 if self._carry is None else int(self._carry.draws)
        ls = self._run_loop(stop_on_finish=bool(self.queue))
        out, out_len, steps, drafted, accepted, reached, t, draws = jax.device_get(
            (ls.out, ls.out_len, ls.steps, ls.drafted, ls.accepted, ls.reached, ls.t, ls.draws))
        now = time.perf_counter()
        for i, live in enumerate(self.slots):
            if live is None:
                continue
            live.verify_steps = int(steps[i])
            live.result.accepted += int(accepted[i].sum())
            self._emit(i, out[i, :out_len[i]].tolist(), now)
        stats = LoopStats(steps=int(t), draft_steps=int(draws) - draws_in,
                          tokens=int(out_len.sum()), active=active_in,
                          drafted=drafted.sum(0).tolist(), accepted=accepted.sum(0).tolist(),
                          reached=reached.sum(0).tolist(),
                          wall_s=time.perf_counter() - t0)
        self.loop_stats.append(stats)
        return stats

    def _device_sps(self, rows: Optional[int] = None):
        """SPS tables (verify only, draft + verify) and the plain step's steps/s (0: not
        measured) on the device for a call on ``rows`` rows (``None``: all slots), from that row
        bucket's profile when warm-up measured one (``sps_rows``), else from ``sps_table``;
        rebuilt when they change."""
        prof = self.sps_rows.get(rows) if rows is not None else None
        source = prof if prof is not None else self.sps_table
        held = self._sps_dev.get(rows)
        if held is None or held[0] is not source:
            if prof is not None:
                tables = (prof.table(), prof.table_with_draft(), prof.plain_sps)
            else:
                tables = (self.sps_table, self.sps_table_draft,
                          0.0 if self.sps is None else self.sps.plain_sps)
            held = self._sps_dev[rows] = (source, self._put(np.asarray(tables[0], np.float32)),
                                          self._put(np.asarray(tables[1], np.float32)),
                                          self._put(np.float32(tables[2])))
        return held[1:]

    def _run_loop(self, *, stop_on_finish: bool, rows=None) -> LoopState:
        """One call of the device loop over the current slots; keeps its state. Returns it.

        With ``EngineConfig.row_buckets`` the call runs on the active slots only (padded to a
        row bucket; :mod:`specjax.engine.loop_rows`); ``rows`` forces a set of slots (warm-up;
        all ``S`` of them: the all-slot program).
        """
        ls, per_slot = self._loop_inputs(stop_on_finish)
        if rows is None and self.config.loop_row_buckets:
            rows = pick_rows([live is not None for live in self.slots],
                             self.config.loop_row_buckets)
        if rows is not None and len(rows) == self.config.num_slots:
            rows = None
        n_rows = None if rows is None else len(rows)
        shrink = np.int32(shrink_point(n_rows, self.config.loop_row_buckets))
        row_ids = None if rows is None else np.asarray(rows, np.int32)
        # One transfer for the host (numpy) inputs of the call; the state and the carry are on
        # the engine's device already (a device_put costs host time per array, ~30 of them).
        leaves, tree = jax.tree.flatten((ls, per_slot, self._sampling(), shrink, row_ids))
        moved = iter(self._put([x for x in leaves if not isinstance(x, jax.Array)]))
        leaves = [x if isinstance(x, jax.Array) else next(moved) for x in leaves]
        ls, (seeds, stops, stop), sampling, shrink, row_ids = jax.tree.unflatten(tree, leaves)
        sps, sps_d, sps_plain = self._device_sps(n_rows)
        args = (self.graphdef, self.target_state, self.drafter, self.params, self.frozen, ls)
        rest = (sampling, seeds, stops, sps, sps_d, sps_plain, self._key, stop)
        if rows is None:
            ls = run_loop(*args, *rest, shrink, spec=self._loop_spec)
        else:
            ls = run_loop_rows(*args, row_ids, *rest, shrink,
                               spec=spec_for_rows(self._loop_spec, n_rows))
        self.state = ls.dev
        self._carry = ls
        return ls
