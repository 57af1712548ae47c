"""Compiled shape buckets and the throughput measured at each (numpy only, no JAX).

Every jitted engine program runs at a static shape, so a variable amount of work is padded up to
one of a few compiled sizes, its *bucket*:

* token buckets: a verification batch of B tokens (``B = Σ_r (1 + ℓ_r)``, see
  :mod:`specjax.scheduling`) runs in the smallest bucket ≥ B (:func:`pick_bucket`); the default
  set is powers of two up to the largest batch (:func:`default_buckets`);
* prefill (chunk) buckets: a prompt is fed in the chunks :func:`plan_chunks` plans, the fewest
  padded positions over the compiled chunk sizes (:func:`prompt_chunk_buckets` gives 8, 32,
  128, ...).

SPS(B) (steps per second of a verification forward of B tokens) is profiled once per compiled
token bucket at engine start (:func:`profile_sps`, kept as an :class:`SPSProfile`) and used as a
step function of B (:meth:`SPSProfile.table`), over which the prefix policies of
:mod:`specjax.scheduling` maximise ``Θ = τ · SPS(B)``.
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
                run_draft: Optional[Callable[[], None]] = None,
                run_plain: Optional[Callable[[], None]] = None) -> SPSProfile:
    """Measures SPS for each bucket, or loads it from ``cache_path`` when saved with the same key.

    Args:
      run_bucket: runs one verification step of the given bucket size and blocks until done.
      run_draft: optional: runs one drafting step and blocks; its median time is ``draft_s``.
      run_plain: optional: runs one plain decode step and blocks; its median time is
        ``plain_s``.
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
    plain_s = 0.0 if run_plain is None else max(median_seconds(run_plain), 1e-12)
    profile = SPSProfile(tuple(buckets), tuple(sps), key, draft_s, plain_s)
    if cache_path:
        profile.save(cache_path)
    return profile
