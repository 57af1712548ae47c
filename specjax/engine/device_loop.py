"""The device-resident speculative loop: many engine steps in one jitted ``lax.while_loop``.

One call runs, per step and without returning to the host::

    budget   production only: draft-token budget from each slot's latest drafted confidences
             (at least one step old: fixed before this step drafts); at budget 0
             the step is a plain decode step (as "none", plus the drafter's commit) instead
             of the four below
    draft    every slot drafts γ tokens (skipped by "none")
    choose   ℓ per slot with the policy in jnp (:mod:`specjax.engine.device_policies`)
    verify   Σ(1+ℓ) tokens in the smallest token bucket (``lax.switch``, one branch per bucket),
             rejection / target-only per slot, caches and drafter committed by lengths
    emit     accepted tokens into the output buffer; stop tokens and max_new_tokens finish slots

and returns when no slot is active, after ``spec.max_steps`` steps (the host streams then),
(``stop_on_finish``) as soon as a slot finishes while requests wait for admission, or
(``shrink_at``) as soon as few enough slots are left for a smaller row bucket. The host only
admits (prefill), streams and finishes.

Plain decoding (policy "none") runs a dense ``[S, 1]`` decode step instead: no drafter, no
flattening, no verifier. Production's steps without drafts run the same step (plus the
drafter's commit) as the body of an inner ``while_loop`` that lasts while production keeps
choosing not to draft; each trip of the outer loop ends with the drafting step that stopped it.

Exactness is the host engine's: the same verification (:func:`~specjax.engine.steps.verify_forward`
in the bucket branch, then :func:`~specjax.engine.steps.verify_finish`), per-request
verification keys from (seed, the request's own step count), and policies that only read
information available before the drafts they admit.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.drafters.base import DraftOutput, Sampling
from specjax.engine import device_policies as dp
from specjax.engine import online_calibration as oc
from specjax.engine.steps import (DeviceState, plain_commit, plain_decode, verify_finish,
                                  verify_forward)
from specjax.scheduling import SchedulerConfig

VERIFY_SALT = 2  # key salt of verification noise (prefill's first token uses 1)
# Production's exploration interval grows up to this factor while exploring never pays: at high
# load an exploring step (draft + a wide verification) costs several plain steps.
EXPLORE_BACKOFF = 16


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """Static shape and policy of a device loop (its compilation key).

    policy / k / threshold / explore_every / stale_decay: as
    :class:`~specjax.scheduling.SchedulerConfig`.
    gamma: drafts per step. buckets: verification token buckets (ascending). method: "rejection"
    or "target_only". max_steps: steps per call (the output buffer holds
    ``max_steps · (γ + 1)`` tokens per slot). verify_impl: "jnp" or "pallas". calibrate: the
    confidence policies read online-calibrated confidences (:mod:`.online_calibration`).
    """

    policy: str
    gamma: int
    buckets: tuple
    method: str
    max_steps: int
    k: int = 4
    threshold: float = 0.5
    explore_every: int = 16
    verify_impl: str = "jnp"
    calibrate: bool = False
    stale_decay: float = SchedulerConfig.stale_decay

    @property
    def out_len(self) -> int:
        return self.max_steps * (self.gamma + 1)


class LoopState(NamedTuple):
    """Carry of the device loop (S slots, γ drafts, O = ``spec.out_len``).

    dev: the engine's :class:`DeviceState` (cache, drafter state, anchors).
    active: bool ``[S]`` slot holds a request that has not finished.
    remaining: int32 ``[S]`` tokens the slot's request may still emit.
    steps: int32 ``[S]`` verification steps its request has taken (keys its verification noise).
    out: int32 ``[S, O]`` tokens emitted during this call; out_len: int32 ``[S]`` how many.
    drafted, accepted: int32 ``[S, γ]`` drafts verified / accepted per draft position (this call).
    reached: int32 ``[S, γ]`` verified drafts whose earlier drafts were all accepted (the
      denominator of the conditional acceptance α_k = accepted / reached).
    conf_hist: f32 ``[S, 2, γ]`` the slot's last two drafted confidences (older first);
      hist_n: int32 ``[S]`` how many it has (production).
    prior: f32 ``[γ]`` confidences whose survivals are the running mean of the drafted ones'
      (production: stands in for new requests; stale vectors shrink towards it);
      prior_seen: bool scalar, the prior was set from real confidences.
    cal_acc, cal_pred: f32 ``[γ]`` decayed acceptances and raw confidences of the verified drafts
      that reached each position (online calibration; :mod:`.online_calibration`).
    since_draft: int32 scalar, steps since the last drafting step (production's exploration).
    explore_gap: int32 scalar, steps without drafting after which production drafts anyway: starts
      at ``spec.explore_every``, doubles after each such exploring step (up to
      ``EXPLORE_BACKOFF`` times it) and resets when the budget search itself drafts. Until
      ``prior_seen``, every step explores (without doubling the gap).
    draws: int32 scalar, drafting calls so far (keys the drafting noise).
    t: int32 scalar, steps this call. finished: bool scalar, a slot finished this call.
    """

    dev: DeviceState
    active: jax.Array
    remaining: jax.Array
    steps: jax.Array
    out: jax.Array
    out_len: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    reached: jax.Array
    conf_hist: jax.Array
    hist_n: jax.Array
    prior: jax.Array
    prior_seen: jax.Array
    cal_acc: jax.Array
    cal_pred: jax.Array
    since_draft: jax.Array
    explore_gap: jax.Array
    draws: jax.Array
    t: jax.Array
    finished: jax.Array


def slot_keys(seeds: jax.Array, steps: jax.Array, salt) -> jax.Array:
    """``[S]`` keys from each request's seed, its own step count and a salt (batch independent)."""
    def one(seed, step):
        k = jax.random.key(seed)
        return jax.random.fold_in(jax.random.fold_in(k, step), jnp.asarray(salt, jnp.uint32))
    return jax.vmap(one)(seeds.astype(jnp.uint32), steps.astype(jnp.uint32))


def _choose(spec: LoopSpec, conf, cap, active, sps, budget):
    """ℓ per slot (-1 inactive) for every policy except production's budget step."""
    if spec.policy == "fixed":
        return dp.fixed_k(min(spec.k, spec.gamma), cap, active)
    if spec.policy == "mtp1":
        return dp.fixed_k(1, cap, active)
    if spec.policy == "threshold":
        return dp.threshold_schedule(conf, spec.threshold, cap, active)
    if spec.policy in ("dspark", "retrospective"):
        return dp.prefix_schedule(conf, sps, cap, active, early_stop=spec.policy == "dspark")
    if spec.policy == "production":
        return dp.top_budget_admission(conf, budget, cap, active)
    raise ValueError(f"device loop: unknown policy {spec.policy!r}")


def _emit(ls: LoopState, tokens, n_tok, stop_tokens, spec: LoopSpec):
    """Appends ``tokens[s, :n_tok[s]]`` (cut after a stop token and at ``remaining``) to the
    output buffer; returns the updated (active, remaining, out, out_len, finished_now)."""
    j = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    real = j < n_tok[:, None]
    is_stop = jnp.any(tokens[:, :, None] == stop_tokens[:, None, :], axis=-1) & real
    first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), tokens.shape[1])
    n_out = jnp.minimum(jnp.minimum(n_tok, first_stop + 1), ls.remaining)
    idx = jnp.where(j < n_out[:, None], ls.out_len[:, None] + j, spec.out_len)  # past end: dropped
    rows = jnp.broadcast_to(jnp.arange(tokens.shape[0])[:, None], idx.shape)
    out = ls.out.at[rows, idx].set(tokens, mode="drop")
    remaining = ls.remaining - n_out
    done = ls.active & ((first_stop < n_out) | (remaining <= 0))
    return ls.active & ~done, remaining, out, ls.out_len + n_out, done


def plain_step(target_graphdef, target_state, ls: LoopState, sampling, keys, drafter=None,
                params=None, frozen=None):
    """One dense decode step for every active slot: policy "none", and production's steps that
    do not draft (with ``drafter``: its state is committed as after a verification of no drafts).

    The token is drawn from the target's distribution after the anchor, as the bonus token of a
    verification with ℓ = 0 is, without the flattened layout or the verifier (about 1.3-1.5x
    cheaper on CPU). ``keys``: the slots' ``[S]`` keys, or a function that makes them (called
    only when some active slot samples). Returns ``(DeviceState, tokens int32 [S, 1])``.
    """
    if drafter is None:
        dev, tok = plain_decode(target_graphdef, target_state, ls.dev, ls.active, sampling, keys)
    else:
        dev, tok = plain_commit(target_graphdef, target_state, ls.dev, ls.active, sampling, keys,
                                drafter, params, frozen)
    return dev, tok[:, None]


def _run_if(pred, fn, operand):
    """``fn(operand)`` if ``pred`` else ``operand``, as a ``lax.while_loop`` of 0 or 1 trips."""
    _, out = jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.bool_(False), fn(c[1])),
                                (pred, operand))
    return out


def _speculative_step(spec: LoopSpec, target_graphdef, target_state, drafter, params, frozen,
                      dev: DeviceState, ls: LoopState, sampling, keys, key, budget, sps, cap):
    """Draft, choose ℓ, verify in the token bucket, commit. Returns ``(DeviceState, tokens
    int32 [S, γ+1], num_accepted int32 [S], ℓ int32 [S], raw confidences f32 [S, γ])``."""
    g = spec.gamma
    active = ls.active
    dkey = jax.random.fold_in(key, ls.draws)
    out, dstate = drafter.propose(params, frozen, dev.drafter_state, dkey, gamma=g,
                                  sampling=sampling, argmax=spec.method == "target_only")
    out: DraftOutput
    conf = out.confidences if out.confidences is not None else jnp.ones((cap.shape[0], g))
    ell = _choose(spec, _calibrated(spec, ls, conf), cap, active, sps, budget)
    dev = DeviceState(dev.cache, dstate, dev.anchor)
    dev, res = bucketed_verify(target_graphdef, target_state, drafter, params, frozen, dev,
                               out.tokens, out.probs, ell, keys, sampling, buckets=spec.buckets,
                               gamma=g, method=spec.method, verify_impl=spec.verify_impl)
    return dev, res.tokens, res.num_accepted, ell, conf.astype(jnp.float32)


def _calibrated(spec: LoopSpec, ls: LoopState, conf):
    """The confidences the policy reads: online-calibrated when ``spec.calibrate``."""
    if not spec.calibrate:
        return conf
    return oc.calibrate(conf, oc.ratios(ls.cal_acc, ls.cal_pred))


def bucketed_verify(target_graphdef, target_state, drafter, params, frozen, dev: DeviceState,
                    tokens, probs, ell, keys, sampling, *, buckets: tuple, gamma: int,
                    method: str, verify_impl: str):
    """Verification of ``ell`` drafts per slot (−1 idle) in the smallest token bucket holding
    Σ(ℓ + 1) tokens, as the device loop runs it. Returns ``(DeviceState, VerifyOutput)``."""
    n_tok = jnp.sum(jnp.where(ell >= 0, ell + 1, 0))
    b_idx = jnp.minimum(jnp.searchsorted(jnp.asarray(buckets, jnp.int32), n_tok, side="left"),
                        len(buckets) - 1)

    # Only the target forward runs in the bucket branches; it reads the cache, and the
    # new keys/values are written after the switch (verify_forward says why).
    def branch(bucket):
        def run(dev):
            return verify_forward(target_graphdef, target_state, drafter, dev, tokens, ell,
                                  bucket=bucket, gamma=gamma, write=False, pad_to=buckets[-1])
        return run

    fwd = jax.lax.switch(b_idx, [branch(b) for b in buckets], dev)
    return verify_finish(drafter, params, frozen, dev, fwd, tokens, probs, ell, keys, sampling,
                         method=method, verify_impl=verify_impl)


@functools.partial(jax.jit, static_argnames=("target_graphdef", "drafter", "spec"),
                   donate_argnames=("ls",))
def run_loop(target_graphdef: nnx.GraphDef, target_state, drafter, params, frozen,
             ls: LoopState, sampling: Sampling, seeds: jax.Array, stop_tokens: jax.Array,
             sps: jax.Array, sps_draft: jax.Array, sps_plain: jax.Array, key: jax.Array,
             stop_on_finish: jax.Array, shrink_at=-1, *, spec: LoopSpec) -> LoopState:
    """Runs engine steps on the device until a return condition (module docstring).

    Args:
      ls: the loop state (donated); ``out``, ``out_len``, ``drafted``, ``accepted``, ``t`` and
        ``finished`` should be zero on entry.
      sampling: per-slot :class:`Sampling` (``[S]`` fields).
      seeds: uint32 ``[S]`` request seeds. stop_tokens: int32 ``[S, n]`` (-1 pads).
      sps, sps_draft: f32 ``[B_max + 1]`` SPS tables (verify only / draft + verify).
      sps_plain: f32 scalar, steps/s of a plain decode step (production scores "no draft" with
        it; 0 = not measured, then with ``sps``).
      key: the engine's drafting key (folded with ``ls.draws``).
      stop_on_finish: bool scalar: return as soon as a slot finishes.
      shrink_at: int32 scalar: return as soon as no more than this many slots are active (the
        host then runs the next call on fewer rows: ``EngineConfig.row_buckets``); -1: never.
    Returns:
      the final :class:`LoopState`.
    """
    g = spec.gamma

    def cond(ls: LoopState):
        return ((ls.t < spec.max_steps) & jnp.any(ls.active) & ~(stop_on_finish & ls.finished)
                & (jnp.sum(ls.active) > shrink_at))

    def keys_of(ls: LoopState):
        def keys():  # built where used: a greedy plain step needs none
            return slot_keys(seeds, ls.steps, VERIFY_SALT)
        return keys

    def finish(ls: LoopState, dev, tokens, n_acc, ell, conf, drew, gap):
        """The step's bookkeeping, whichever step ran: calibration, emit, statistics."""
        active = ls.active
        cal_acc, cal_pred = ls.cal_acc, ls.cal_pred
        if spec.calibrate and spec.policy != "none":
            cal_acc, cal_pred = oc.update(cal_acc, cal_pred, conf, jnp.where(active, ell, -1),
                                          n_acc, drew)
        n_tok = jnp.where(active, n_acc + 1, 0)
        new_active, remaining, buf, out_len, done = _emit(ls, tokens, n_tok, stop_tokens, spec)
        pos = jnp.arange(g, dtype=jnp.int32)[None, :]
        ver = active[:, None] & (pos < jnp.maximum(ell, 0)[:, None])
        return ls._replace(
            dev=dev, active=new_active, remaining=remaining, steps=ls.steps + active,
            out=buf, out_len=out_len, drafted=ls.drafted + ver,
            accepted=ls.accepted + (ver & (pos < n_acc[:, None])),
            reached=ls.reached + (ver & (pos <= n_acc[:, None])),
            cal_acc=cal_acc, cal_pred=cal_pred,
            since_draft=jnp.where(drew, 0, ls.since_draft + 1), explore_gap=gap,
            draws=ls.draws + drew,
            t=ls.t + 1, finished=ls.finished | jnp.any(done))

    def plain_body(ls: LoopState, with_drafter: bool):
        """One plain decode step for every active slot (no drafts: ℓ = 0)."""
        extra = (drafter, params, frozen) if with_drafter else ()
        dev, tok = plain_step(target_graphdef, target_state, ls, sampling, keys_of(ls), *extra)
        s = ls.active.shape[0]
        tokens = jnp.full((s, g + 1), -1, jnp.int32).at[:, :1].set(tok)
        return finish(ls, dev, tokens, jnp.zeros_like(ls.remaining),
                      jnp.where(ls.active, 0, -1), jnp.zeros((s, g), jnp.float32),
                      jnp.bool_(False), ls.explore_gap)

    def production_choice(ls: LoopState):
        return production_step_choice(spec, ls, sps, sps_draft, sps_plain)

    def speculative_body(ls: LoopState, budget, cap, drew, gap):
        """One drafting step: draft, choose ℓ (``budget``: production's), verify, commit."""
        dev, tokens, n_acc, ell, conf = _speculative_step(
            spec, target_graphdef, target_state, drafter, params, frozen, ls.dev, ls, sampling,
            keys_of(ls)(), key, budget, sps, cap)
        if spec.policy == "production":
            ls = _update_confidences(ls, conf, ls.active & drew)
        return finish(ls, dev, tokens, n_acc, ell, conf, drew, gap)

    if spec.policy == "none":
        return jax.lax.while_loop(cond, lambda ls: plain_body(ls, False), ls)

    if spec.policy == "production":
        # Each trip: the plain steps production chooses, as an inner while loop, then the
        # drafting step that ended them, as a loop of 0 or 1 trips. Neither is a lax.cond
        # branch (XLA:CPU copies the whole target cache into and out of a conditional whose
        # branches write it); a plain step in a 0-or-1-trip loop of its own ran slower on CPU
        # than as a loop body, and only the drafting step, several times dearer, pays that.
        def drafting(ls):
            cap, budget, drew, gap = production_choice(ls)
            return speculative_body(ls, budget, cap, drew, gap)

        def body(ls: LoopState):
            ls = jax.lax.while_loop(lambda l: cond(l) & ~production_choice(l)[2],
                                    lambda l: plain_body(l, True), ls)
            return _run_if(cond(ls), drafting, ls)
        return jax.lax.while_loop(cond, body, ls)

    def body(ls: LoopState):
        cap = jnp.clip(jnp.minimum(g, ls.remaining - 1), 0, g)
        return speculative_body(ls, jnp.int32(0), cap, jnp.bool_(True), ls.explore_gap)

    return jax.lax.while_loop(cond, body, ls)


def production_step_choice(spec: LoopSpec, ls: LoopState, sps, sps_draft, sps_plain):
    """``(cap, budget, drew, explore gap after the step)`` of production's next step: the
    budget from each slot's latest drafted confidences (a step or more old: nothing is in
    flight on the device, unlike the paper's CPU scheduler, whose newest are two steps
    old), shrunk towards the running prior by their age (``spec.stale_decay``); budget 0 -> a
    plain step (no draft) unless it is time to explore. ``sps``, ``sps_draft``, ``sps_plain``:
    as :func:`run_loop`'s. ``cap``, ``budget``: int32 ``[S]`` / scalar; ``drew``: bool scalar."""
    g = spec.gamma
    cap = jnp.clip(jnp.minimum(g, ls.remaining - 1), 0, g)
    stale = jnp.where((ls.hist_n >= 1)[:, None], ls.conf_hist[:, 1], ls.prior[None])
    # every active row with a vector drafted it at the last drafting step: since_draft + 1
    # steps ago (rows admitted since read the prior, which no lag changes)
    lag = jnp.full(stale.shape[:1], ls.since_draft + 1, jnp.int32)
    stale = dp.shrink_stale(stale, ls.prior, lag, spec.stale_decay)
    stale = _calibrated(spec, ls, stale)
    budget = dp.budget_search(stale, sps, cap, ls.active, sps_draft, sps_plain)
    voluntary = budget > 0
    # Before any confidence was seen, the stale ones are a 0.5 guess: draft once to measure
    # them rather than run explore_every plain steps on a guess (a fresh engine's first step).
    cold = ~ls.prior_seen
    explore = ~voluntary & (spec.explore_every > 0) & \
        ((ls.since_draft + 1 >= ls.explore_gap) | cold)
    # an exploring step drafts whatever the plain step's rate: the best budget > 0
    budget = jnp.where(explore, dp.budget_search(stale, sps, cap, ls.active, sps_draft,
                                                 jnp.float32(1e-30)), budget)
    drew = budget > 0
    gap = jnp.where(voluntary, spec.explore_every,
                    jnp.where(drew & ~cold, jnp.minimum(2 * ls.explore_gap,
                                                        EXPLORE_BACKOFF * spec.explore_every),
                              ls.explore_gap))
    return cap, budget, drew, gap


def _update_confidences(ls: LoopState, conf, fresh):
    """Production: pushes the fresh rows' confidences into their history and the running prior
    (a moving average of survivals over steps, :func:`specjax.scheduling.survival_prior_update`;
    the first observation replaces the 0.5 guess)."""
    pushed = jnp.stack([ls.conf_hist[:, 1], conf.astype(jnp.float32)], axis=1)
    hist = jnp.where(fresh[:, None, None], pushed, ls.conf_hist)
    n = jnp.where(fresh, jnp.minimum(ls.hist_n + 1, 2), ls.hist_n)
    any_fresh = jnp.any(fresh)
    w = jnp.where(ls.prior_seen, 0.1, 1.0)
    prior = dp.survival_prior_update(ls.prior, conf.astype(jnp.float32), fresh, w)
    return ls._replace(conf_hist=hist, hist_n=n, prior=prior,
                       prior_seen=ls.prior_seen | any_fresh)


def init_loop_state(dev: DeviceState, num_slots: int, gamma: int, out_len: int,
                    explore_every: int = 16) -> LoopState:
    """A loop state around ``dev`` with nothing active and empty buffers (host fills the rest)."""
    s, g = num_slots, gamma
    zi = jnp.zeros((s,), jnp.int32)
    return LoopState(
        dev=dev, active=jnp.zeros((s,), bool), remaining=zi, steps=zi,
        out=jnp.full((s, out_len), -1, jnp.int32), out_len=zi,
        drafted=jnp.zeros((s, g), jnp.int32), accepted=jnp.zeros((s, g), jnp.int32),
        reached=jnp.zeros((s, g), jnp.int32), conf_hist=jnp.zeros((s, 2, g), jnp.float32), hist_n=zi,
        prior=jnp.full((g,), 0.5, jnp.float32), prior_seen=jnp.bool_(False),
        cal_acc=jnp.zeros((g,), jnp.float32), cal_pred=jnp.zeros((g,), jnp.float32),
        since_draft=jnp.int32(0), explore_gap=jnp.int32(explore_every), draws=jnp.int32(0),
        t=jnp.int32(0), finished=jnp.bool_(False))
