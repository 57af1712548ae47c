"""Replay of measured drafter traces through the verification policies at a given load (numpy).

What a policy buys depends on two things: how long each draft chain survives (the drafter) and
how the cost of a verification step grows with the tokens in it (the hardware, SPS(B)). The
engine measures both on the machine it runs on. This module combines a drafter's *recorded*
per-step outcomes with *any* SPS profile, so the policies can be compared on hardware the code is
not running on (e.g. a TPU roofline profile from :mod:`specjax.aot`), at any concurrency.

Traces (``experiments/offline_eval.save_traces``): per verification step of the offline
evaluation, the number of drafts accepted when all γ were verified, and the drafter's
confidences ``[γ]``. Rejection sampling decides draft k from draft k's own distributions and
uniform alone, so verifying only the first ℓ drafts of that step would have accepted
``min(num_accepted, ℓ)``: truncating a recorded step is an exact replay of a shorter
verification.

One simulated step (C requests, all decoding; no admission, no finishing):

1. each request draws a recorded step uniformly at random (steps of one request are independent
   here, which ignores the correlation of consecutive steps of one text), or, with
   ``sequential=True`` and traces that know their requests, replays a recorded request's steps
   in order;
2. the policy picks ℓ_r from the confidences (the production policy from its own history of
   confidences two drafting steps old, as the engine's host loop does, shrunk towards the
   running prior by their age, ``SchedulerConfig.stale_decay``);
3. the request emits ``min(num_accepted, ℓ_r) + 1`` tokens; the step costs
   ``1 / SPS(C + Σ ℓ_r)`` seconds plus the drafting time when the step drafted.

Throughput is tokens per second over all requests; per-user speed is throughput / C.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from specjax import scheduling
from specjax.buckets import SPSProfile
from specjax.scheduling import SchedulerConfig

__all__ = ["Traces", "SimResult", "simulate", "sweep"]


@dataclasses.dataclass(frozen=True)
class Traces:
    """Recorded verification steps of one drafter.

    num_accepted: int ``[N]`` drafts accepted with all γ verified; confidences: float ``[N, γ]``.
    request: optional int ``[N]``: which served request each step belongs to, the steps of one
      request contiguous and in the order they ran (``benchmarks/confidence_staleness.py``
      records such traces); it lets :func:`simulate` replay requests step by step
      (``sequential=True``).
    """

    num_accepted: np.ndarray
    confidences: np.ndarray
    request: Optional[np.ndarray] = None

    def __post_init__(self):
        n, c = np.asarray(self.num_accepted), np.asarray(self.confidences)
        if c.ndim != 2 or n.shape != c.shape[:1] or n.size == 0:
            raise ValueError(f"want num_accepted [N] and confidences [N, γ] with N > 0, got "
                             f"{n.shape} and {c.shape}")
        if n.min() < 0 or n.max() > c.shape[1]:
            raise ValueError(f"num_accepted must lie in [0, γ={c.shape[1]}]")
        if self.request is not None:
            r = np.asarray(self.request)
            if r.shape != n.shape:
                raise ValueError(f"request must be [N] = {n.shape}, got {r.shape}")
            starts = r[np.r_[True, r[1:] != r[:-1]]]
            if len(np.unique(starts)) != len(starts):
                raise ValueError("each request's steps must be contiguous")

    def request_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """``(start, length)`` int ``[R]`` of each recorded request's run of steps."""
        if self.request is None:
            raise ValueError("these traces do not record which request each step belongs to")
        r = np.asarray(self.request)
        start = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
        return start, np.diff(np.r_[start, r.size])

    @property
    def gamma(self) -> int:
        return int(np.asarray(self.confidences).shape[1])

    @classmethod
    def load(cls, path: str, domains: Optional[Sequence[str]] = None) -> "Traces":
        """Pools the domains of a ``traces_*.npz`` (all of them by default)."""
        z = np.load(path)
        names = sorted({k.split("/")[0] for k in z.files if k.endswith("/confidences")})
        if domains is not None:
            missing = set(domains) - set(names)
            if missing:
                raise ValueError(f"{path}: no traces for {sorted(missing)}; has {names}")
            names = list(domains)
        if not names:
            raise ValueError(f"{path}: no confidences (only drafters with a confidence head "
                             f"can drive the policies)")
        request = None
        if all(f"{d}/request" in z.files for d in names):  # request ids made unique across names
            request, offset = [], 0
            for d in names:
                r = z[f"{d}/request"].astype(np.int64)
                request.append(r - r.min() + offset)
                offset += int(r.max() - r.min()) + 1
            request = np.concatenate(request)
        return cls(np.concatenate([z[f"{d}/num_accepted"] for d in names]).astype(np.int64),
                   np.concatenate([z[f"{d}/confidences"] for d in names]).astype(np.float64),
                   request)


@dataclasses.dataclass(frozen=True)
class SimResult:
    """One (policy, concurrency) cell: ``tokens`` emitted in ``seconds`` over ``steps`` steps."""

    policy: str
    concurrency: int
    steps: int
    tokens: int
    seconds: float
    verified_drafts: int
    drafting_steps: int

    @property
    def throughput(self) -> float:
        """Tokens per second, all requests."""
        return self.tokens / self.seconds

    @property
    def per_user(self) -> float:
        """Tokens per second of one request."""
        return self.throughput / self.concurrency

    @property
    def tau(self) -> float:
        """Tokens per request per step."""
        return self.tokens / (self.steps * self.concurrency)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(throughput=self.throughput, per_user=self.per_user, tau=self.tau)
        return d


def simulate(traces: Traces, config: SchedulerConfig, profile: SPSProfile, concurrency: int, *,
             steps: int = 200, seed: int = 0, sequential: bool = False) -> SimResult:
    """Replays ``steps`` steps of ``concurrency`` requests under ``config`` (module docstring).

    Args:
      traces: the drafter's recorded steps; the policy sees their confidences.
      config: the policy ("retrospective" is refused: it is not lossless).
      profile: SPS(B) of the verification step per token bucket and the drafting time.
      concurrency: C requests decoding together (C ≤ the largest bucket).
      steps: simulated steps; seed: the draws of recorded steps.
      sequential: instead of independent draws, each simulated request walks through one
        recorded request's steps in order, one recorded step per simulated step whatever the
        policy did (plain or drafting), so consecutive steps are as correlated as they were
        when recorded; it starts at a random step of its first recorded request and, at the
        end of one, moves on to another drawn at random, as a new request without history
        (production reads the prior for it). Needs ``traces.request``.
    Returns:
      A :class:`SimResult`.
    """
    if config.policy == "retrospective":
        raise ValueError("the retrospective search is biased (Appendix A); simulate lossless "
                         "policies only")
    c, g = int(concurrency), traces.gamma
    if c < 1 or c > profile.max_tokens:
        raise ValueError(f"concurrency must be in [1, {profile.max_tokens}] (the largest "
                         f"bucket), got {concurrency}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    sps, sps_d = profile.table(), profile.table_with_draft()
    num_acc = np.asarray(traces.num_accepted, np.int64)
    conf_all = np.asarray(traces.confidences, np.float64)
    rng = np.random.default_rng(seed)
    if sequential:
        draws, new_request = _sequential_draws(traces, rng, steps, c)
    else:
        draws = rng.integers(0, num_acc.size, size=(steps, c))
        new_request = np.zeros((steps, c), bool)
    cap = np.full(c, g, np.int64)
    # production: per-request confidences of past drafting steps (two kept) and a running prior
    hist = np.zeros((c, 2, g))
    hist_n = np.zeros(c, np.int64)
    hist_t = np.zeros((c, 2), np.int64)  # the step each was drafted at
    prior, prior_seen, since_draft = np.full(g, 0.5), False, 0
    tokens = verified = drafting = 0
    seconds = 0.0
    for t in range(steps):
        idx = draws[t]
        live = conf_all[idx]
        hist_n = np.where(new_request[t], 0, hist_n)
        if config.policy == "none":
            lengths, drew = np.zeros(c, np.int64), False
        elif config.policy == "production":
            stale = np.where((hist_n >= 2)[:, None], hist[:, 0], prior[None])
            stale = scheduling.shrink_stale(stale, prior, t - hist_t[:, 0], config.stale_decay)
            budget = scheduling.budget_search(stale, sps, cap, sps_d)
            if budget == 0 and config.explore_every and (not prior_seen or
                                                         since_draft + 1 >= config.explore_every):
                budget = scheduling.budget_search(stale, sps, cap, sps_d, plain_sps=1e-30)
            drew = budget > 0
            lengths = (scheduling.top_budget_admission(live, budget, cap) if drew
                       else np.zeros(c, np.int64))
            if drew:
                hist = np.stack([hist[:, 1], live], axis=1)
                hist_t = np.stack([hist_t[:, 1], np.full(c, t)], axis=1)
                hist_n = hist_n + 1
                w = 0.1 if prior_seen else 1.0
                prior, prior_seen = scheduling.survival_prior_update(prior, live, w), True
            since_draft = 0 if drew else since_draft + 1
        else:
            lengths = scheduling.schedule(config, live, sps, max_len=cap)
            drew = True
        b = c + int(lengths.sum())
        if b > profile.max_tokens:
            raise ValueError(f"{config.policy}: a step of {b} tokens exceeds the largest bucket "
                             f"({profile.max_tokens}); profile larger buckets or lower C / K")
        tokens += int(np.minimum(num_acc[idx], lengths).sum()) + c
        verified += int(lengths.sum())
        drafting += int(drew)
        seconds += 1.0 / (sps_d[b] if drew else sps[b])
    return SimResult(policy=_label(config), concurrency=c, steps=steps, tokens=tokens,
                     seconds=seconds, verified_drafts=verified, drafting_steps=drafting)


def _sequential_draws(traces: Traces, rng: np.random.Generator, steps: int, c: int):
    """``(draws, new_request)`` int / bool ``[steps, C]``: the recorded step each simulated
    request replays at each step, and whether it is the first of a newly drawn recorded request
    (:func:`simulate`'s ``sequential``)."""
    start, length = traces.request_spans()
    draws = np.zeros((steps, c), np.int64)
    new_request = np.zeros((steps, c), bool)
    cur = rng.integers(0, start.size, size=c)
    pos = rng.integers(0, length[cur])  # a random step of the first request: no lockstep
    for t in range(steps):
        draws[t] = start[cur] + pos
        pos += 1
        done = pos >= length[cur]
        if done.any() and t + 1 < steps:
            cur[done] = rng.integers(0, start.size, size=int(done.sum()))
            pos[done] = 0
            new_request[t + 1] = done
    return draws, new_request


def _label(config: SchedulerConfig) -> str:
    if config.policy == "fixed":
        return f"fixed K={config.k}"
    if config.policy == "production" and config.stale_decay != SchedulerConfig.stale_decay:
        return f"production ρ={config.stale_decay:g}"
    return config.policy


def sweep(traces: Traces, configs: Sequence[SchedulerConfig], profile: SPSProfile,
          concurrencies: Sequence[int], *, steps: int = 200, seed: int = 0,
          sequential: bool = False) -> list[SimResult]:
    """:func:`simulate` for every (policy, concurrency); the same draws for every policy at one
    concurrency (common random numbers), so their ratios are paired."""
    return [simulate(traces, cfg, profile, c, steps=steps, seed=seed + c, sequential=sequential)
            for c in concurrencies for cfg in configs]
