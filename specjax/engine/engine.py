"""Serving engine: continuous batching with confidence-scheduled, bucketed speculative verification.

Rooms (one concept per file)::

    requests.py         Request, Result, EngineConfig, stats                       host
    engine.py           Engine: submit / cancel / admit (prefill) / emit / finish    host
    warmup.py           compiles every program, then profiles SPS per bucket         host
    device_loop.py      many steps in one jitted lax.while_loop (default)            device
    device_policies.py  verification-length policies in jnp                         device
    online_calibration.py  confidences calibrated on past verifications (optional)  device
    device_driver.py    feeds the device loop and streams its tokens                 host
    host_loop.py        one step at a time from Python, with overlap                host
    steps.py            the jitted draft / flattened verify / prefill steps          device
    step_costs.py       SPS profile from each step timed alone in a device loop     device
    loop_profile.py     production's SPS profile timed on its own loop program      device
    specjax.scheduling  the policies in numpy (references)                           host
    specjax.buckets     token / prefill buckets, chunk plans and the SPS profile     host

A step drafts γ tokens per slot, chooses each request's verification length ℓ, verifies the
``Σ(1+ℓ)`` tokens in the smallest compiled token bucket (one flattened target forward), commits
caches by lengths and emits the accepted tokens; stop tokens and max_new_tokens finish requests,
whose slots are refilled from the queue (prefill in bucketed chunks).

Static shapes: prefill is compiled once per chunk bucket, the device loop once (one branch per
token bucket); :meth:`Engine.warmup` (warmup.py) compiles all of them, after which a run compiles nothing
(``tests/test_engine.py`` counts compilations).

Exactness: a request's verification length depends only on confidences of drafts *before* the
position being admitted (Algorithm 1 with early stop; the production form's budget comes from
stale confidences, fixed before the step drafts; online calibration rescales each position's
confidence by a ratio of past verifications), so every policy is lossless (docs/DESIGN.md,
"Invariants").
Temperature 0 requests are verified greedily (one-hot p and q: acceptance is exact match).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import time
import warnings
from typing import Iterable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.buckets import SPSProfile, plan_chunks, validate_buckets
from specjax.drafters.base import Sampling
from specjax.engine.device_driver import DeviceLoopMixin
from specjax.engine import online_calibration as oc
from specjax.engine.device_loop import slot_keys
from specjax.engine.host_loop import HostLoopMixin
from specjax.engine.loop_rows import pick_rows, prefill_rows
from specjax.engine.requests import (CONFIDENCE_POLICIES, EngineConfig, LoopStats, Request, Result,
                                     StepStats, _Live)
from specjax.engine.steps import DeviceState, prefill_step
from specjax.engine.warmup import WarmupMixin
from specjax.models.graphdef import hash_once
from specjax.models.kv_cache import init_cache
from specjax.verify import resolve_impl

_slot_keys_jit = jax.jit(slot_keys)  # salt traced: one compilation for every salt
# The host loop's drafting key per step: jitted, as an eager fold_in dispatches several ops per
# call (about half a millisecond on a CPU); the same keys (the draw count as uint32).
_fold_in_jit = jax.jit(jax.random.fold_in)


class Engine(HostLoopMixin, DeviceLoopMixin, WarmupMixin):
    """Continuous-batching speculative decoding engine over S slots.

    Args:
      target: target :class:`~specjax.models.Transformer` (or ``(graphdef, state)``).
      drafter, params, frozen: a drafter from :mod:`specjax.drafters`, its params and frozen
        shared head (``None`` where the drafter has none).
      config: :class:`EngineConfig`.

    Statistics it keeps: ``stats`` (host loop, one :class:`StepStats` per step), ``loop_stats``
    (device loop, one :class:`LoopStats` per call), and for admissions ``prefill_calls``,
    ``prefill_positions`` (chunk sizes summed) and ``prefill_s`` (wall seconds), warm-up excluded.
    The SPS profile the policies read after :meth:`warmup` (or :meth:`set_sps`): ``sps``, and
    with row buckets ``sps_rows`` (row count -> profile of that count's program).
    """

    def __init__(self, target, drafter, params, frozen, config: EngineConfig = EngineConfig()):
        graphdef, self.target_state = target if isinstance(target, tuple) else nnx.split(target)
        self.graphdef = hash_once(graphdef)  # a static argument of every jitted call
        self.model_config = nnx.merge(self.graphdef, self.target_state).config
        self.drafter, self.params, self.frozen = drafter, params, frozen
        self.config = config
        if config.scheduler.policy in CONFIDENCE_POLICIES and \
                not drafter.has_confidence:
            raise ValueError(f"scheduler policy {config.scheduler.policy!r} needs a drafter with a "
                             f"confidence head; {type(drafter).__name__} has none")
        self.buckets = config.buckets
        self.verify_impl = resolve_impl(config.verify_impl)
        self.prefill_buckets = validate_buckets(config.prefill_buckets)
        s = config.num_slots
        self.raise_errors = False
        leaf_devices = jax.tree.leaves(self.target_state)[0].devices()
        self._device = next(iter(leaf_devices)) if len(leaf_devices) == 1 else jax.devices()[0]
        self._reset_device_state()
        self.slots: list[Optional[_Live]] = [None] * s
        self.queue: collections.deque[_Live] = collections.deque()
        self.finished: dict[str, Result] = {}
        # ids of queued and running requests: the duplicate check of submit() in O(1) (a scan of
        # the queue made submitting n requests O(n^2): seconds for a few thousand)
        self._live_ids: set[str] = set()
        self._ids = itertools.count()
        self._draws = 0
        self._key = jax.random.key(config.seed)
        self._no_draft_rows: Optional[np.ndarray] = None  # bool [S]: rows forced to ℓ = 0
        self._conf_prior = np.full(config.gamma, 0.5)  # production: confidences of new requests
        self._conf_prior_seen = False
        self._steps_without_draft = 0
        self._host_steps = 0  # host loop: steps run (dates production's drafted confidences)
        self.sps: Optional[SPSProfile] = None
        # row buckets: the profile of each row count's program ({} or missing: ``sps``)
        self.sps_rows: dict[int, SPSProfile] = {}
        self.sps_table = np.ones(self.buckets[-1] + 1)
        self.sps_table_draft = self.sps_table  # SPS of a step that drafts (no profile: equal)
        self.stats: list[StepStats] = []  # host loop: one per step
        self.loop_stats: list[LoopStats] = []  # device loop: one per call
        self.prefill_calls = 0  # prefill chunk calls since the engine was built (not warm-up)
        self.prefill_positions = 0  # their chunk sizes summed (positions fed per slot row)
        self.prefill_s = 0.0  # their wall time (each call waits for its first tokens)
        self._new_rows = np.zeros(s, bool)  # device loop: slots admitted since the last call
        self._sps_dev: dict = {}  # device_driver._device_sps: row count -> (source, tables)

    # ---------------------------------------------------------------------------------- requests
    def submit(self, request: Request) -> str:
        """Queues a request; returns its id. Bad requests raise ``ValueError`` immediately."""
        self._validate(request)
        rid = request.request_id or f"req-{next(self._ids)}"
        request = dataclasses.replace(request, request_id=rid, prompt=list(request.prompt),
                                      stop_tokens=tuple(request.stop_tokens))
        if rid in self.finished or rid in self._live_ids:
            raise ValueError(f"duplicate request_id {rid!r}")
        live = _Live(request, Result(rid, [], "", submit_time=time.perf_counter()))
        self.queue.append(live)
        self._live_ids.add(rid)
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
        """Per-slot sampling arrays (idle slots: temperature 0, so that a batch of greedy
        requests draws no noise; no filters)."""
        s = self.config.num_slots
        temp = np.zeros(s, np.float32)
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
        seeds = np.zeros(self.config.num_slots, np.uint32)
        steps = np.zeros(self.config.num_slots, np.uint32)
        for i, live in enumerate(self.slots):
            if live is not None:
                seeds[i], steps[i] = live.request.seed, live.verify_steps
        return _slot_keys_jit(seeds, steps, np.uint32(salt))

    def _next_key(self) -> jax.Array:
        self._draws += 1
        return _fold_in_jit(self._key, np.uint32(self._draws))

    # ---------------------------------------------------------------------------------- admission
    def _admit(self) -> list[int]:
        """Moves queued requests into free slots and prefills them. Returns the slots admitted."""
        new = []
        for i in range(self.config.num_slots):
            if self.slots[i] is None and self.queue:
                self.slots[i] = self.queue.popleft()
                self.slots[i].result.admit_time = time.perf_counter()
                self._new_rows[i] = True
                new.append(i)
        if not new:
            return new
        s = self.config.num_slots
        longest = max(len(self.slots[i].request.prompt) - self.slots[i].prompt_done for i in new)
        # Every chunk but the last is full, so the longest prompt takes every chunk of the plan
        # and each shorter one finishes within it.
        t0 = time.perf_counter()
        for c in plan_chunks(self.prefill_buckets, longest,
                             call_cost=self.config.prefill_call_cost):
            remaining = {i: len(self.slots[i].request.prompt) - self.slots[i].prompt_done
                         for i in new if self.slots[i] is not None}  # None: finished at once
            todo = [i for i, n in remaining.items() if n > 0]
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
            rows = None
            if self.config.loop_row_buckets:
                rows = pick_rows(num_valid > 0, self.config.loop_row_buckets)
            if rows is None:
                self.state, first = prefill_step(
                    self.graphdef, self.target_state, self.drafter, self.params, self.frozen,
                    self.state, tokens, num_valid, reset, nxt, is_last, self._slot_keys(1),
                    self._sampling(), max_len=self.config.max_len, gamma=self.config.gamma,
                    feed_drafter=self.feeds_drafter)
                first = np.asarray(first)
            else:  # the admitted slots only, padded to a row bucket (specjax.engine.loop_rows)
                self.state, sub_first = prefill_rows(
                    self.graphdef, self.target_state, self.drafter, self.params, self.frozen,
                    self.state, self._put(np.asarray(rows, np.int32)), tokens[rows],
                    num_valid[rows], reset[rows], nxt[rows], is_last[rows], self._slot_keys(1),
                    self._sampling(), max_len=self.config.max_len, gamma=self.config.gamma,
                    feed_drafter=self.feeds_drafter)
                first = np.zeros(s, np.int32)
                first[rows] = np.asarray(sub_first)
            self.prefill_calls += 1
            self.prefill_positions += c
            now = time.perf_counter()
            for i in todo:
                if is_last[i]:
                    self._emit(i, [int(first[i])], now)
        self.prefill_s += time.perf_counter() - t0
        assert all(self.slots[i] is None or self.slots[i].prompt_done ==
                   len(self.slots[i].request.prompt) for i in new)
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
        self._live_ids.discard(live.request.request_id)
        self.finished[live.request.request_id] = live.result

    def _free(self, slot: int, reason: str, error: Optional[str] = None) -> None:
        live = self.slots[slot]
        self.slots[slot] = None
        self._finish(live, reason, error)

    # ---------------------------------------------------------------------------------- stepping
    @property
    def feeds_drafter(self) -> bool:
        """Whether admission prefills the drafter: not under policy "none", which never drafts
        (its prefill would cost a drafter pass and the target's hidden states per prompt)."""
        return self.config.scheduler.policy != "none"

    @property
    def num_active(self) -> int:
        return sum(l is not None for l in self.slots)

    def has_work(self) -> bool:
        return bool(self.queue) or self.num_active > 0

    def calibration_state(self) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Online calibration (``EngineConfig.online_calibration``): ``(rho, accepted, predicted)``,
        each float ``[γ]`` — the per-position ratios the confidence policies multiply the raw
        confidences by (1 = already calibrated; specjax/engine/online_calibration.py) and the
        decayed sums they come from. None when calibration is off or no device-loop call ran."""
        if not self.config.online_calibration or self._carry is None:
            return None
        acc, pred = self._carry.cal_acc, self._carry.cal_pred
        return np.asarray(oc.ratios(acc, pred)), np.asarray(acc), np.asarray(pred)

    def step(self) -> Union[StepStats, LoopStats, None]:
        """Admits, then runs one host step (``loop="host"``: drafts, schedules, verifies, emits) or
        one device-loop call (``loop="device"``: up to ``loop_steps`` steps). Returns its stats.

        If a device step fails, every request in a slot finishes with reason "error" (the message
        kept), the device state is rebuilt, and the queue keeps being served; the exception is
        re-raised only when ``raise_errors`` was set on the engine.
        """
        try:
            return self._step() if self.config.loop == "host" else self._device_call()
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
        self._carry = None  # device loop: the last call's state (production's confidence history)
        self._no_draft_rows = None
        self._next_budget = None  # production: budget searched at the last pre-dispatch

    def run(self, max_steps: Optional[int] = None) -> dict[str, Result]:
        """Steps (device loop: calls) until no request is queued or running (or ``max_steps``);
        returns the finished requests."""
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
