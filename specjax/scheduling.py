"""Host-side verification scheduling (numpy only, no JAX).

Each engine step, every active request r has γ drafted tokens with confidences
``c[r, k] = P(draft k accepted | drafts < k accepted)``. A policy picks how many of them to verify,
``ℓ_r ∈ [0, γ]``. The verification batch then holds ``B = Σ_r (1 + ℓ_r)`` tokens, padded up to a
compiled token bucket.

Policies (DSpark paper §3.2.2, §5.2 and Appendix A; DESIGN "Prefix scheduler"):

* ``no_speculation``: ℓ = 0 (plain decoding through the same engine).
* ``fixed_k``: ℓ = K for every request (K = 1 is the "MTP-1" setting).
* ``threshold``: longest prefix whose survival ``a_{r,j} = Π_{i≤j} c_{r,i}`` stays ≥ a threshold.
* ``prefix_schedule(early_stop=True)``: Algorithm 1. Sort all (r, j) by ``a`` (descending; ties:
  smaller j first), admit one by one and stop at the first admission that does not raise
  ``Θ = τ · SPS(B)``. The early stop makes the admission of draft k depend only on information
  available before x_k was drawn (the non-anticipating rule), which keeps decoding lossless.
  ``early_stop=False`` is the retrospective global search; it is biased (Appendix A) and kept only
  so tests can show the bias.
* ``production_schedule``: the asynchronous form of §5.2. The token *budget* comes from a full
  search over the greedy path using confidences from two steps earlier (stale, so independent of
  the tokens being verified); the current step then admits its top-``budget`` candidates by live
  ``a`` (rank-preserving top-K), which is non-anticipating.

Why the greedy path is enough: ``a_{r,j}`` is non-increasing in j, so for any fixed B the best τ is
reached by the B − R largest survival probabilities, which always form per-request prefixes.

SPS(B) (steps per second of a verification forward of B tokens) is profiled once per compiled
bucket at engine start (:func:`profile_sps`) and used as a step function of B (a batch of B tokens
runs in the smallest bucket ≥ B).
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import os
import statistics
import time
from typing import Callable, Optional, Sequence

import numpy as np

# --------------------------------------------------------------------------------------------
# Buckets and the SPS profile
# --------------------------------------------------------------------------------------------


def validate_buckets(buckets: Sequence[int]) -> list[int]:
    """Returns the buckets as a sorted list of distinct positive ints (raises on bad input)."""
    out = sorted(set(int(b) for b in buckets))
    if not out or out[0] <= 0:
        raise ValueError(f"token buckets must be positive ints, got {list(buckets)}")
    return out


def pick_bucket(buckets: Sequence[int], num_tokens: int) -> int:
    """Smallest bucket ≥ ``num_tokens`` (buckets sorted ascending; JetStream ``take_nearest``)."""
    i = bisect.bisect_left(buckets, num_tokens)
    if i == len(buckets):
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {buckets[-1]}")
    return buckets[i]


def plan_chunks(buckets: Sequence[int], num_tokens: int, *, call_cost: float = 0.0) -> list[int]:
    """Chunk buckets that feed ``num_tokens`` prompt tokens at the least cost.

    A call at bucket C costs ``C + call_cost`` (its padded positions plus a fixed price per call,
    in positions); the plan minimises the total, then the number of calls, then puts the largest
    chunk first. Each chunk but the last is full. Examples with buckets (8, 16, 32, 64, 128): 35
    tokens -> [32, 8] (40 positions, where the smallest bucket that holds 35 would pad to 64);
    200 -> [128, 64, 8]. With ``call_cost=32``, 35 -> [64].

    Why positions: a prefill call's time grows with its bucket (on a 2-core CPU, admitting 32
    prompts of 26-36 tokens to the quickstart target and its MTP head took 0.11-0.12 s in chunks
    planned over buckets (8, 32, 128) and 0.34 s in one 128-position chunk:
    ``benchmarks/results/rl_rollout_speed*.json``, ``prefill_s``). On hardware where a small call
    is bound by reading the weights, ``call_cost`` says how many positions one call is worth.

    Args:
      buckets: sorted distinct positive chunk sizes (:func:`validate_buckets`).
      num_tokens: tokens to feed, >= 1.
      call_cost: fixed cost of one call, in positions (>= 0).
    Returns:
      The chunk sizes in call order; ``sum`` >= ``num_tokens``.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if call_cost < 0:
        raise ValueError(f"call_cost must be >= 0, got {call_cost}")
    return list(_plan_chunks(tuple(buckets), int(num_tokens), float(call_cost)))


@functools.lru_cache(maxsize=256)
def _plan_chunks(buckets: tuple, n: int, call_cost: float) -> tuple:
    # cost[m], calls[m]: the best way to feed m tokens: one chunk that holds them all, or a full
    # chunk b < m followed by the best way to feed the other m - b (first[m] = that chunk).
    # O(n * len(buckets)).
    cost, calls, first = [0.0], [0], [0]
    for m in range(1, n + 1):
        best = None
        for b in buckets:
            option = (b + call_cost + (cost[m - b] if b < m else 0.0),
                      1 + (calls[m - b] if b < m else 0), b)
            if best is None or option[:2] < best[:2]:
                best = option
        cost.append(best[0])
        calls.append(best[1])
        first.append(best[2])
    plan, m = [], n
    while m > 0:
        plan.append(first[m])
        m -= first[m]
    return tuple(sorted(plan, reverse=True))


def prompt_chunk_buckets(max_prompt_length: int) -> tuple:
    """Prefill buckets 8, 32, 128, ... up to the first that holds ``max_prompt_length``: with
    :func:`plan_chunks` every prompt is padded by fewer than 8 positions, from few compiled
    chunk programs (35 tokens: 32 + 8)."""
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
    out = [8]
    while out[-1] < max_prompt_length:
        out.append(out[-1] * 4)
    return tuple(out)


def default_buckets(max_tokens: int, *, min_bucket: int = 8) -> list[int]:
    """Powers of two from ``min_bucket`` up to (and including) ``max_tokens``."""
    out, b = [], min_bucket
    while b < max_tokens:
        out.append(b)
        b *= 2
    out.append(max_tokens)
    return validate_buckets(out)


@dataclasses.dataclass(frozen=True)
class SPSProfile:
    """Measured steps/second of the verification forward for each compiled token bucket.

    Attributes:
      buckets: sorted token buckets.
      steps_per_s: float, one per bucket.
      key: what was measured (device and model), used to reuse a saved profile.
    """

    buckets: tuple[int, ...]
    steps_per_s: tuple[float, ...]
    key: str = ""
    draft_s: float = 0.0  # seconds of one drafting step (all slots); 0 = free / not measured
    plain_s: float = 0.0  # seconds of one plain decode step (all slots); 0 = not measured

    def __post_init__(self):
        if len(self.buckets) != len(self.steps_per_s):
            raise ValueError("one SPS value per bucket is required")
        for name in ("draft_s", "plain_s"):
            v = getattr(self, name)
            if not (v >= 0 and np.isfinite(v)):
                raise ValueError(f"{name} must be a finite number ≥ 0, got {v}")
        if list(self.buckets) != validate_buckets(self.buckets):
            raise ValueError(f"buckets must be sorted and distinct, got {self.buckets}")
        if any(not s > 0 for s in self.steps_per_s):
            raise ValueError(f"steps_per_s must be positive, got {self.steps_per_s}")

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def table(self) -> np.ndarray:
        """``float [max_tokens + 1]``: SPS(B) as a step function (B runs in the smallest bucket
        ≥ B); entry 0 (an empty batch) copies the smallest bucket's value."""
        table = np.empty(self.max_tokens + 1, np.float64)
        lo = 0
        for b, s in zip(self.buckets, self.steps_per_s):
            table[lo:b + 1] = s
            lo = b + 1
        return table

    def table_with_draft(self) -> np.ndarray:
        """``float [max_tokens + 1]``: steps/second of a step that drafts *and* verifies B tokens,
        ``1 / (1 / SPS(B) + draft_s)``."""
        return 1.0 / (1.0 / self.table() + self.draft_s)

    def to_dict(self) -> dict:
        """The JSON form :meth:`save` writes and :meth:`load` reads."""
        return {"key": self.key, "buckets": list(self.buckets),
                "steps_per_s": list(self.steps_per_s), "draft_s": self.draft_s,
                "plain_s": self.plain_s}

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> "SPSProfile":
        """The inverse of :meth:`to_dict` (``key``, ``draft_s``, ``plain_s`` optional)."""
        return cls(tuple(d["buckets"]), tuple(d["steps_per_s"]), d.get("key", ""),
                   float(d.get("draft_s", 0.0)), float(d.get("plain_s", 0.0)))

    @classmethod
    def load(cls, path: str) -> "SPSProfile":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @property
    def plain_sps(self) -> float:
        """Steps/second of a plain decode step (0 when not measured)."""
        return 1.0 / self.plain_s if self.plain_s > 0 else 0.0


def profile_sps(run_bucket: Callable[[int], None], buckets: Sequence[int], *, key: str = "",
                reps: int = 5, warmup: int = 1, cache_path: Optional[str] = None,
                clock: Callable[[], float] = time.perf_counter,
                run_draft: Optional[Callable[[], None]] = None) -> SPSProfile:
    """Measures SPS for each bucket, or loads it from ``cache_path`` when saved with the same key.

    Args:
      run_bucket: runs one verification step of the given bucket size and blocks until done.
      run_draft: optional: runs one drafting step and blocks; its median time is ``draft_s``.
      buckets: token buckets.
      key: identifies device and model; a saved profile with another key is re-measured.
      reps: timed repetitions per bucket (the median is used).
      cache_path: optional JSON file to reuse/save the profile.
    """
    buckets = validate_buckets(buckets)
    if cache_path and os.path.exists(cache_path):
        saved = SPSProfile.load(cache_path)
        if saved.key == key and list(saved.buckets) == buckets:
            return saved

    def median_seconds(run: Callable[[], None]) -> float:
        for _ in range(warmup):
            run()
        times = []
        for _ in range(reps):
            t0 = clock()
            run()
            times.append(clock() - t0)
        return statistics.median(times)

    sps = [1.0 / max(median_seconds(lambda: run_bucket(b)), 1e-12) for b in buckets]
    draft_s = 0.0 if run_draft is None else max(median_seconds(run_draft), 0.0)
    profile = SPSProfile(tuple(buckets), tuple(sps), key, draft_s)
    if cache_path:
        profile.save(cache_path)
    return profile


# --------------------------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------------------------


def prefix_survival(confidences: np.ndarray) -> np.ndarray:
    """``a[r, j] = Π_{i≤j} c[r, i]``: probability that drafts 1..j of request r are all accepted."""
    c = np.asarray(confidences, np.float64)
    if c.ndim != 2:
        raise ValueError(f"confidences must be [R, γ], got shape {c.shape}")
    if not ((c >= 0) & (c <= 1)).all():  # one pass; NaN and ±inf fail it too
        raise ValueError("confidences must be finite probabilities in [0, 1]")
    return np.cumprod(c, axis=1)


def _greedy_order(a: np.ndarray, max_len: Optional[np.ndarray] = None) -> tuple[np.ndarray, ...]:
    """Candidates (r, j) with a > 0 sorted by a descending, ties by smaller j then smaller r.

    ``max_len[r]`` (optional) caps how many drafts request r may verify. Returns (rows, js, a).
    """
    r_idx, j_idx = np.nonzero(a > 0)
    if max_len is not None:
        keep = j_idx < np.asarray(max_len)[r_idx]
        r_idx, j_idx = r_idx[keep], j_idx[keep]
    vals = a[r_idx, j_idx]
    order = np.lexsort((r_idx, j_idx, -vals))
    return r_idx[order], j_idx[order], vals[order]


def _lengths_from_admitted(num_rows: int, rows: np.ndarray, js: np.ndarray) -> np.ndarray:
    lengths = np.zeros(num_rows, np.int64)
    np.maximum.at(lengths, rows, js + 1)
    return lengths


def prefix_schedule(confidences, sps_table, *, early_stop: bool = True,
                    max_len: Optional[np.ndarray] = None) -> np.ndarray:
    """DSpark Algorithm 1: verification lengths maximising ``Θ = τ · SPS(B)``.

    Args:
      confidences: float ``[R, γ]``, ``c[r, k] = P(draft k accepted | prefix accepted)``.
      sps_table: float ``[B_max + 1]``, steps/second for a verification batch of B tokens.
        ``B = Σ_r (1 + ℓ_r)`` never exceeds ``B_max``.
      early_stop: True is Algorithm 1 (lossless). False is the retrospective global search over
        the whole greedy path (biased; for tests only).
      max_len: optional int ``[R]`` per-request caps on ℓ (e.g. remaining tokens to generate).
    Returns:
      int ``[R]`` lengths ℓ_r.
    """
    a = prefix_survival(confidences)
    sps = np.asarray(sps_table, np.float64)
    num_rows = a.shape[0]
    b_max = sps.shape[0] - 1
    if num_rows > b_max:
        raise ValueError(f"{num_rows} requests do not fit the largest bucket ({b_max} tokens)")
    rows, js, vals = _greedy_order(a, max_len)
    n_free = min(len(vals), b_max - num_rows)
    tau = num_rows + np.cumsum(vals[:n_free])  # τ after admitting 1..n_free candidates
    theta = tau * sps[num_rows + 1:num_rows + 1 + n_free]
    theta0 = num_rows * sps[num_rows]
    if early_stop:
        # Admit while each admission strictly raises Θ over the best so far; stop at the first
        # one that does not. Along a path where each step raises Θ, "best so far" is the previous.
        prev = np.concatenate([[theta0], theta[:-1]])
        fails = np.nonzero(~(theta > prev))[0]
        n = int(fails[0]) if fails.size else n_free
    else:
        best = int(np.argmax(theta)) if n_free else -1
        n = best + 1 if n_free and theta[best] > theta0 else 0
    return _lengths_from_admitted(num_rows, rows[:n], js[:n])


def expected_throughput(confidences, lengths, sps_table) -> float:
    """``Θ = τ · SPS(B)`` of given lengths (τ = Σ_r 1 + Σ_{j≤ℓ_r} a_{r,j})."""
    a = prefix_survival(confidences)
    lengths = np.asarray(lengths)
    mask = np.arange(a.shape[1])[None, :] < lengths[:, None]
    tau = a.shape[0] + float(np.sum(a * mask))
    return tau * float(np.asarray(sps_table)[a.shape[0] + int(lengths.sum())])


def budget_search(confidences, sps_table, max_len: Optional[np.ndarray] = None,
                  sps_table_draft=None, plain_sps: float = 0.0) -> int:
    """Number of draft tokens to verify: full (no early stop) search of Θ along the greedy path.

    Used with *stale* confidences (two steps old) by :func:`production_schedule`; searching the
    whole path steps over the cliffs of a jagged SPS curve.

    Args:
      sps_table_draft: optional float ``[B_max + 1]``: SPS of a step that also drafts
        (:meth:`SPSProfile.table_with_draft`). When given, a budget > 0 is scored with it and
        budget 0 with ``sps_table``: the budget is fixed before drafting, so budget 0 means the
        step does not draft at all and does not pay for it.
      plain_sps: optional steps/second of the plain decode step a non-drafting step runs instead
        of a verification (the device loop's production policy; :attr:`SPSProfile.plain_s`).
        When > 0, budget 0 is scored ``R · plain_sps``; otherwise ``R · SPS(R)``.
    """
    a = prefix_survival(confidences)
    sps = np.asarray(sps_table, np.float64)
    sps_d = sps if sps_table_draft is None else np.asarray(sps_table_draft, np.float64)
    if sps_d.shape != sps.shape:
        raise ValueError(f"sps_table_draft shape {sps_d.shape} != sps_table shape {sps.shape}")
    num_rows, b_max = a.shape[0], sps.shape[0] - 1
    if num_rows > b_max:
        raise ValueError(f"{num_rows} requests do not fit the largest bucket ({b_max} tokens)")
    _, _, vals = _greedy_order(a, max_len)
    n_free = min(len(vals), b_max - num_rows)
    if n_free == 0:
        return 0
    tau = num_rows + np.cumsum(vals[:n_free])
    theta = tau * sps_d[num_rows + 1:num_rows + 1 + n_free]
    best = int(np.argmax(theta))
    theta0 = num_rows * (plain_sps if plain_sps > 0 else sps[num_rows])
    return best + 1 if theta[best] > theta0 else 0


def top_budget_admission(confidences, budget: int,
                         max_len: Optional[np.ndarray] = None) -> np.ndarray:
    """Admits the ``budget`` candidates with the highest live survival ``a`` (rank-preserving).

    Whether draft k of request r is admitted depends on how many candidates rank above it, all of
    which have ``a ≥ a_{r,k}`` and none of which depends on x_{r,k}; so this is non-anticipating
    for any budget fixed before the current drafts were drawn.
    """
    if budget < 0:
        raise ValueError(f"budget must be ≥ 0, got {budget}")
    a = prefix_survival(confidences)
    rows, js, _ = _greedy_order(a, max_len)
    n = min(int(budget), len(rows))
    return _lengths_from_admitted(a.shape[0], rows[:n], js[:n])


def production_schedule(live_confidences, stale_confidences, sps_table,
                        max_len: Optional[np.ndarray] = None, sps_table_draft=None,
                        plain_sps: float = 0.0) -> np.ndarray:
    """DSpark §5.2: budget from stale confidences (full search), top-budget live admission.

    Args:
      live_confidences: float ``[R, γ]`` of the drafts being verified now.
      stale_confidences: float ``[R, γ]`` from two steps earlier (rows aligned with the live
        ones; use the live request's own older confidences, or a neutral prior for new requests).
      sps_table: float ``[B_max + 1]``.
    Returns:
      int ``[R]`` lengths; ``Σ ℓ`` never exceeds the budget, ``R + Σ ℓ ≤ B_max``.
    """
    budget = budget_search(stale_confidences, sps_table, max_len, sps_table_draft, plain_sps)
    return top_budget_admission(live_confidences, budget, max_len)


def no_speculation(num_rows: int, gamma: int = 0) -> np.ndarray:
    return np.zeros(num_rows, np.int64)


def fixed_k(num_rows: int, k: int, max_len: Optional[np.ndarray] = None) -> np.ndarray:
    """ℓ = k for every request (capped by ``max_len``)."""
    lengths = np.full(num_rows, k, np.int64)
    return lengths if max_len is None else np.minimum(lengths, max_len)


def threshold_schedule(confidences, threshold: float,
                       max_len: Optional[np.ndarray] = None) -> np.ndarray:
    """Longest prefix with survival ``a_{r,j} ≥ threshold`` (a static confidence threshold)."""
    a = prefix_survival(confidences)
    lengths = np.sum(a >= threshold, axis=1).astype(np.int64)  # a is non-increasing in j
    return lengths if max_len is None else np.minimum(lengths, max_len)


# "retrospective" is Algorithm 1 without the early stop: biased (Appendix A), for tests only.
POLICIES = ("none", "fixed", "mtp1", "threshold", "dspark", "production", "retrospective")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Which policy the engine uses and its parameters.

    policy: one of POLICIES. k: draft length for "fixed". threshold: for "threshold".
    explore_every: "production" only: when its budget search says not to draft, still draft at
      least once every this many steps (budget searched without the drafting cost), so that the
      stale confidences the search runs on stay fresh and it can turn drafting back on when the
      load falls. A fixed step count: it never looks at a draft. 0 disables.
    """

    policy: str = "dspark"
    k: int = 4
    threshold: float = 0.5
    explore_every: int = 16

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"SchedulerConfig.policy must be one of {POLICIES}, "
                             f"got {self.policy!r}")
        if self.k < 0:
            raise ValueError(f"SchedulerConfig.k must be ≥ 0, got {self.k}")
        if not 0 <= self.threshold <= 1:
            raise ValueError(f"SchedulerConfig.threshold must be in [0, 1], got {self.threshold}")
        if self.explore_every < 0:
            raise ValueError(f"SchedulerConfig.explore_every must be ≥ 0, "
                             f"got {self.explore_every}")


def schedule(config: SchedulerConfig, confidences: np.ndarray, sps_table: np.ndarray, *,
             stale_confidences: Optional[np.ndarray] = None,
             max_len: Optional[np.ndarray] = None, sps_table_draft=None) -> np.ndarray:
    """Dispatches to the configured policy. Returns int ``[R]`` lengths (≤ γ, ≤ max_len)."""
    confidences = np.asarray(confidences, np.float64)
    num_rows, gamma = confidences.shape
    cap = np.full(num_rows, gamma) if max_len is None else np.minimum(max_len, gamma)
    if config.policy == "none":
        return no_speculation(num_rows)
    if config.policy == "fixed":
        return fixed_k(num_rows, min(config.k, gamma), cap)
    if config.policy == "mtp1":
        return fixed_k(num_rows, min(1, gamma), cap)
    if config.policy == "threshold":
        return threshold_schedule(confidences, config.threshold, cap)
    if config.policy == "dspark":
        return prefix_schedule(confidences, sps_table, early_stop=True, max_len=cap)
    if config.policy == "retrospective":
        return prefix_schedule(confidences, sps_table, early_stop=False, max_len=cap)
    stale = confidences if stale_confidences is None else stale_confidences
    return production_schedule(confidences, stale, sps_table, max_len=cap,
                               sps_table_draft=sps_table_draft)
