"""Serving engine: continuous batching with confidence-scheduled, bucketed speculative verification.

Per step (host loop over jitted device steps, :mod:`specjax.engine_steps`)::

    draft     every slot drafts γ tokens (q, confidences)                         device
    schedule  each active request's verification length ℓ_r (policy, numpy)       host
    verify    pack Σ(1+ℓ_r) tokens into the smallest token bucket ≥ it; one
              flattened target forward; rejection / target-only per request;
              commit caches and lengths                                           device
    emit      append emitted tokens; stop tokens / max_new_tokens finish a
              request and free its slot; queued requests are admitted and
              prefilled in bucketed chunks                                        host

Static shapes: the verification step is compiled once per token bucket, prefill once per chunk
bucket, drafting once; :meth:`Engine.warmup` compiles all of them, after which a run compiles
nothing (see ``tests/test_engine.py``, which counts compilations).

Exactness: a request's verification length depends only on confidences of drafts *before* the
position being admitted (Algorithm 1 with early stop; the production form's budget comes from
confidences two steps old), so every policy is lossless (DESIGN invariant 1). Temperature 0
requests are verified greedily (one-hot p and q: acceptance is exact match).

Overlap (``EngineConfig.overlap``): after dispatching step t's verification, the engine dispatches
step t+1's drafting before it reads step t's tokens back, so the device drafts while the host
emits, finishes and admits. If step t admitted new requests the pre-dispatched draft is discarded
and redone after their prefill.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import time
import warnings
from typing import Any, Callable, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import scheduling
from specjax.drafters.base import DraftOutput, Sampling
from specjax.engine_steps import (DeviceState, draft_step, merge_rows, prefill_step,
                                  verify_step)
from specjax.models.kv_cache import init_cache
from specjax.scheduling import SchedulerConfig

FINISH_REASONS = ("stop", "length", "cancelled", "error")
CONFIDENCE_POLICIES = ("threshold", "dspark", "production", "retrospective")


@dataclasses.dataclass
class Request:
    """One generation request.

    prompt: token ids (non-empty). max_new_tokens: ≥ 1. stop_tokens: generation ends after any of
    them (kept in the output). temperature (0 = greedy), top_k, top_p: the sampling transform,
    applied identically to target and drafts. seed: the request's verification and first-token
    randomness. request_id: assigned by the engine when None.
    """

    prompt: Sequence[int]
    max_new_tokens: int = 32
    stop_tokens: Sequence[int] = ()
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: int = 0
    request_id: Optional[str] = None


@dataclasses.dataclass
class Result:
    """A finished request.

    tokens: generated ids. finish_reason: one of FINISH_REASONS. error: message when "error".
    submit_time, admit_time (moved into a slot), first_token_time, finish_time:
    ``time.perf_counter()`` stamps.
    token_times: emission time of every generated token (tokens of one step share a stamp).
    steps: verification steps the request took part in; accepted: drafts accepted in total.
    """

    request_id: str
    tokens: list
    finish_reason: str
    error: Optional[str] = None
    submit_time: float = 0.0
    admit_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    token_times: list = dataclasses.field(default_factory=list)
    steps: int = 0
    accepted: int = 0

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.submit_time


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine shape and policy.

    num_slots: S requests decoded at once. max_len: cache positions per slot (prompt + new tokens
    + γ + 1 must fit). gamma: drafts per step. token_buckets: compiled verification batch sizes
    (default: powers of two from 8 to S·(γ+1)); the largest must hold S·(γ+1).
    prefill_buckets: compiled prompt chunk sizes (longer prompts are fed in chunks of the largest).
    method: "rejection" or "target_only". scheduler: the verification-length policy.
    overlap: pre-dispatch the next draft while the host processes the current step.
    sps_cache: JSON path for the SPS profile (reused when device and model match).
    profile_reps: timed repetitions per bucket when profiling. seed: drafting randomness.
    filters: compile top-k / top-p support (a sort over V per position); False serves
    temperature-only requests faster and rejects requests that set top_k / top_p.
    """

    num_slots: int = 8
    max_len: int = 512
    gamma: int = 4
    token_buckets: Optional[tuple] = None
    prefill_buckets: tuple = (16, 64, 256)
    method: str = "rejection"
    scheduler: SchedulerConfig = SchedulerConfig()
    overlap: bool = True
    sps_cache: Optional[str] = None
    profile_reps: int = 5
    seed: int = 0
    filters: bool = True

    def __post_init__(self):
        if self.num_slots < 1:
            raise ValueError(f"EngineConfig.num_slots must be ≥ 1, got {self.num_slots}")
        if self.gamma < 1:
            raise ValueError(f"EngineConfig.gamma must be ≥ 1, got {self.gamma}")
        if self.method not in ("rejection", "target_only"):
            raise ValueError(f"EngineConfig.method must be 'rejection' or 'target_only', "
                             f"got {self.method!r}")
        if self.max_len < self.gamma + 2:
            raise ValueError(f"EngineConfig.max_len {self.max_len} too small for gamma {self.gamma}")
        scheduling.validate_buckets(self.prefill_buckets)
        if self.token_buckets is not None:
            b = scheduling.validate_buckets(self.token_buckets)
            if b[-1] < self.num_slots * (self.gamma + 1):
                raise ValueError(
                    f"EngineConfig.token_buckets: the largest bucket {b[-1]} must hold "
                    f"num_slots * (gamma + 1) = {self.num_slots * (self.gamma + 1)} tokens")

    @property
    def buckets(self) -> list[int]:
        if self.token_buckets is not None:
            return scheduling.validate_buckets(self.token_buckets)
        return scheduling.default_buckets(self.num_slots * (self.gamma + 1),
                                          min_bucket=min(8, self.num_slots))


@dataclasses.dataclass
class _Live:
    """Host bookkeeping of a request in a slot."""

    request: Request
    result: Result
    prompt_done: int = 0  # prompt tokens fed so far
    generated: int = 0
    verify_steps: int = 0
    conf_history: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=3))


@dataclasses.dataclass
class StepStats:
    """Per-step host/device timing (seconds) and batch composition."""

    active: int
    bucket: int
    tokens: int
    drafts_verified: int
    accepted: int
    schedule_s: float  # host time of the scheduling policy + bucket pick (numpy only)
    step_s: float
    draft_wait_s: float = 0.0  # time blocked on the device for the drafts' confidences
    drafted: bool = True  # False: plain decoding step ("none", or a production budget of 0)
    # scheduler host work done while the device verifies (overlap: the next production budget);
    # off the critical path on an accelerator, competing for the same cores on a CPU backend
    schedule_overlap_s: float = 0.0


class Engine:
    """Continuous-batching speculative decoding engine over S slots.

    Args:
      target: target :class:`~specjax.models.Transformer` (or ``(graphdef, state)``).
      drafter, params, frozen: a drafter from :mod:`specjax.drafters`, its params and frozen
        shared head (``None`` where the drafter has none).
      config: :class:`EngineConfig`.
    """

    def __init__(self, target, drafter, params, frozen, config: EngineConfig = EngineConfig()):
        self.graphdef, self.target_state = target if isinstance(target, tuple) else nnx.split(target)
        self.model_config = nnx.merge(self.graphdef, self.target_state).config
        self.drafter, self.params, self.frozen = drafter, params, frozen
        self.config = config
        if config.scheduler.policy in CONFIDENCE_POLICIES and \
                not drafter.has_confidence:
            raise ValueError(f"scheduler policy {config.scheduler.policy!r} needs a drafter with a "
                             f"confidence head; {type(drafter).__name__} has none")
        self.buckets = config.buckets
        self.prefill_buckets = scheduling.validate_buckets(config.prefill_buckets)
        s = config.num_slots
        self.raise_errors = False
        leaf_devices = jax.tree.leaves(self.target_state)[0].devices()
        self._device = next(iter(leaf_devices)) if len(leaf_devices) == 1 else jax.devices()[0]
        self._reset_device_state()
        self.slots: list[Optional[_Live]] = [None] * s
        self.queue: collections.deque[_Live] = collections.deque()
        self.finished: dict[str, Result] = {}
        self._ids = itertools.count()
        self._draws = 0
        self._key = jax.random.key(config.seed)
        self._empty_draft = None
        self._no_draft_rows: Optional[np.ndarray] = None  # bool [S]: rows forced to ℓ = 0
        self._conf_prior = np.full(config.gamma, 0.5)  # production: confidences of new requests
        self._conf_prior_seen = False
        self._steps_without_draft = 0
        self.sps: Optional[scheduling.SPSProfile] = None
        self.sps_table = np.ones(self.buckets[-1] + 1)
        self.sps_table_draft = self.sps_table  # SPS of a step that drafts (no profile: equal)
        self.stats: list[StepStats] = []
        self._sampling_cache = None

    # ---------------------------------------------------------------------------------- requests
    def submit(self, request: Request) -> str:
        """Queues a request; returns its id. Bad requests raise ``ValueError`` immediately."""
        self._validate(request)
        rid = request.request_id or f"req-{next(self._ids)}"
        request = dataclasses.replace(request, request_id=rid, prompt=list(request.prompt),
                                      stop_tokens=tuple(request.stop_tokens))
        if rid in self.finished or any(l.request.request_id == rid for l in self._all_live()):
            raise ValueError(f"duplicate request_id {rid!r}")
        live = _Live(request, Result(rid, [], "", submit_time=time.perf_counter()))
        self.queue.append(live)
        return rid

    def cancel(self, request_id: str) -> bool:
        """Cancels a queued or running request (its slot is freed). Returns whether it existed."""
        for live in list(self.queue):
            if live.request.request_id == request_id:
                self.queue.remove(live)
                self._finish(live, "cancelled")
                return True
        for i, live in enumerate(self.slots):
            if live is not None and live.request.request_id == request_id:
                self._free(i, "cancelled")
                return True
        return False

    def _all_live(self):
        return [l for l in self.slots if l is not None] + list(self.queue)

    def _validate(self, r: Request) -> None:
        v = self.model_config.vocab_size
        if len(r.prompt) == 0:
            raise ValueError("Request.prompt must be non-empty")
        if any((not isinstance(t, (int, np.integer))) or not 0 <= t < v for t in r.prompt):
            raise ValueError(f"Request.prompt ids must be ints in [0, {v})")
        if r.max_new_tokens < 1:
            raise ValueError(f"Request.max_new_tokens must be ≥ 1, got {r.max_new_tokens}")
        need = len(r.prompt) + r.max_new_tokens + self.config.gamma + 1
        if need > self.config.max_len:
            raise ValueError(f"prompt ({len(r.prompt)}) + max_new_tokens ({r.max_new_tokens}) + "
                             f"gamma + 1 = {need} exceeds EngineConfig.max_len "
                             f"{self.config.max_len}")
        if r.temperature < 0:
            raise ValueError(f"Request.temperature must be ≥ 0, got {r.temperature}")
        if not self.config.filters and (r.top_k is not None or r.top_p is not None):
            raise ValueError("this engine was built with EngineConfig.filters=False: "
                             "top_k / top_p are not supported")
        if r.top_k is not None and r.top_k < 1:
            raise ValueError(f"Request.top_k must be ≥ 1, got {r.top_k}")
        if r.top_p is not None and not 0 < r.top_p <= 1:
            raise ValueError(f"Request.top_p must be in (0, 1], got {r.top_p}")

    # ---------------------------------------------------------------------------------- helpers
    def _sampling(self) -> Sampling:
        """Per-slot sampling arrays (idle slots: temperature 1, no filters)."""
        s = self.config.num_slots
        temp = np.ones(s, np.float32)
        top_k = np.full(s, self.model_config.vocab_size, np.int32)
        top_p = np.ones(s, np.float32)
        for i, live in enumerate(self.slots):
            if live is not None:
                r = live.request
                temp[i] = r.temperature
                top_k[i] = r.top_k if r.top_k is not None else self.model_config.vocab_size
                top_p[i] = r.top_p if r.top_p is not None else 1.0
        if not self.config.filters:
            return Sampling(temperature=temp)
        return Sampling(temperature=temp, top_k=top_k, top_p=top_p)

    def _slot_keys(self, salt: int) -> jax.Array:
        """One key per slot from the request's seed and its own step count (host-built, one call)."""
        seeds = np.zeros((self.config.num_slots, 3), np.uint32)
        for i, live in enumerate(self.slots):
            if live is not None:
                seeds[i] = (live.request.seed, live.verify_steps, salt)
        return _keys_from_seeds(seeds)

    def _next_key(self) -> jax.Array:
        self._draws += 1
        return jax.random.fold_in(self._key, self._draws)

    # ---------------------------------------------------------------------------------- admission
    def _admit(self) -> list[int]:
        """Moves queued requests into free slots and prefills them. Returns the slots admitted."""
        new = []
        for i in range(self.config.num_slots):
            if self.slots[i] is None and self.queue:
                self.slots[i] = self.queue.popleft()
                self.slots[i].result.admit_time = time.perf_counter()
                new.append(i)
        if not new:
            return new
        s = self.config.num_slots
        first_chunk = True
        while True:
            remaining = {i: len(self.slots[i].request.prompt) - self.slots[i].prompt_done
                         for i in new if self.slots[i] is not None}
            todo = [i for i, n in remaining.items() if n > 0]
            if not todo:
                break
            chunk = min(max(remaining[i] for i in todo), self.prefill_buckets[-1])
            c = scheduling.pick_bucket(self.prefill_buckets, chunk)
            tokens = np.zeros((s, c), np.int32)
            num_valid = np.zeros(s, np.int32)
            reset = np.zeros(s, bool)
            nxt = np.zeros(s, np.int32)
            is_last = np.zeros(s, bool)
            for i in todo:
                live = self.slots[i]
                p = live.request.prompt
                n = min(c, remaining[i])
                tokens[i, :n] = p[live.prompt_done:live.prompt_done + n]
                num_valid[i] = n
                reset[i] = live.prompt_done == 0
                is_last[i] = live.prompt_done + n == len(p)
                if not is_last[i]:
                    nxt[i] = p[live.prompt_done + n]
                live.prompt_done += n
            self.state, first = prefill_step(
                self.graphdef, self.target_state, self.drafter, self.params, self.frozen,
                self.state, tokens, num_valid, reset, nxt, is_last, self._slot_keys(1),
                self._sampling(), max_len=self.config.max_len, gamma=self.config.gamma)
            first_chunk = False
            first = np.asarray(first)
            now = time.perf_counter()
            for i in todo:
                if is_last[i]:
                    self._emit(i, [int(first[i])], now)
        del first_chunk
        return new

    # ---------------------------------------------------------------------------------- finishing
    def _emit(self, slot: int, tokens: Iterable[int], now: float) -> None:
        live = self.slots[slot]
        r, res = live.request, live.result
        for t in tokens:
            res.tokens.append(t)
            res.token_times.append(now)
            if res.first_token_time is None:
                res.first_token_time = now
            live.generated += 1
            if t in r.stop_tokens:
                self._free(slot, "stop")
                return
            if live.generated >= r.max_new_tokens:
                self._free(slot, "length")
                return

    def _finish(self, live: _Live, reason: str, error: Optional[str] = None) -> None:
        live.result.finish_reason = reason
        live.result.error = error
        live.result.finish_time = time.perf_counter()
        live.result.steps = live.verify_steps
        self.finished[live.request.request_id] = live.result

    def _free(self, slot: int, reason: str, error: Optional[str] = None) -> None:
        live = self.slots[slot]
        self.slots[slot] = None
        self._finish(live, reason, error)

    # ---------------------------------------------------------------------------------- stepping
    @property
    def num_active(self) -> int:
        return sum(l is not None for l in self.slots)

    def has_work(self) -> bool:
        return bool(self.queue) or self.num_active > 0

    def _draft(self):
        g = self.config.gamma
        return draft_step(self.drafter, self.params, self.frozen, self.state.drafter_state,
                          self._next_key(), self._sampling(), gamma=g,
                          argmax=self.config.method == "target_only")

    def _no_draft(self) -> DraftOutput:
        """Placeholder drafts for the "none" policy (never verified: ℓ = 0)."""
        if self._empty_draft is None:
            s, g, v = self.config.num_slots, self.config.gamma, self.model_config.vocab_size
            # device_put of host zeros: nothing to compile after warm-up (jnp.zeros would)
            self._empty_draft = DraftOutput(jax.device_put(np.zeros((s, g), np.int32), self._device),
                                            jax.device_put(np.zeros((s, g, v), np.float32),
                                                           self._device), None)
        return self._empty_draft

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

    def _production_budget(self) -> int:
        """The production policy's draft-token budget for the next verification, from each
        running request's confidences of two steps earlier (never from the drafts it will
        admit). 0 means the step does not draft at all (scored without the drafting cost);
        every ``explore_every``-th step without drafting drafts anyway (a step count only)."""
        rows, cap = self._rows_and_caps()
        if not len(rows):
            return 0
        stale = np.stack([self._stale_conf(i) for i in rows])
        budget = scheduling.budget_search(stale, self.sps_table, cap, self.sps_table_draft)
        every = self.config.scheduler.explore_every
        if budget == 0 and every and self._steps_without_draft + 1 >= every:
            budget = scheduling.budget_search(stale, self.sps_table, cap)
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
                    self.slots[rows[j]].conf_history.append(conf[j])
                if fresh:  # moving average over steps (the first one replaces the 0.5 guess)
                    w = 0.1 if self._conf_prior_seen else 1.0
                    self._conf_prior = (1 - w) * self._conf_prior + w * conf[fresh].mean(axis=0)
                    self._conf_prior_seen = True
        else:
            lengths = scheduling.schedule(cfg.scheduler, conf, self.sps_table, max_len=cap)
        out = np.full(cfg.num_slots, -1, np.int32)
        out[rows] = lengths
        return out

    def _stale_conf(self, slot: int) -> np.ndarray:
        """Confidences this request's drafter produced two steps ago; before it has two, the
        running mean of all requests' past confidences (0.5 before any)."""
        hist = self.slots[slot].conf_history
        if len(hist) >= 2:
            return hist[-2]
        return self._conf_prior

    def step(self) -> Optional[StepStats]:
        """Admits, drafts, schedules, verifies and emits once. Returns the step's stats.

        If a device step fails, every request in a slot finishes with reason "error" (the message
        kept), the device state is rebuilt, and the queue keeps being served; the exception is
        re-raised only when ``raise_errors`` was set on the engine.
        """
        try:
            return self._step()
        except Exception as e:  # noqa: BLE001 - a device failure must not lose requests silently
            msg = f"{type(e).__name__}: {e}"
            for i, live in enumerate(self.slots):
                if live is not None:
                    self._free(i, "error", msg)
            self._reset_device_state()
            if self.raise_errors:
                raise
            warnings.warn(f"engine step failed, {msg}; its requests finished with 'error'")
            return None

    def _reset_device_state(self) -> None:
        s = self.config.num_slots
        # Committed to the device like every jitted step's outputs: an uncommitted input is a
        # different compilation key, so warm-up on a fresh state would not cover later steps.
        self.state = jax.device_put(DeviceState(
            cache=init_cache(self.model_config, s, self.config.max_len),
            drafter_state=self.drafter.init_state(s, self.config.max_len, self.config.gamma),
            anchor=jnp.zeros((s,), jnp.int32)), self._device)
        self._pending_draft = None
        self._no_draft_rows = None
        self._next_budget = None  # production: budget searched at the last pre-dispatch

    def _step(self) -> Optional[StepStats]:
        t0 = time.perf_counter()
        admitted = self._admit()
        if self.num_active == 0:
            return None
        policy = self.config.scheduler.policy
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
        drafted = not (policy == "none" or budget == 0)
        if not drafted:
            # Plain decoding through the same verification step: no drafting cost at all (a
            # draft pre-dispatched at the last step is dropped; the drafter state is the one
            # before it).
            self._pending_draft = (self._no_draft(), self.state.drafter_state)
        elif self._pending_draft is None or self.num_active == len(admitted):
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
        conf = self._host_confidences(draft) if drafted else None  # device time (drafting)
        ts = time.perf_counter()
        num_draft = self._schedule(conf, budget)
        n_tokens = int(np.sum(num_draft[num_draft >= 0] + 1))
        bucket = scheduling.pick_bucket(self.buckets, n_tokens)
        schedule_s = time.perf_counter() - ts + budget_s
        sampling = self._sampling()
        keys = self._slot_keys(2)
        self.state = DeviceState(self.state.cache, dstate_after, self.state.anchor)
        self.state, result = verify_step(
            self.graphdef, self.target_state, self.drafter, self.params, self.frozen, self.state,
            draft.tokens, draft.probs, num_draft, keys, sampling, bucket=bucket,
            gamma=self.config.gamma, method=self.config.method)
        self._steps_without_draft = 0 if drafted else self._steps_without_draft + 1
        overlap_s = 0.0
        if self.config.overlap and policy != "none":
            tb = time.perf_counter()
            # production: pre-dispatch only if the next step (same rows) will want drafts
            want = True
            if policy == "production":
                self._next_budget = self._production_budget()
                want = self._next_budget > 0
            overlap_s = time.perf_counter() - tb  # host work while the device verifies
            if want:
                self._pending_draft = self._draft()  # queued behind verification on the device
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
                          drafted=drafted, schedule_overlap_s=overlap_s)
        self.stats.append(stats)
        return stats

    def run(self, max_steps: Optional[int] = None) -> dict[str, Result]:
        """Steps until no request is queued or running (or ``max_steps``); returns finished."""
        n = 0
        while self.has_work() and (max_steps is None or n < max_steps):
            self.step()
            n += 1
        return self.finished

    def generate(self, requests: Sequence[Request]) -> list[Result]:
        """Submits the requests, runs to completion, returns their results in order."""
        ids = [self.submit(r) for r in requests]
        self.run()
        return [self.finished.pop(i) for i in ids]

    # ---------------------------------------------------------------------------------- warm-up
    def warmup(self, *, profile: bool = True) -> None:
        """Compiles drafting, every prefill chunk bucket and every verification bucket (on idle
        slots: nothing changes), then profiles SPS per bucket unless ``profile=False``."""
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
        draft, dstate = self._draft()
        if self.config.overlap:  # admissions under overlap merge pre-dispatched drafter rows
            merge_rows(self.drafter, np.zeros(s, bool), self.state.drafter_state, dstate,
                       max_len=self.config.max_len, gamma=g)
        idle = np.full(s, -1, np.int32)

        def run_bucket(b):
            self.state, res = verify_step(
                self.graphdef, self.target_state, self.drafter, self.params, self.frozen,
                self.state, draft.tokens, draft.probs, idle, keys, sampling, bucket=b, gamma=g,
                method=self.config.method)
            jax.block_until_ready(res.tokens)

        for b in self.buckets:
            run_bucket(b)
        if profile:
            key = (f"{jax.devices()[0].device_kind}/{self.model_config}/"
                   f"{type(self.drafter).__name__}/S{s}/g{g}/L{self.config.max_len}")
            self.sps = scheduling.profile_sps(
                run_bucket, self.buckets, key=key, reps=self.config.profile_reps, warmup=0,
                cache_path=self.config.sps_cache,
                run_draft=lambda: jax.block_until_ready(self._draft()))
            self.sps_table, self.sps_table_draft = self.sps.table(), self.sps.table_with_draft()

    def set_sps(self, profile: scheduling.SPSProfile) -> None:
        """Uses a given SPS profile (e.g. a hand-made one in tests)."""
        if list(profile.buckets) != self.buckets:
            raise ValueError(f"profile buckets {profile.buckets} != engine buckets {self.buckets}")
        self.sps, self.sps_table = profile, profile.table()
        self.sps_table_draft = profile.table_with_draft()


@jax.jit
def _keys_from_seeds(seeds: jax.Array) -> jax.Array:
    """``[S, 3]`` uint32 (seed, step, salt) -> ``[S]`` PRNG keys."""
    def one(x):
        k = jax.random.key(x[0])
        return jax.random.fold_in(jax.random.fold_in(k, x[1]), x[2])
    return jax.vmap(one)(seeds)
