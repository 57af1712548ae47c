"""Timing several decoders against each other in one run.

Each decoder is called once untimed (compilation; that call's output is what the benchmark
reports), then ``reps`` rounds time every decoder once, the order rotating by one each round, so
that a drift in the machine's speed falls on all of them alike; each figure is a median.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional


def alternating_runs(calls: dict[str, Callable[[], object]], reps: int) -> tuple[dict, dict]:
    """``({name: output of the untimed call}, {name: [seconds of each timed call]})``."""
    names = list(calls)
    outs = {n: calls[n]() for n in names}
    times: dict[str, list] = {n: [] for n in names}
    for r in range(reps):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            calls[n]()
            times[n].append(time.perf_counter() - t0)
    return outs, times


def decoder_figures(tokens: list, runs_s: list, steps: Optional[int] = None) -> dict:
    """``wall_s`` (median), ``runs_s``, ``tokens`` (emitted, summed over the requests) and
    ``tokens_per_s`` of one decoder in one cell; with ``steps`` (the requests' verification
    steps, summed) also ``steps`` and ``tau``: tokens per step, each request's first token (from
    its prefill) left out."""
    count = sum(map(len, tokens))
    wall = statistics.median(runs_s)
    fig = {"wall_s": wall, "runs_s": list(runs_s), "tokens": count, "tokens_per_s": count / wall}
    if steps is not None:
        fig.update(steps=steps, tau=(count - len(tokens)) / max(1, steps))
    return fig
