"""Requests, results and engine configuration: the host-side vocabulary of the engine.

A :class:`Request` is submitted, queued, admitted into one of S slots, decoded, and finishes as a
:class:`Result`. :class:`EngineConfig` fixes the engine's static shapes and policy.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Optional, Sequence, Union

from specjax.buckets import default_buckets, validate_buckets
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


def parse_row_buckets(value) -> Union[tuple, str]:
    """``EngineConfig.row_buckets`` from a flag or config value: ``"auto"``; ``"none"``, ``""``
    or ``None`` -> ``()``; ``"1,2,4"`` or a sequence -> a tuple of ints. Raises ``ValueError``."""
    if value is None or (isinstance(value, str) and value.strip() in ("none", "")):
        return ()
    if isinstance(value, str) and value.strip() == "auto":
        return "auto"
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        return tuple(int(v) for v in items if str(v).strip())
    except ValueError:
        raise ValueError(f"row buckets must be 'auto', 'none' or comma-separated row counts, "
                         f"got {value!r}") from None


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine shape and policy.

    num_slots: S requests decoded at once. max_len: cache positions per slot (prompt + new tokens
    + γ + 1 must fit). gamma: drafts per step. token_buckets: compiled verification batch sizes
    (default: powers of two from 8 to S·(γ+1)); the largest must hold S·(γ+1).
    prefill_buckets: compiled prompt chunk sizes. The slots admitted together are fed in chunks
    planned by :func:`specjax.buckets.plan_chunks` for the longest of their prompts: the
    fewest padded positions, e.g. buckets (8, 32, 128) feed 35 tokens as 32 + 8, not as 128.
    prefill_call_cost: the fixed price of one prefill call in that plan, in positions (0: only
    padding counts, right where a call's time follows its bucket, as on a CPU; raise it where a
    small call is bound by reading the weights).
    method: "rejection" or "target_only". scheduler: the verification-length policy.
    overlap: pre-dispatch the next draft while the host processes the current step.
    sps_cache: JSON path for the SPS profile (reused when device and model match); with row
    buckets each row count's profile is kept beside it (``sps.json`` -> ``sps.rows4.json``).
    profile_reps: timed repetitions per bucket when profiling. seed: drafting randomness.
    profile_context: cached positions per slot at which the device loop's profile times its steps
    (attention follows the context); default ``max_len // 4``.
    filters: compile top-k / top-p support (a sort over V per position); False serves
    temperature-only requests faster and rejects requests that set top_k / top_p.
    loop: "device" runs up to ``loop_steps`` steps per call inside one jitted ``lax.while_loop``
    (:mod:`specjax.engine.device_loop`; the host only admits, streams and finishes); "host"
    dispatches one step at a time from Python (with ``overlap``; interactive serving with
    per-step stats).
    loop_steps: device loop: steps per call before the host streams the tokens out.
    verify_impl: rejection sampler: "auto" (the Pallas kernel on TPU / GPU, jnp on CPU), "jnp"
    or "pallas" (:func:`specjax.verify.resolve_impl`).
    online_calibration: the confidence policies (threshold, dspark, production, retrospective)
    read the drafter's confidences calibrated on the verifier's past decisions
    (:mod:`specjax.engine.online_calibration`); device loop only.
    row_buckets: device loop only: compiled row counts below ``num_slots`` (``"auto"``: the
    powers of two below it; ``()``: none). A call with ``a`` active slots runs the smallest row
    count ``>= a`` instead of every slot (:mod:`specjax.engine.loop_rows`): on a lightly loaded
    engine, idle slots stop costing drafting, attention and cache reads, at the price of one
    more compiled loop per row count at warm-up; the dspark, retrospective and production
    policies also time an SPS profile per row count there (``Engine.sps_rows``).
    """

    num_slots: int = 8
    max_len: int = 512
    gamma: int = 4
    token_buckets: Optional[tuple] = None
    prefill_buckets: tuple = (16, 64, 256)
    prefill_call_cost: float = 0.0
    method: str = "rejection"
    scheduler: SchedulerConfig = SchedulerConfig()
    overlap: bool = True
    sps_cache: Optional[str] = None
    profile_reps: int = 5
    profile_context: Optional[int] = None
    seed: int = 0
    filters: bool = True
    loop: str = "device"
    loop_steps: int = 16
    verify_impl: str = "auto"
    online_calibration: bool = False
    row_buckets: Union[tuple, str] = ()

    def __post_init__(self):
        if self.loop not in ("device", "host"):
            raise ValueError(f"EngineConfig.loop must be 'device' or 'host', got {self.loop!r}")
        if self.verify_impl not in ("auto", "jnp", "pallas"):
            raise ValueError(f"EngineConfig.verify_impl must be 'auto', 'jnp' or 'pallas', "
                             f"got {self.verify_impl!r}")
        if self.online_calibration and self.loop != "device":
            raise ValueError("EngineConfig.online_calibration runs in the device loop only "
                             "(loop='device')")
        if self.online_calibration and self.scheduler.policy not in CONFIDENCE_POLICIES:
            raise ValueError(f"EngineConfig.online_calibration calibrates confidences, which "
                             f"policy {self.scheduler.policy!r} does not read; use one of "
                             f"{CONFIDENCE_POLICIES}")
        if self.loop_steps < 1:
            raise ValueError(f"EngineConfig.loop_steps must be ≥ 1, got {self.loop_steps}")
        if self.num_slots < 1:
            raise ValueError(f"EngineConfig.num_slots must be ≥ 1, got {self.num_slots}")
        if isinstance(self.row_buckets, str) and self.row_buckets != "auto":
            raise ValueError(f"EngineConfig.row_buckets must be 'auto' or a tuple of row counts, "
                             f"got {self.row_buckets!r}")
        bad = [r for r in self.loop_row_buckets if not 1 <= r < self.num_slots]
        if bad:
            raise ValueError(f"EngineConfig.row_buckets must lie in [1, num_slots) = "
                             f"[1, {self.num_slots}), got {bad}")
        if self.loop_row_buckets and self.loop != "device":
            raise ValueError("EngineConfig.row_buckets runs in the device loop only "
                             "(loop='device')")
        if self.gamma < 1:
            raise ValueError(f"EngineConfig.gamma must be ≥ 1, got {self.gamma}")
        if self.method not in ("rejection", "target_only"):
            raise ValueError(f"EngineConfig.method must be 'rejection' or 'target_only', "
                             f"got {self.method!r}")
        if self.max_len < self.gamma + 2:
            raise ValueError(f"EngineConfig.max_len {self.max_len} too small for gamma {self.gamma}")
        if self.profile_context is not None and not (
                0 <= self.profile_context <= self.max_len - self.gamma - 1):
            raise ValueError(f"EngineConfig.profile_context must be in [0, max_len - gamma - 1] = "
                             f"[0, {self.max_len - self.gamma - 1}], got {self.profile_context}")
        validate_buckets(self.prefill_buckets)
        if self.prefill_call_cost < 0:
            raise ValueError(f"EngineConfig.prefill_call_cost must be >= 0, "
                             f"got {self.prefill_call_cost}")
        if self.token_buckets is not None:
            b = validate_buckets(self.token_buckets)
            if b[-1] < self.num_slots * (self.gamma + 1):
                raise ValueError(
                    f"EngineConfig.token_buckets: the largest bucket {b[-1]} must hold "
                    f"num_slots * (gamma + 1) = {self.num_slots * (self.gamma + 1)} tokens")

    @property
    def loop_row_buckets(self) -> tuple:
        """``row_buckets`` resolved: ascending distinct row counts (``"auto"``: powers of two
        below ``num_slots``)."""
        if self.row_buckets == "auto":
            return tuple(2 ** i for i in range(max(self.num_slots - 1, 0).bit_length()))
        return tuple(sorted({int(r) for r in self.row_buckets}))

    @property
    def buckets(self) -> list[int]:
        if self.token_buckets is not None:
            return validate_buckets(self.token_buckets)
        return default_buckets(self.num_slots * (self.gamma + 1),
                               min_bucket=min(8, self.num_slots))


@dataclasses.dataclass
class _Live:
    """Host bookkeeping of a request in a slot."""

    request: Request
    result: Result
    prompt_done: int = 0  # prompt tokens fed so far
    generated: int = 0
    verify_steps: int = 0
    # production (host loop): (host step, drafted confidences [γ]) of its latest drafting steps
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


@dataclasses.dataclass
class LoopStats:
    """One call of the device loop (``EngineConfig.loop = "device"``).

    steps: engine steps run on the device. draft_steps: how many of them drafted (production
    skips drafting at budget 0). tokens: tokens emitted. active: slots active at entry.
    drafted, accepted: int ``[γ]`` drafts verified / accepted per draft position, summed over
    slots and steps; ``accepted[k] / drafted[k]`` is the survival of drafts 1..k among verified
    positions. reached: int ``[γ]`` verified drafts whose earlier drafts were all accepted;
    ``accepted[k] / reached[k]`` is the conditional acceptance α_k. wall_s: host wall time of the call (dispatch to read-back).
    """

    steps: int
    draft_steps: int
    tokens: int
    active: int
    drafted: list
    accepted: list
    reached: list
    wall_s: float
