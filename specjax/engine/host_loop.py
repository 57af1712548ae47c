"""The host loop: one engine step at a time, dispatched from Python (``EngineConfig.loop="host"``).

Per step::

    draft     every slot drafts γ tokens (q, confidences)                         device
    schedule  each active request's verification length ℓ_r (policy, numpy)       host
    verify    pack Σ(1+ℓ_r) tokens into the smallest token bucket ≥ it; one
              flattened target forward; rejection / target-only per request;
              commit caches and lengths                                           device
    emit      append emitted tokens; stop tokens / max_new_tokens finish a
              request and free its slot                                           host

Overlap (``EngineConfig.overlap``): after dispatching step t's verification, the engine dispatches
step t+1's drafting before it reads step t's tokens back, so the device drafts while the host
emits, finishes and admits. Rows admitted in between keep their prefilled drafter state and
verify no drafts on their first step (ℓ = 0), which decides nothing from a draft.

Policy "none" runs a dense ``[S, 1]`` decode step of the target instead (no drafting, no
verification; :func:`~specjax.engine.steps.plain_decode_step`), and so does production at a budget
of 0, committing the drafter as a verification of no drafts would
(:func:`~specjax.engine.steps.plain_commit_step`, the device loop's plain step).

The policies are the numpy references of :mod:`specjax.scheduling`; every step records
:class:`~specjax.engine.requests.StepStats` (host scheduling cost, waits, bucket).
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from specjax import scheduling
from specjax.buckets import pick_bucket
from specjax.engine.device_loop import VERIFY_SALT
from specjax.engine.requests import CONFIDENCE_POLICIES, StepStats
from specjax.engine.steps import (DeviceState, draft_step, merge_rows, plain_commit_step,
                                  plain_decode_step, verify_step)


class HostLoopMixin:
    """The host-loop half of :class:`~specjax.engine.engine.Engine` (uses its slots and queue)."""

    def _draft(self):
        g = self.config.gamma
        return draft_step(self.drafter, self.params, self.frozen, self.state.drafter_state,
                          self._next_key(), self._sampling(), gamma=g,
                          argmax=self.config.method == "target_only")

    def _host_confidences(self, draft) -> Optional[np.ndarray]:
        """The drafts' confidences ``[S, γ]`` on the host when the policy uses them (this waits
        for the device to finish drafting), else None."""
        if self.drafter.has_confidence and draft.confidences is not None and \
                self.config.scheduler.policy in CONFIDENCE_POLICIES:
            return np.asarray(draft.confidences, np.float64)
        return None

    def _rows_and_caps(self) -> tuple[np.ndarray, np.ndarray]:
        """Active slots and their caps on ℓ (a request that needs m more tokens gains nothing
        from verifying more than m - 1 drafts)."""
        rows = np.array([i for i, l in enumerate(self.slots) if l is not None], np.int64)
        cap = np.array([min(self.config.gamma, self.slots[i].request.max_new_tokens
                            - self.slots[i].generated - 1) for i in rows], np.int64)
        return rows, np.maximum(cap, 0)

    def _production_budget(self, ahead: int = 0) -> int:
        """The production policy's draft-token budget for the next verification, from each
        running request's confidences of two steps earlier (never from the drafts it will
        admit), shrunk towards the prior by their age (``ahead``: 1 when searched during the
        step before the one it is for, as the overlap does; 0 during the step itself). 0 means
        the step does not draft at all (scored without the drafting cost); every
        ``explore_every``-th step without drafting drafts anyway (a step count only), and so does
        every step before the first confidences were seen."""
        rows, cap = self._rows_and_caps()
        if not len(rows):
            return 0
        stale, lag = zip(*(self._stale_conf(i, ahead) for i in rows))
        stale = scheduling.shrink_stale(np.stack(stale), self._conf_prior, np.array(lag),
                                        self.config.scheduler.stale_decay)
        plain = 0.0 if self.sps is None else self.sps.plain_sps
        budget = scheduling.budget_search(stale, self.sps_table, cap, self.sps_table_draft, plain)
        every = self.config.scheduler.explore_every
        # before any confidence was seen the stale ones are the 0.5 guess: draft once to measure
        if budget == 0 and every and (not self._conf_prior_seen
                                      or self._steps_without_draft + 1 >= every):
            # an exploring step drafts whatever the plain step's rate: the best budget > 0
            budget = scheduling.budget_search(stale, self.sps_table, cap, self.sps_table_draft,
                                              plain_sps=1e-30)
        return budget

    def _schedule(self, conf_all: Optional[np.ndarray], budget: Optional[int] = None) -> np.ndarray:
        """ℓ per slot (-1 idle) from the policy; capped so no request overshoots max_new_tokens.

        ``conf_all``: float ``[S, γ]`` confidences already on the host (or None).
        ``budget``: the production policy's budget (from :meth:`_production_budget`).
        """
        cfg = self.config
        rows, cap = self._rows_and_caps()
        if self._no_draft_rows is not None:
            cap = np.where(self._no_draft_rows[rows], 0, cap)
        conf = None if conf_all is None else conf_all[rows]
        if conf is None:
            conf = np.ones((len(rows), cfg.gamma))
        if cfg.scheduler.policy == "production":
            if not budget or conf_all is None:  # budget 0: nothing was drafted this step
                lengths = np.zeros(len(rows), np.int64)
            else:
                lengths = scheduling.top_budget_admission(conf, budget, cap)
                fresh = [j for j, i in enumerate(rows)
                         if self._no_draft_rows is None or not self._no_draft_rows[i]]
                for j in fresh:
                    self.slots[rows[j]].conf_history.append((self._host_steps, conf[j]))
                if fresh:  # moving average of survivals (the first replaces the 0.5 guess)
                    w = 0.1 if self._conf_prior_seen else 1.0
                    self._conf_prior = scheduling.survival_prior_update(self._conf_prior,
                                                                        conf[fresh], w)
                    self._conf_prior_seen = True
        else:
            lengths = scheduling.schedule(cfg.scheduler, conf, self.sps_table, max_len=cap)
        out = np.full(cfg.num_slots, -1, np.int32)
        out[rows] = lengths
        return out

    def _stale_conf(self, slot: int, ahead: int = 0) -> tuple[np.ndarray, int]:
        """``(confidences, lag)``: those this request's drafter produced two drafting steps ago
        and the steps since (at the step ``ahead`` steps after the current one); before it has
        two, the running prior of all requests' past confidences (0.5 before any) and lag 1."""
        hist = self.slots[slot].conf_history
        if len(hist) >= 2:
            step, conf = hist[-2]
            return conf, self._host_steps + ahead - step
        return self._conf_prior, 1

    def _step(self) -> Optional[StepStats]:
        t0 = time.perf_counter()
        admitted = self._admit()
        if self.num_active == 0:
            return None
        self._host_steps += 1
        policy = self.config.scheduler.policy
        if policy == "none":
            return self._plain_step(t0)
        budget, budget_s = None, 0.0
        if policy == "production":  # decided before drafting: budget 0 skips the draft step
            tb = time.perf_counter()
            if self._next_budget is not None and not admitted:
                # Searched during the last step's device work (pre-dispatch) over these rows
                # and any that have since finished: still a budget fixed before these drafts.
                budget = self._next_budget
            else:
                budget = self._production_budget()
            self._next_budget = None
            budget_s = time.perf_counter() - tb
        if budget == 0:
            # Production at budget 0: a plain decode step, no drafting cost at all (a draft
            # pre-dispatched at the last step is dropped; the drafter state is the one before it).
            self._pending_draft = None
            return self._plain_step(t0, commit=True, schedule_s=budget_s)
        if self._pending_draft is None or self.num_active == len(admitted):
            self._pending_draft = self._draft()  # (no earlier row would use the pre-dispatched)
        elif admitted:
            # The drafts pre-dispatched at the last step (overlap) predate these admissions. The
            # other rows' drafts stay valid (prefill leaves their drafter state untouched); the
            # admitted rows keep their prefilled drafter state and verify no drafts this step
            # (ℓ = 0: their first step is plain decoding), which decides nothing from a draft.
            draft, dstate_after = self._pending_draft
            mask = np.zeros(self.config.num_slots, bool)
            mask[admitted] = True
            self._no_draft_rows = mask
            self._pending_draft = (draft, merge_rows(
                self.drafter, mask, self.state.drafter_state, dstate_after,
                max_len=self.config.max_len, gamma=self.config.gamma))
        draft, dstate_after = self._pending_draft
        self._pending_draft = None
        tw = time.perf_counter()
        conf = self._host_confidences(draft)  # device time (drafting)
        ts = time.perf_counter()
        num_draft = self._schedule(conf, budget)
        n_tokens = int(np.sum(num_draft[num_draft >= 0] + 1))
        bucket = pick_bucket(self.buckets, n_tokens)
        schedule_s = time.perf_counter() - ts + budget_s
        sampling = self._sampling()
        keys = self._slot_keys(VERIFY_SALT)
        self.state = DeviceState(self.state.cache, dstate_after, self.state.anchor)
        self.state, result = verify_step(
            self.graphdef, self.target_state, self.drafter, self.params, self.frozen, self.state,
            draft.tokens, draft.probs, num_draft, keys, sampling, bucket=bucket,
            gamma=self.config.gamma, method=self.config.method,
            verify_impl=self.verify_impl)
        self._steps_without_draft = 0
        overlap_s = self._predispatch() if self.config.overlap else 0.0
        tokens = np.asarray(result.tokens)
        accepted = np.asarray(result.num_accepted)
        now = time.perf_counter()
        for i in np.flatnonzero(num_draft >= 0):
            live = self.slots[i]
            live.verify_steps += 1
            live.result.accepted += int(accepted[i])
            self._emit(i, tokens[i, :accepted[i] + 1].tolist(), now)
        self._no_draft_rows = None
        stats = StepStats(active=int(np.sum(num_draft >= 0)), bucket=bucket, tokens=n_tokens,
                          drafts_verified=int(np.sum(np.maximum(num_draft, 0))),
                          accepted=int(np.sum(accepted)), schedule_s=schedule_s,
                          step_s=time.perf_counter() - t0, draft_wait_s=ts - tw,
                          drafted=True, schedule_overlap_s=overlap_s)
        self.stats.append(stats)
        return stats

    def _predispatch(self) -> float:
        """Overlap: dispatches the next step's drafting behind this step's device work (production:
        only if the next step's budget, searched now over the same rows, is > 0). Returns the
        host seconds spent here while the device works."""
        tb = time.perf_counter()
        want = True
        if self.config.scheduler.policy == "production":
            self._next_budget = self._production_budget(ahead=1)
            want = self._next_budget > 0
        overlap_s = time.perf_counter() - tb
        if want:
            self._pending_draft = self._draft()  # queued behind the step on the device
        return overlap_s

    def _plain_step(self, t0: float, *, commit: bool = False,
                    schedule_s: float = 0.0) -> StepStats:
        """One dense decode step of the target for every active slot, without drafts or the
        verifier (the verification of no drafts it replaces costs 1.3-1.5x as much on CPU); the
        token is drawn with the key the verification's bonus token would use. Policy "none":
        the drafter is left alone. ``commit`` (production at budget 0): the drafter's state is
        committed as after a verification of no drafts. Its stats count the step's ``S``
        computed rows as its bucket."""
        s = self.config.num_slots
        active = np.array([live is not None for live in self.slots])
        keys, sampling = self._slot_keys(VERIFY_SALT), self._sampling()
        overlap_s = 0.0
        if commit:
            self.state, tokens = plain_commit_step(self.graphdef, self.target_state, self.drafter,
                                                   self.params, self.frozen, self.state, active,
                                                   keys, sampling)
            self._steps_without_draft += 1
            overlap_s = self._predispatch() if self.config.overlap else 0.0
        else:
            self.state, tokens = plain_decode_step(self.graphdef, self.target_state, self.state,
                                                   active, keys, sampling)
        tokens = np.asarray(tokens)
        now = time.perf_counter()
        for i in np.flatnonzero(active):
            self.slots[i].verify_steps += 1
            self._emit(i, [int(tokens[i])], now)
        n = int(active.sum())
        stats = StepStats(active=n, bucket=s, tokens=n, drafts_verified=0, accepted=0,
                          schedule_s=schedule_s, step_s=time.perf_counter() - t0, drafted=False,
                          schedule_overlap_s=overlap_s)
        self.stats.append(stats)
        return stats
