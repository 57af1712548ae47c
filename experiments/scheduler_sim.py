r"""DSpark's verification policies at TPU economics, by simulation (labelled as such everywhere).

SPS(B) comes from the TPU-compiled verification step of a real target by roofline (compiled on
this machine with libtpu, :mod:`specjax.aot`); the drafter's behaviour comes from the per-step
traces that ``experiments.reproduce`` records for the DSpark heads. :mod:`specjax.sched_sim`
replays those traces through each policy at each concurrency::

    python -m experiments.scheduler_sim --target qwen3-8b --topology v5p-8 --slots 64 \
        --max_len 2048 --buckets 16,64,128,256,512 \
        --traces experiments/results/full/dspark_g7/traces_dspark_markov_g7.npz \
        --out experiments/results/sched_sim

``--profile FILE.json`` skips the compilation and reads an SPS profile instead (the JSON of
:class:`specjax.buckets.SPSProfile`, e.g. one the engine measured, or the ``sps_profile.json``
an earlier run wrote). ``--quick`` compiles nothing and uses a small synthetic profile (tests).

Writes ``sim.json`` (every cell), ``sim.md`` (tables and the answers below) and ``sim.png``
(throughput vs per-user speed, one curve per policy) into ``--out``. The answers: at which
concurrency fixed-K speculation falls below no speculation, and whether dspark and production stay
at or above it. ``production ρ=1`` is the production form with its stale confidences read as
drafted, however old (``SchedulerConfig.stale_decay = 1``), beside the default's decay.

``--reports`` re-simulates from the compile reports of an earlier ``sim.json`` (no compilation)::

    python -m experiments.scheduler_sim --reports experiments/results/sched_sim/sim.json \
        --out experiments/results/sched_sim

What the roofline leaves out (so these are lower bounds on step time, and the SPS *shape* is what
matters): collectives, kernel efficiency, the host. The compiled program holds ``--slots`` slots
of ``--max_len`` positions whatever the concurrency, so every simulated C pays for reading that
whole cache window: the figures are for a server provisioned for ``--slots`` requests.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import textwrap
import time

from specjax.buckets import SPSProfile
from specjax.sched_sim import SimResult, Traces, sweep
from specjax.scheduling import SchedulerConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRACES = os.path.join(REPO, "experiments", "results", "full", "dspark_g7",
                              "traces_dspark_markov_g7.npz")


def compiled_profile(target: str, topology: str, *, slots: int, max_len: int, buckets,
                     gamma: int, drafter: str = "dspark", verify_order: str = "host",
                     log=print) -> tuple[SPSProfile, list]:
    """SPS per bucket = 1 / roofline seconds of the TPU-compiled verification step; ``draft_s``
    = the drafting step's roofline. Returns the profile and the compile reports.

    ``verify_order``: "host" compiles the host loop's verification step (keys/values written
    inside the forward), "loop" the device loop's order (read-only forward, writes after it);
    see :class:`specjax.aot.EngineShapes`."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from experiments.configs.tpu_pod import get_config
    from specjax import aot
    from specjax.training.lm_task import model_config_from
    cfg = get_config(f"{target},{drafter},{topology}")
    model = model_config_from(cfg)
    n = len(aot.topology_devices(topology))
    tp = math.gcd(n, model.num_kv_heads)
    mesh = aot.topology_mesh(topology, {"data": n // tp, "fsdp": 1, "tensor": tp})
    shapes = aot.EngineShapes(num_slots=slots, max_len=max_len, gamma=gamma,
                              buckets=tuple(buckets), prefill_chunk=64, loop_steps=0,
                              verify_order=verify_order)
    reports = []
    for p in aot.engine_steps(model, cfg.task, mesh, shapes):
        if not p.name.startswith(("engine.verify", "engine.draft")):
            continue
        t0 = time.perf_counter()
        r = aot.compile_program(p, mesh, topology)
        log(f"  {p.name}: roofline {1e3 * r.roofline_seconds:.2f} ms ({r.bound}), "
            f"{r.bytes_accessed / 1e9:.1f} GB, {r.flops / 1e12:.2f} TFLOP per chip "
            f"[{time.perf_counter() - t0:.0f} s]")
        reports.append(r.to_dict())
    key = f"roofline {target} {topology} slots={slots} max_len={max_len} gamma={gamma}"
    if verify_order != "host":
        key += f" verify_order={verify_order}"
    return profile_from_reports(reports, key), reports


def profile_from_reports(reports: list, key: str) -> SPSProfile:
    """SPS per bucket = 1 / roofline seconds of each ``engine.verify[N=…]`` compile report;
    ``draft_s`` = the ``engine.draft`` report's roofline."""
    verify = sorted((r["shapes"]["bucket"], r["roofline_seconds"]) for r in reports
                    if r["name"].startswith("engine.verify"))
    return SPSProfile(tuple(b for b, _ in verify), tuple(1.0 / s for _, s in verify), key,
                      draft_seconds(reports))


def draft_seconds(reports: list) -> float:
    """Roofline seconds of the ``engine.draft`` compile report."""
    return next(r["roofline_seconds"] for r in reports if r["name"] == "engine.draft")


def cache_once_profiles(reports: list, target: str, topology: str, concurrencies, *,
                        context: int) -> dict:
    """Counterfactual SPS per concurrency C: the compiled FLOPs of each verification bucket, but
    bytes = the weights' share of a chip + one read of C slots' keys and values at ``context``
    positions (what an attention kernel that reads each used cache entry once would move).
    ``draft_s`` stays the compiled drafting roofline. Returns ``{C: SPSProfile}``."""
    import jax.numpy as jnp
    from experiments.configs.tpu_pod import get_config
    from specjax.aot import chip_of
    from specjax.models.flops import matmul_params
    from specjax.training.lm_task import model_config_from
    model = model_config_from(get_config(f"{target},dspark,{topology}"))
    chip = chip_of(topology)
    verify = sorted((r["shapes"]["bucket"], r["flops"], r["mesh"].get("tensor", 1))
                    for r in reports if r["name"].startswith("engine.verify"))
    draft_s = draft_seconds(reports)
    tp = verify[0][2]
    weights = matmul_params(model) * jnp.dtype(model.weight_dtype).itemsize / tp
    kv_per_pos = (model.num_layers * 2 * model.num_kv_heads * model.head_dim
                  * jnp.dtype(model.compute_dtype).itemsize / tp)
    out = {}
    for c in concurrencies:
        nbytes = weights + c * context * kv_per_pos
        secs = [max(f / chip.peak_bf16_flops, nbytes / chip.hbm_bandwidth) for _, f, _ in verify]
        out[c] = SPSProfile(tuple(b for b, _, _ in verify), tuple(1.0 / t for t in secs),
                            f"counterfactual: compiled FLOPs, weights + KV read once "
                            f"({target} {topology}, context {context})", draft_s)
    return out


def synthetic_profile(max_tokens: int) -> SPSProfile:
    """A small profile for --quick: a fixed cost plus a per-token cost, drafting a fifth of a
    one-token step (the shape of a step bound by reading the weights up to ~100 tokens)."""
    buckets = tuple(b for b in (8, 16, 32, 64, 128, 256, 512) if b < max_tokens) + (max_tokens,)
    return SPSProfile(buckets, tuple(1.0 / (0.01 + 0.0001 * b) for b in buckets),
                      "synthetic", 0.002)


def calibrated(traces: Traces):
    """``(traces with STS-calibrated confidences, the fit)``: Sequential Temperature Scaling
    (:mod:`specjax.calibration`) fitted on these traces' own verifier decisions (every draft of
    a recorded step was verified, so draft k was accepted iff ``k < num_accepted``). In-sample:
    the replay then sees confidences calibrated on the steps it replays, the best a head
    calibrated on held-out data could hope for."""
    import numpy as np

    from specjax import calibration as C
    logits = C.logit(np.asarray(traces.confidences, np.float64))
    acc = np.arange(traces.gamma)[None, :] < np.asarray(traces.num_accepted)[:, None]
    sts = C.sequential_temperature_scaling(logits, acc)
    return dataclasses.replace(traces, confidences=sts.apply(logits)), sts


HELD = "production ρ=1"  # the row of SchedulerConfig("production", stale_decay=1.0)
REP_SEED = 1000  # repetition i draws with seed + REP_SEED * i


def pooled(cells) -> SimResult:
    """One (policy, concurrency) cell over repetitions: steps, tokens and seconds summed."""
    first = cells[0]
    return dataclasses.replace(
        first, steps=sum(c.steps for c in cells), tokens=sum(c.tokens for c in cells),
        seconds=sum(c.seconds for c in cells),
        verified_drafts=sum(c.verified_drafts for c in cells),
        drafting_steps=sum(c.drafting_steps for c in cells))


def _ratio(cells, a: str, b: str) -> float:
    by = {c.policy: c.throughput for c in cells}
    return by[a] / by[b]


def policies(gamma: int) -> list[SchedulerConfig]:
    fixed = [k for k in (1, 2, 3, 4, 7) if k <= gamma]
    return ([SchedulerConfig("none")] + [SchedulerConfig("fixed", k=k) for k in fixed]
            + [SchedulerConfig("dspark"), SchedulerConfig("production"),
               # the production form reading its stale confidences as drafted, however old
               SchedulerConfig("production", stale_decay=1.0)])


def answers(rows: list[dict]) -> dict:
    """Per concurrency: best fixed K, whether it is below none, and dspark / production vs the
    better of none and the best fixed K; plus the first C where every fixed K is below none."""
    by_c: dict = {}
    for r in rows:
        by_c.setdefault(r["concurrency"], {})[r["policy"]] = r["throughput"]
    out = {"per_concurrency": {}, "fixed_below_none_from": None}
    for c in sorted(by_c):
        t = by_c[c]
        fixed = {p: v for p, v in t.items() if p.startswith("fixed")}
        if not fixed:
            continue
        best_p = max(fixed, key=fixed.get)
        base = max(t["none"], fixed[best_p])
        out["per_concurrency"][c] = {
            "best_fixed": best_p, "best_fixed_vs_none": fixed[best_p] / t["none"],
            "dspark_vs_best_static": t["dspark"] / base,
            "production_vs_best_static": t["production"] / base}
        if HELD in t:
            out["per_concurrency"][c]["production_held_vs_best_static"] = t[HELD] / base
        if fixed[best_p] < t["none"] and out["fixed_below_none_from"] is None:
            out["fixed_below_none_from"] = c
    return out


def markdown(rows: list[dict], ans: dict, profile: SPSProfile, meta: dict) -> str:
    pols = list(dict.fromkeys(r["policy"] for r in rows))
    cs = sorted({r["concurrency"] for r in rows})
    cell = {(r["policy"], r["concurrency"]): r for r in rows}
    lines = ["# Scheduling policies at TPU economics (simulation)\n",
             f"SPS profile: {profile.key}; buckets {list(profile.buckets)}; drafting "
             f"{1e3 * profile.draft_s:.2f} ms. Traces: {meta['traces']} ({meta['n_traces']} "
             f"recorded steps, γ = {meta['gamma']}). {meta['steps']} simulated steps per cell"
             + (f" in each of {meta['reps']} repetitions" if meta.get("reps", 1) > 1 else "")
             + ("; each request replays recorded requests step by step" if meta.get("sequential")
                else "; recorded steps drawn independently")
             + ("; confidences STS-calibrated in-sample, temperatures "
                + ", ".join(f"{x:.2f}" for x in meta["sts_temperatures"])
                if meta.get("sts_temperatures") else "") + ".\n",
             *(["Verification step time (ms) per bucket, by concurrency (each C has its own "
                "profile): " + "; ".join(f"C={c}: {v}" for c, v in
                                          meta["step_ms_per_concurrency"].items()) + "\n"]
               if "step_ms_per_concurrency" in meta else
               [f"Verification step time (ms) per bucket: "
                f"{[round(1e3 / x, 3) for x in profile.steps_per_s]}\n"]),
             "Throughput, tokens/s (all requests):\n",
             "| policy | " + " | ".join(f"C={c}" for c in cs) + " |",
             "|---|" + "---|" * len(cs)]
    for p in pols:
        lines.append(f"| {p} | " + " | ".join(f"{cell[(p, c)]['throughput']:.0f}" for c in cs)
                     + " |")
    lines += ["", "Tokens per request-step (τ):\n", "| policy | " +
              " | ".join(f"C={c}" for c in cs) + " |", "|---|" + "---|" * len(cs)]
    for p in pols:
        lines.append(f"| {p} | " + " | ".join(f"{cell[(p, c)]['tau']:.2f}" for c in cs) + " |")
    held = any("production_held_vs_best_static" in a for a in ans["per_concurrency"].values())
    lines += ["", "| C | best fixed K | best fixed / none | dspark / max(none, best fixed) | "
              "production / max(none, best fixed) |"
              + (f" {HELD} / max(none, best fixed) |" if held else ""),
              "|---|---|---|---|---|" + ("---|" if held else "")]
    for c, a in ans["per_concurrency"].items():
        lines.append(f"| {c} | {a['best_fixed']} | {a['best_fixed_vs_none']:.3f} | "
                     f"{a['dspark_vs_best_static']:.3f} | {a['production_vs_best_static']:.3f} |"
                     + (f" {a['production_held_vs_best_static']:.3f} |" if held else ""))
    reps = {c: a["production_vs_held_reps"] for c, a in ans["per_concurrency"].items()
            if "production_vs_held_reps" in a}
    if reps:
        lines += ["", f"production / {HELD} in each of the {meta['reps']} repetitions (median; "
                  "min-max):\n"] + [
            f"- C={c}: {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})"
            for c, r in reps.items()]
    f = ans["fixed_below_none_from"]
    lines += ["", f"Fixed-K speculation falls below no speculation from C = {f}." if f else
              f"Fixed-K speculation stays above no speculation up to C = {cs[-1]}."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["concurrency"], r["per_user"], r["throughput"]) for r in rows
                     if r["policy"] == p)
        style = "-o" if p in ("dspark", "production", "none") else ":x" if p == HELD else "--."
        ax.plot([x[1] for x in pts], [x[2] for x in pts], style, label=p, ms=4)
        if p == "none":
            for c, u, t in pts:
                ax.annotate(f"C={c}", (u, t), fontsize=7, textcoords="offset points",
                            xytext=(3, 3))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("per-user speed, tokens/s")
    ax.set_ylabel("throughput, tokens/s")
    ax.set_title(textwrap.fill(title, 80), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen3-8b")
    ap.add_argument("--topology", default="v5p-8")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--buckets", default="16,64,128,256,512")
    from specjax.aot.programs import VERIFY_ORDERS
    ap.add_argument("--verify_order", choices=VERIFY_ORDERS, default="host",
                    help="compile the host loop's verification step (keys/values written in the "
                         "forward) or the device loop's order (written after a read-only forward)")
    ap.add_argument("--traces", default=DEFAULT_TRACES)
    ap.add_argument("--profile", default=None, help="an SPS profile JSON instead of compiling")
    ap.add_argument("--concurrency", default=None, help="e.g. 1,2,4 (default: powers of two up "
                                                         "to --slots)")
    ap.add_argument("--sequential", action="store_true",
                    help="replay recorded requests step by step (traces with request ids, e.g. "
                         "benchmarks.confidence_staleness's) instead of independent steps")
    ap.add_argument("--calibrate", action="store_true",
                    help="rescale the traces' confidences by Sequential Temperature Scaling "
                         "fitted on the same traces (in-sample) before replaying them")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--reps", type=int, default=1,
                    help="repetitions with other draws (seed + 1000 i); a cell's tokens and "
                         "seconds are summed over them, and the answers keep each one's "
                         "production / production ρ=1 ratio")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="synthetic profile, few steps")
    ap.add_argument("--cache_read_once", type=int, default=0, metavar="CONTEXT",
                    help="counterfactual: keep the compiled FLOPs but count the bytes of the "
                         "weights plus one read of each active slot's KV at CONTEXT positions "
                         "(needs --reports)")
    ap.add_argument("--reports", default=None,
                    help="sim.json of a compiled run: reuse its compile reports")
    ap.add_argument("--out", default=os.path.join("experiments", "results", "sched_sim"))
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    traces = Traces.load(args.traces)
    if args.sequential and traces.request is None:
        ap.error(f"--sequential needs traces that record their requests; {args.traces} does not")
    sts = None
    if args.calibrate:
        traces, sts = calibrated(traces)
    os.makedirs(args.out, exist_ok=True)
    reports = []
    per_c = None
    if args.cache_read_once and not args.reports:
        raise SystemExit("--cache_read_once needs --reports (the compile reports)")
    if args.reports:
        with open(args.reports) as f:
            compiled = json.load(f)
        reports = compiled["compile_reports"]
        profile = profile_from_reports(reports, compiled["profile"]["key"])
    elif args.quick:
        profile, args.steps = synthetic_profile(8 * (traces.gamma + 1)), min(args.steps, 20)
        args.slots = 8
    elif args.profile:
        profile = SPSProfile.load(args.profile)
    else:
        buckets = sorted(int(b) for b in args.buckets.split(","))
        print(f"compiling the verification step of {args.target} for {args.topology} "
              f"(slots {args.slots}, max_len {args.max_len}, buckets {buckets})", flush=True)
        profile, reports = compiled_profile(args.target, args.topology, slots=args.slots,
                                            max_len=args.max_len, buckets=buckets,
                                            gamma=traces.gamma,
                                            verify_order=args.verify_order)
        profile.save(os.path.join(args.out, "sps_profile.json"))
    cs = ([int(c) for c in args.concurrency.split(",")] if args.concurrency else
          [2 ** i for i in range(int(math.log2(args.slots)) + 1)])
    cs = [c for c in cs if c <= profile.max_tokens]
    if args.cache_read_once:
        per_c = cache_once_profiles(reports, args.target, args.topology, cs,
                                    context=args.cache_read_once)
    results, held_reps = [], {}
    for c in cs:  # fixed K needs C (K + 1) tokens: drop the K that do not fit the buckets
        prof = per_c[c] if per_c else profile
        ok = [p for p in policies(traces.gamma)
              if p.policy != "fixed" or c * (p.k + 1) <= prof.max_tokens]
        reps = [sweep(traces, ok, prof, [c], steps=args.steps, seed=args.seed + REP_SEED * i,
                      sequential=args.sequential) for i in range(args.reps)]
        results += [pooled(cells) for cells in zip(*reps)]
        held_reps[c] = [_ratio(cells, "production", HELD) for cells in reps]
    rows = [r.to_dict() for r in results]
    ans = answers(rows)
    if args.reps > 1:  # each repetition's paired ratio, beside the pooled one
        for c, ratios in held_reps.items():
            if c in ans["per_concurrency"]:
                ans["per_concurrency"][c]["production_vs_held_reps"] = ratios
    meta = {"traces": os.path.relpath(os.path.abspath(args.traces), REPO),
            "n_traces": int(traces.num_accepted.size), "gamma": traces.gamma,
            "steps": args.steps, "seed": args.seed, "reps": args.reps,
            "sequential": args.sequential,
            "sts_temperatures": None if sts is None else [float(x) for x in sts.temperatures],
            "command": "python -m experiments.scheduler_sim " + " ".join(argv or [])}
    out = {"simulation": True, "profile": profile.to_dict(), "meta": meta, "rows": rows,
           "answers": ans, "compile_reports": reports}
    if per_c:
        out["profile"] = {str(c): p.to_dict() for c, p in per_c.items()}
        profile = per_c[cs[-1]]
        meta["step_ms_per_concurrency"] = {c: [round(1e3 / x, 3) for x in p.steps_per_s]
                                           for c, p in per_c.items()}
    with open(os.path.join(args.out, "sim.json"), "w") as f:
        json.dump(out, f, indent=1)
    md = markdown(rows, ans, profile, meta)
    with open(os.path.join(args.out, "sim.md"), "w") as f:
        f.write(md)
    plot(rows, os.path.join(args.out, "sim.png"), f"SIMULATION: {profile.key}")
    print(md)
    return out


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
