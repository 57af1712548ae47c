"""The production policy on a lightly loaded engine: SPS profiles per row bucket, or one for all.

With row buckets (``EngineConfig.row_buckets``) a device-loop call on ``C`` active slots runs the
program of the smallest row count ``R >= C``, and its steps cost less than the all-slot program's.
The confidence policies weigh a drafting step against a plain one by the steps per second of
each (the SPS profile), so warm-up times a profile on every row bucket's program
(``Engine.sps_rows``). This benchmark measures what that buys: one S-slot production engine with
row buckets serves C held-out math prompts (all submitted at once) with

* ``row_profiles``: each call reads the profile of its row bucket (what warm-up sets);
* ``slot_profile``: every call reads the all-slot profile (what the engine did before);
* ``row_profiles_cal``: per-row profiles, with the confidences calibrated online on the
  verifier's decisions (``EngineConfig.online_calibration``; the drafter's confidence head is
  used as trained, and a head that over-states acceptance makes production draft where it
  should not);

against, on the same weights in the same run,

* ``fixed``: the S-slot engine with row buckets drafting and verifying K = γ tokens every step;
* ``plain``: the fastest plain decoder at batch C, the faster of the S-slot engine with
  speculation off (row buckets on) and ``generate(loop="device")`` on the C prompts.

Timed runs alternate (the order rotates every round), median of ``--reps`` after a warm-up call.
The three production variants are engines of the same config (each keeps its own confidence
history); the second and third are given the first's profiles (``Engine.set_sps``), so all read
tables from the same measurement. At C = S every call
runs the all-slot program, so the two profile variants run the same thing (a null control). At
temperature 0 every variant must emit the same tokens: the JSON says whether they did. It also
holds both profiles' tables (plain and drafting steps per second), the share of steps that
drafted, τ, the calibration ratios the calibrated engine ended each cell with, and the time
warm-up spent on the profiles.

The drafter is a DSpark drafter (production reads its confidence head) trained on the
quickstart's target (``--config.task.target_workdir <quickstart dir>/target-<key>``).

Run:
    python -m experiments.train_drafter \\
        --config experiments/configs/train_drafter.py:dspark_markov \\
        --config.task.target_workdir <quickstart dir>/target-<key> --workdir runs/dspark_markov
    python -m benchmarks.row_profiles --target <quickstart dir>/target-<key> \\
        --drafter runs/dspark_markov
    python -m benchmarks.row_profiles --quick  # random tiny target, fresh DSpark drafter (smoke)
Writes ``--out`` (JSON, default ``benchmarks/results/row_profiles.json``; ``--quick``: a file in
the temp directory) and a PNG beside it, and prints one line per cell.
"""
from __future__ import annotations

import argparse
import os
import platform
import time

from benchmarks.row_buckets import (add_load_args, check_load_args, plot_loads, timed_engine,
                                    write_results)
from benchmarks.timing import alternating_runs, decoder_figures
from specjax.machine import cpu_model
from specjax.paths import portable_values

VARIANTS = ("row_profiles", "slot_profile", "row_profiles_cal", "fixed", "plain")


def _profile_figures(prof, gamma: int, rows: int) -> dict:
    """A profile's plain step and the drafting step whose verification holds every row's
    ``γ + 1`` tokens (steps per second), and its whole table."""
    table = prof.table_with_draft()
    tokens = min(rows * (gamma + 1), len(table) - 1)
    return {"plain_sps": prof.plain_sps, "draft_sps_full_rows": float(table[tokens]),
            "buckets": list(prof.buckets), "steps_per_s": list(prof.steps_per_s)}


def run(args) -> dict:
    import jax
    from flax import nnx

    from benchmarks.mtp_window import load_models
    from experiments.quickstart import b1_max_len
    from specjax.engine import Request
    from specjax.engine import warmup as warmup_mod
    from specjax.models.generate import generate_timed
    args.domains = ["math"]
    args.prompts = max(args.loads)
    target, drafter, params, frozen, gamma, prompts = load_models(args, "dspark")
    prompts = prompts["math"]
    model = nnx.merge(*target)
    max_len = b1_max_len(args.prompt_len, args.new_tokens, gamma)

    def engine(policy: str, profile: bool, calibrate: bool = False):
        return timed_engine((target, drafter, params, frozen), args, max_len, gamma, policy,
                            profile=profile, num_slots=args.slots, row_buckets="auto",
                            profile_reps=args.profile_reps, online_calibration=calibrate)

    # time each profile warm-up measures (the all-slot one: rows None)
    profile_s: dict = {}
    measure = warmup_mod.production_loop_profile

    def timed_profile(eng, **kw):
        t0 = time.perf_counter()
        prof = measure(eng, **kw)
        profile_s["all" if kw.get("rows") is None else f"rows{kw['rows']}"] = \
            time.perf_counter() - t0
        return prof

    warmup_mod.production_loop_profile = timed_profile
    try:
        prod, prod_warmup_s = engine("production", True)
    finally:
        warmup_mod.production_loop_profile = measure
    full, by_rows = prod.sps, dict(prod.sps_rows)
    slot_prof, _ = engine("production", False)
    slot_prof.set_sps(full)
    cal, _ = engine("production", False, calibrate=True)
    cal.set_sps(full, by_rows=by_rows)
    fixed, _ = engine("fixed", False)
    none, _ = engine("none", False)
    profiles = {"all": _profile_figures(full, gamma, args.slots),
                **{f"rows{r}": _profile_figures(p, gamma, r) for r, p in by_rows.items()}}

    cells = []
    for temp in args.temperatures:
        for c in args.loads:
            ps = prompts[:c]
            reqs = lambda: [Request(prompt=p, max_new_tokens=args.new_tokens,  # noqa: E731
                                    temperature=temp, seed=i) for i, p in enumerate(ps)]

            def served(eng):
                def call():
                    eng.loop_stats.clear()
                    res = eng.generate(reqs())
                    steps = sum(s.steps for s in eng.loop_stats)
                    drafting = sum(s.draft_steps for s in eng.loop_stats)
                    return [list(r.tokens) for r in res], (sum(r.steps for r in res), drafting,
                                                           steps)
                return call

            def plain_generate():
                return generate_timed(model, ps, args.new_tokens, temperature=temp,
                                      max_len=max_len, loop="device", seed=0).tokens, None

            calls = {"row_profiles": served(prod), "slot_profile": served(slot_prof),
                     "row_profiles_cal": served(cal),
                     "fixed": served(fixed), "engine_none": served(none),
                     "generate": plain_generate}
            outs, times = alternating_runs(calls, args.reps)
            dec = {n: decoder_figures(outs[n][0], times[n],
                                      None if outs[n][1] is None else outs[n][1][0])
                   for n in calls}
            for n in ("row_profiles", "slot_profile", "row_profiles_cal", "fixed"):
                _, drafting, steps = outs[n][1]
                dec[n]["drafting_share"] = drafting / max(1, steps)
            best = max(("engine_none", "generate"), key=lambda n: dec[n]["tokens_per_s"])
            dec["plain"] = {**dec[best], "decoder": best}
            rate = {n: dec[n]["tokens_per_s"] for n in VARIANTS}
            cell = {"temperature": temp, "load": c, "decoders": dec,
                    "same_tokens": (temp == 0 and all(
                        [list(t) for t in outs[n][0]] == outs["row_profiles"][0] for n in calls)),
                    # tokens/s ratios, each pair from this run
                    "row_over_slot_profile": rate["row_profiles"] / rate["slot_profile"],
                    "row_profiles_over_plain": rate["row_profiles"] / rate["plain"],
                    "slot_profile_over_plain": rate["slot_profile"] / rate["plain"],
                    "row_profiles_over_fixed": rate["row_profiles"] / rate["fixed"],
                    "cal_over_row_profiles": rate["row_profiles_cal"] / rate["row_profiles"],
                    "cal_over_plain": rate["row_profiles_cal"] / rate["plain"],
                    # against plain decoding in the same engine (what production falls back to)
                    "row_profiles_over_engine_none":
                        rate["row_profiles"] / dec["engine_none"]["tokens_per_s"],
                    "cal_over_engine_none":
                        rate["row_profiles_cal"] / dec["engine_none"]["tokens_per_s"],
                    "calibration_rho": cal.calibration_state()[0].tolist()}
            cells.append(cell)
            print(f"  T={temp} C={c:>2}: row profiles {rate['row_profiles']:6.0f} (drafting "
                  f"{dec['row_profiles']['drafting_share']:.0%}), slot profile "
                  f"{rate['slot_profile']:6.0f} (drafting "
                  f"{dec['slot_profile']['drafting_share']:.0%}), calibrated "
                  f"{rate['row_profiles_cal']:6.0f} (drafting "
                  f"{dec['row_profiles_cal']['drafting_share']:.0%}), fixed {rate['fixed']:6.0f}, "
                  f"plain {rate['plain']:6.0f} ({best}) tokens/s; row / slot profile "
                  f"{cell['row_over_slot_profile']:.2f}x, row profiles / plain "
                  f"{cell['row_profiles_over_plain']:.2f}x"
                  + ("" if temp or cell["same_tokens"] else "  (tokens differ)"), flush=True)
    return {"machine": {"cpu": cpu_model() or platform.processor() or platform.machine(),
                        "cores": os.cpu_count(), "backend": jax.default_backend(),
                        "device_kind": jax.devices()[0].device_kind},
            "config": portable_values({k: v for k, v in vars(args).items() if k != "out"}),
            "gamma": int(gamma), "max_len": max_len, "row_buckets": sorted(by_rows),
            "production_warmup_s": prod_warmup_s, "profile_s": profile_s,
            "profiles": profiles, "cells": cells}


def plot(result: dict, path: str) -> None:
    """tokens/s against load, one panel per temperature, one line per variant."""
    labels = {"row_profiles": "production, profile per row bucket",
              "slot_profile": "production, all-slot profile",
              "row_profiles_cal": "production, per row bucket, calibrated online",
              "fixed": f"fixed K = {result['gamma']}", "plain": "fastest plain decoder"}
    titles = {t: f"{result['config']['slots']}-slot engine, row buckets, T = {t}"
              for t in result["config"]["temperatures"]}
    plot_loads(result, path, "temperature", titles, labels, dashed=("fixed", "plain"))


def main(argv=None) -> dict:
    from benchmarks.mtp_window import add_model_args, check_model_args
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p, "dspark")
    add_load_args(p)
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    p.add_argument("--profile_reps", type=int, default=3,
                   help="timed repetitions per bucket of each profile")
    args = p.parse_args(argv)
    check_model_args(p, args)
    if args.profile_reps < 1 or any(t < 0 for t in args.temperatures):
        p.error(f"--profile_reps must be >= 1 and --temperatures >= 0, got "
                f"{args.profile_reps} and {args.temperatures}")
    check_load_args(p, args)
    if args.quick:
        args.profile_reps = 1
    result = run(args)
    write_results(args, "row_profiles", result, plot)
    return result


if __name__ == "__main__":
    main()
