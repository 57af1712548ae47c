"""The MTP drafter's draft step, as it is against as it was, on the same weights in the same run.

Each MTP ``propose`` rewrites the last W positions of every chain depth's cache and runs each
depth's block there. Two cuts made the step cheaper without changing a draft:

* the window: W was ``γ + K = 2γ`` until it was derived as the smallest window that keeps every
  draft exact, ``max(K + 1, γ)`` (``γ + 1`` at the default K = γ; ``specjax/drafters/mtp.py``,
  ``tests/test_drafters.py``);
* the last depth: only its output at the query position is read, so of the other positions it
  computes the cache entries alone (``MTPDrafter.last_depth_queries``).

This times the speculative engine (fixed K = γ, device loop) with three drafters of the same
weights: ``speculative`` (both cuts), ``speculative_window_only`` (the window cut, the last depth
at every position) and ``speculative_earlier`` (neither: the draft step as it was), against the
fastest plain decoder (the faster of ``generate(loop="device")`` and the engine's policy "none"),
one request at a time (B = 1) on held-out prompts per domain and temperature, as the quickstart's
step 4 does. The decoders' timed runs alternate (the order rotates every round), so that a drift
in the machine's speed falls on all of them alike; each figure is the median of ``--reps`` runs
after a warm-up. The three drafters draft the same q up to float rounding, so they should emit
the same tokens: the JSON says whether they did. The pieces of a step are also timed alone, each
inside a jitted loop at ``flops_context`` cached positions and T = 1 (``step_costs``: the draft
step of each drafter, a full verification and a plain decode step, as
``benchmarks/spec_vs_plain.py`` times them).

Run:
    python -m benchmarks.mtp_window --target <quickstart dir>/target-<key> \\
        --drafter <quickstart dir>/mtp_e2e_tv_ws-<key>
    python -m benchmarks.mtp_window --quick      # random tiny target, fresh MTP head (smoke run)
Writes ``--out`` (JSON, default ``benchmarks/results/mtp_window.json``; ``--quick``: a file in
the temp directory) and prints one line per cell.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import tempfile
from typing import ClassVar, Optional

from benchmarks.timing import alternating_runs, decoder_figures
from specjax.drafters import MTPDrafter
from specjax.machine import cpu_model
from specjax.paths import dump_json, portable_values


@dataclasses.dataclass(frozen=True)
class WindowOnlyMTP(MTPDrafter):
    """The MTP drafter with its last depth's block run at every window position."""

    last_depth_queries: ClassVar[Optional[int]] = None


@dataclasses.dataclass(frozen=True)
class EarlierMTP(WindowOnlyMTP):
    """The MTP draft step as it was: a window of ``γ + K`` positions, the last depth's block at
    every one of them."""

    @staticmethod
    def window(gamma: int, max_verify: Optional[int] = None) -> int:
        return gamma + (gamma if max_verify is None else max_verify)


# engine name -> drafter class
VARIANTS = {"speculative": MTPDrafter, "speculative_window_only": WindowOnlyMTP,
            "speculative_earlier": EarlierMTP}


def add_model_args(p: argparse.ArgumentParser, kind: str = "mtp") -> None:
    """The flags :func:`load_models` reads besides the prompts': the quickstart's target and a
    drafter workdir (``kind``: as :func:`load_models`), or ``--quick``, and the draft length."""
    p.add_argument("--target", help="target workdir (the quickstart's target-<key>)")
    p.add_argument("--drafter", help={
        "mtp": "MTP head workdir (the quickstart's mtp_e2e_tv_ws-<key>)",
        "dspark": "DSpark drafter workdir (train_drafter.py:dspark_markov on that target)"}[kind])
    fresh = "MTP head" if kind == "mtp" else "DSpark drafter"
    p.add_argument("--quick", action="store_true", help=f"random tiny target, fresh {fresh}")
    p.add_argument("--gamma", type=int, default=None, help="draft length (default: trained γ)")


def check_model_args(p: argparse.ArgumentParser, args) -> None:
    """Exits with a usage error unless both workdirs or ``--quick`` were given."""
    if not args.quick and not (args.target and args.drafter):
        p.error("give --target and --drafter (workdirs), or --quick")


def load_models(args, kind: str = "mtp"):
    """``(target (graphdef, state), drafter, params, frozen, gamma, prompts per domain)``.

    ``kind``: "mtp" (``--drafter`` must hold an MTP head; ``--quick`` makes one) or "dspark"
    (``--drafter`` a DSpark drafter with its confidence head; ``--quick`` makes one)."""
    import numpy as np

    from specjax.drafters import DSparkDrafter
    need = {"mtp": MTPDrafter, "dspark": DSparkDrafter}[kind]
    if args.quick:
        from flax import nnx

        from specjax.drafters import DSparkConfig, MTPConfig, shared_head
        from specjax.models import get_preset, init_model
        config = get_preset("tiny")
        target = nnx.split(init_model(config, seed=0))
        if kind == "mtp":
            drafter, params = MTPDrafter.create(config, MTPConfig(shared=True), seed=0)
        else:
            drafter, params = DSparkDrafter.create(config, DSparkConfig(), seed=0)
        rng = np.random.default_rng(0)
        prompts = {d: [rng.integers(1, config.vocab_size, size=args.prompt_len).tolist()
                       for _ in range(args.prompts)] for d in args.domains}
        return target, drafter, params, shared_head(target), args.gamma or 3, prompts
    from experiments.offline_eval import load_trained
    from experiments.quickstart import heldout_prompts
    from experiments.reproduce_steps import load_target_run
    _, target, tok = load_target_run(args.target)
    drafter, params, frozen, trained_gamma = load_trained(args.drafter, target[1])
    if not isinstance(drafter, need):
        raise SystemExit(f"{args.drafter} holds a {type(drafter).__name__}, not a "
                         f"{need.__name__}")
    prompts = {d: heldout_prompts(tok, d, args.prompts, args.prompt_len) for d in args.domains}
    return target, drafter, params, frozen, args.gamma or trained_gamma, prompts


def run(args) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from benchmarks.spec_vs_plain import _step_costs
    from experiments.quickstart import b1_engine, b1_max_len
    from specjax.engine import Request
    from specjax.models.generate import generate_timed
    target, drafter, params, frozen, gamma, prompts = load_models(args)
    drafters = {n: cls(drafter.config, drafter.target_config, drafter.graphdef)
                for n, cls in VARIANTS.items()}
    model = nnx.merge(*target)
    max_len = b1_max_len(args.prompt_len, args.new_tokens, gamma)

    def engine(d, policy: str, g: int):
        return b1_engine(target, d, params, frozen, max_len=max_len, policy=policy, gamma=g)

    engines = {"engine_none": engine(drafter, "none", 1),
               **{n: engine(d, "fixed", gamma) for n, d in drafters.items()}}
    cells = []
    for domain in args.domains:
        for temp in args.temperatures:
            ps = prompts[domain]

            def plain():
                return [generate_timed(model, [p], args.new_tokens, temperature=temp,
                                       max_len=max_len, loop="device", seed=i).tokens[0]
                        for i, p in enumerate(ps)], None

            def served(eng):
                def call():
                    res = eng.generate([Request(prompt=p, max_new_tokens=args.new_tokens,
                                                temperature=temp, seed=i)
                                        for i, p in enumerate(ps)])
                    return [list(r.tokens) for r in res], sum(r.steps for r in res)
                return call

            calls = {"generate": plain, **{n: served(e) for n, e in engines.items()}}
            names = list(calls)
            outs, times = alternating_runs(calls, args.reps)  # outs: the emitted tokens
            dec = {}
            for n in names:
                toks, steps = outs[n]
                dec[n] = decoder_figures(toks, times[n], steps if n in VARIANTS else None)
            base = max(("generate", "engine_none"), key=lambda n: dec[n]["tokens_per_s"])
            rate = {n: dec[n]["tokens_per_s"] for n in names}
            cell = {"domain": domain, "temperature": temp, "decoders": dec, "baseline": base,
                    "same_tokens": all(outs[n][0] == outs["speculative"][0] for n in VARIANTS),
                    # tokens/s ratios, each pair from this run
                    "over_earlier": rate["speculative"] / rate["speculative_earlier"],
                    "window_over_earlier": (rate["speculative_window_only"] /
                                            rate["speculative_earlier"]),
                    "last_depth_over_window": (rate["speculative"] /
                                               rate["speculative_window_only"]),
                    "speedup": {n: rate[n] / rate[base] for n in VARIANTS}}
            cells.append(cell)
            print(f"  {domain:>5} T={temp:g}: plain {rate[base]:6.0f} tokens/s ({base}); "
                  + ", ".join(f"{n} {rate[n]:6.0f}" for n in VARIANTS)
                  + f" (τ {dec['speculative']['tau']:.2f}); now / earlier "
                  f"{cell['over_earlier']:.3f}x (window {cell['window_over_earlier']:.3f}x, "
                  f"then last depth {cell['last_depth_over_window']:.3f}x); speed-up "
                  f"{cell['speedup']['speculative']:.2f}x (earlier "
                  f"{cell['speedup']['speculative_earlier']:.2f}x)", flush=True)
    ctx = args.prompt_len + args.new_tokens // 2
    # each piece alone, in a device loop at the mid-generation context (T = 1)
    costs = {n: _step_costs(engines[n], args.reps, ctx, 1.0) for n in VARIANTS}
    print("  step costs (ms): " + ", ".join(f"{n} draft {c['draft_s'] * 1e3:.3f}"
                                           for n, c in costs.items())
          + f"; verify {costs['speculative']['verify_s'] * 1e3:.3f}, plain "
          f"{costs['speculative']['plain_s'] * 1e3:.3f}", flush=True)
    return {"machine": {"cpu": cpu_model() or platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "backend": jax.default_backend(),
                        "device_kind": jax.devices()[0].device_kind},
            "config": portable_values({k: v for k, v in vars(args).items() if k != "out"}),
            "gamma": int(gamma), "max_len": max_len,
            # per drafter: its window and the model FLOPs of one row's draft step at
            # mid-generation (flops_context cached positions)
            "flops_context": ctx,
            "drafters": {n: {"window": d.window(gamma),
                             "propose_flops": d.propose_flops(ctx, gamma)}
                         for n, d in drafters.items()},
            "step_costs": costs,
            "cells": cells,
            "over_earlier_median": float(np.median([c["over_earlier"] for c in cells]))}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--domains", nargs="+", default=["math", "code"])
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    p.add_argument("--prompts", type=int, default=2, help="held-out prompts per domain")
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=7, help="timed runs per decoder and cell")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    check_model_args(p, args)
    if args.reps < 1 or args.prompts < 1 or args.new_tokens < 1:
        p.error("--reps, --prompts and --new_tokens must be >= 1")
    if args.quick:
        args.prompts, args.new_tokens, args.reps = 1, 16, 2
        args.domains, args.temperatures = ["random"], [0.0]
    out = args.out or (
        os.path.join(tempfile.gettempdir(), "specjax_quick", "mtp_window.json") if args.quick
        else os.path.join("benchmarks", "results", "mtp_window.json"))
    result = run(args)
    dump_json(out, result)
    print(f"median tokens/s now / earlier: {result['over_earlier_median']:.3f}x -> {out}")
    return result


if __name__ == "__main__":
    main()
