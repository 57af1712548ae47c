"""Acceptance statistics of a batch of speculative rollouts, from the engine's public results.

α_k = P(draft k accepted | drafts 1..k-1 accepted) per draft position k, and τ = tokens emitted per
verification step (accepted drafts + the corrected / bonus token). Per-position acceptance needs
to know how many drafts each step verified; that is known only under a fixed draft length
without pre-dispatched drafts (scheduler "fixed", ``overlap=False``): there a request's step
verifies ``ℓ = min(k, max_new_tokens - generated - 1)`` drafts. Tokens emitted by one step share
one emission time stamp (``Result.token_times``), which splits a request's tokens into steps.

A step that emits a stop token is counted only for its accepted prefix: its last token may be an
accepted draft or the correction, and the engine does not say which.
"""
from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

__all__ = ["step_groups", "position_acceptance"]


def step_groups(token_times: Sequence[float]) -> list[int]:
    """Sizes of the runs of equal time stamps: tokens emitted per engine event (prefill first)."""
    return [len(list(g)) for _, g in itertools.groupby(token_times)]


def position_acceptance(results, max_new_tokens: Sequence[int], stop_tokens: Sequence[int],
                        k: int) -> tuple[np.ndarray, np.ndarray]:
    """Accepted and tried counts per draft position (fixed draft length ``k``, no overlap).

    Args:
      results: engine ``Result`` objects (``tokens``, ``token_times``).
      max_new_tokens: each request's limit.
      stop_tokens: ids that end generation.
      k: the fixed draft length.
    Returns:
      ``(accepted [k], tried [k])`` int arrays; ``accepted / tried`` estimates α per position.
    """
    acc = np.zeros(k, np.int64)
    tried = np.zeros(k, np.int64)
    stops = set(int(t) for t in stop_tokens)
    for res, limit in zip(results, max_new_tokens):
        sizes = step_groups(res.token_times)
        if sum(sizes) != len(res.tokens):
            raise ValueError("token_times and tokens differ in length")
        generated = sizes[0]  # the prefill emits the first token
        pos = sizes[0]
        for e in sizes[1:]:
            ell = min(k, limit - generated - 1)
            stopped = int(res.tokens[pos + e - 1]) in stops
            a = e - 1
            if a > ell:
                raise ValueError(f"a step emitted {e} tokens with {ell} drafts: the engine did not "
                                 f"use a fixed draft length {k} without overlap")
            acc[:a] += 1
            tried[:a] += 1
            if not stopped and a < ell:
                tried[a] += 1  # draft a+1 was verified and rejected
            generated += e
            pos += e
    return acc, tried
