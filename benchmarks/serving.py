"""Load benchmark of the serving engine: scheduling policies × concurrency (closed loop) and
Poisson arrivals (open loop).

For each concurrency C the engine has C slots and C·(k+1)-token buckets; N = ``--requests-per-slot``
× C requests are queued at once, so C are always in flight (closed loop). Per (C, policy) it
records aggregate tokens/s, per-user tokens/s (a request's tokens / its decode time), TTFT (from
admission), p50 / p99 inter-token latency (gaps between a request's emission steps), mean tokens
per step per request (τ), and the scheduler's host cost as a fraction of step time. Every
(C, policy) run is repeated ``--reps`` times and medians are reported; policies at one C share
one SPS profile and one set of compiled steps, and run interleaved so machine noise hits all.

The overlap of host work with device drafting (``EngineConfig.overlap``) is measured as an
on/off ratio at one concurrency in the same run.

Run (the trained drafter and target come from the reproduction driver, experiments/reproduce.py):
    .venv/bin/python -m benchmarks.serving --drafter-workdir WORK/dspark_markov_g7 \
        --target-workdir ~/.cache/specjax/targets/full-XXXX --prompts WORK/data/heldout.npz
    .venv/bin/python -m benchmarks.serving --quick       # random weights: a smoke run
Writes ``benchmarks/results/serving.json``, ``docs/SERVING_RESULTS.md`` table and a Pareto PNG
(the tables, goals and plot: :mod:`benchmarks.serving_report`).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np

from benchmarks.serving_report import CALIBRATED, goals, plot_pareto, write_markdown
from specjax.engine import Engine, EngineConfig, Request
from specjax.machine import cpu_model
from specjax.paths import dump_json, portable_argv, portable_values
from specjax.scheduling import SchedulerConfig

# The --policies choices are these and their calibrated variants, CALIBRATED ("<policy>+cal").
POLICIES = {
    "none": SchedulerConfig("none"),
    "mtp1": SchedulerConfig("mtp1"),
    "fixed2": SchedulerConfig("fixed", k=2),
    "fixed4": SchedulerConfig("fixed", k=4),
    "fixed7": SchedulerConfig("fixed", k=7),
    "threshold0.5": SchedulerConfig("threshold", threshold=0.5),
    "dspark": SchedulerConfig("dspark"),
    "production": SchedulerConfig("production"),
}


def _base_policy(name: str) -> str:
    """The POLICIES entry of ``name`` ("production+cal" -> "production"). A calibrated policy
    also reuses its base's self-timed profile: the same loop program plus O(S·γ) calibration
    work per step."""
    return name.removesuffix("+cal")


def policy_config(base: EngineConfig, name: str, **overrides) -> EngineConfig:
    """``base`` with the scheduler (and calibration) of policy ``name`` (POLICIES or CALIBRATED)."""
    return EngineConfig(**{**base.__dict__, "scheduler": POLICIES[_base_policy(name)],
                           "online_calibration": name.endswith("+cal"), **overrides})


def load_models(args):
    """(target (graphdef, params), drafter, params, frozen, gamma)."""
    from specjax.drafters import DSparkConfig, DSparkDrafter, shared_head
    if args.drafter_workdir:
        from specjax.training.drafter_run import load_drafter
        from specjax.training.drafter_task import load_target
        drafter, params, task = load_drafter(args.drafter_workdir)
        target = load_target(task.target_config, args.target_workdir or "")
        if not args.target_workdir:
            print("warning: --target-workdir not given: random target weights")
        return target, drafter, params, shared_head(target), task.gamma
    from specjax.models import get_preset, init_model
    from flax import nnx
    model = init_model(get_preset(args.preset), seed=0)
    drafter, params = DSparkDrafter.create(model.config, DSparkConfig(), seed=0)
    return nnx.split(model), drafter, params, shared_head(model), args.gamma


def load_prompts(args, vocab: int, n: int) -> list[list[int]]:
    """``n`` prompts of ``--prompt-len`` tokens.

    From ``--prompts`` (the reproduction's ``heldout.npz``: ``tokens [N, T]``, ``lengths``,
    ``domain``): rows longer than the prompt, taken round-robin over the domains so that traffic
    mixes math / code / prose, each row's first tokens *including* its leading BOS / separator
    (the target and the drafters were trained with it). Else random tokens.
    """
    rng = np.random.default_rng(0)
    if args.prompts:
        if not os.path.exists(args.prompts):
            raise SystemExit(f"--prompts {args.prompts!r} does not exist")
        data = np.load(args.prompts)
        rows = data["tokens"] if "tokens" in data.files else data[data.files[0]]
        lengths = data["lengths"] if "lengths" in data.files else np.full(len(rows), rows.shape[1])
        domain = data["domain"] if "domain" in data.files else np.zeros(len(rows), int)
        ok = lengths > args.prompt_len
        per_domain = [np.flatnonzero(ok & (domain == d)) for d in np.unique(domain)]
        order = [int(x) for group in itertools.zip_longest(*per_domain) for x in group
                 if x is not None]
        if not order:
            raise SystemExit(f"no row of {args.prompts} is longer than --prompt-len")
        return [rows[order[i % len(order)], :args.prompt_len].tolist() for i in range(n)]
    return [rng.integers(0, vocab, size=args.prompt_len).tolist() for _ in range(n)]


def summarize(results, wall: float, engine: Engine) -> dict:
    toks = sum(len(r.tokens) for r in results)
    per_user, ttft, itl = [], [], []
    for r in results:
        if len(r.tokens) > 1 and r.finish_time > r.first_token_time:
            per_user.append((len(r.tokens) - 1) / (r.finish_time - r.first_token_time))
        ttft.append(r.first_token_time - r.admit_time)
        times = sorted(set(r.token_times))
        itl.extend(np.diff(times).tolist())
    base = {
        "aggregate_tok_s": toks / wall,
        "per_user_tok_s": float(np.median(per_user)) if per_user else 0.0,
        "ttft_ms": 1e3 * float(np.median(ttft)),
        "itl_p50_ms": 1e3 * float(np.percentile(itl, 50)) if itl else 0.0,
        "itl_p99_ms": 1e3 * float(np.percentile(itl, 99)) if itl else 0.0,
        "tokens": toks,
    }
    if engine.config.loop == "device":
        # The device loop has no per-step host work to measure: the scheduler runs on the device.
        calls = engine.loop_stats
        slot_steps = sum(r.steps for r in results)
        n_steps = sum(c.steps for c in calls)
        cal = engine.calibration_state()
        if cal is not None:  # the per-position ratios ρ_k the calibration ended the run with
            base["calibration_rho"] = cal[0].tolist()
        return {**base,
                "tau": (toks - len(results)) / max(1, slot_steps),
                "steps": n_steps,
                "step_ms": 1e3 * wall / max(1, n_steps),
                "drafted_frac": sum(c.draft_steps for c in calls) / max(1, n_steps),
                "host_frac": 0.0, "host_us_per_step": 0.0, "host_overlap_us_per_step": 0.0,
                "draft_wait_frac": 0.0, "mean_bucket": 0.0}
    steps = [s for s in engine.stats if s.active]
    host = [s.schedule_s for s in steps]
    host_ov = [s.schedule_overlap_s for s in steps]
    wait = [s.draft_wait_s for s in steps]
    step_t = [s.step_s for s in steps]
    emitted = sum(s.accepted + s.active for s in steps)
    return {
        **base,
        "tau": emitted / max(1, sum(s.active for s in steps)),
        "mean_bucket": float(np.mean([s.bucket for s in steps])),
        # scheduler host cost (policy + bucket pick) as a fraction of the engine step, and
        # per step; the wait for the drafts' confidences is device time, reported separately
        "host_frac": float(np.sum(host) / max(np.sum(step_t), 1e-12)),
        "host_us_per_step": 1e6 * float(np.mean(host)) if host else 0.0,
        "host_overlap_us_per_step": 1e6 * float(np.mean(host_ov)) if host_ov else 0.0,
        "step_ms": 1e3 * float(np.mean(step_t)) if step_t else 0.0,
        "draft_wait_frac": float(np.sum(wait) / max(np.sum(step_t), 1e-12)),
        "drafted_frac": float(np.mean([s.drafted for s in steps])) if steps else 0.0,
        "steps": len(steps),
    }


def _median(values: list):
    """Median of numbers, or element-wise median of equal-length lists."""
    if isinstance(values[0], list):
        return [statistics.median(v) for v in zip(*values)]
    return statistics.median(values)


def run_one(target, drafter, params, frozen, cfg: EngineConfig, prompts, max_new: int,
            temperature: float, sps=None, stop=()):
    engine = Engine(target, drafter, params, frozen, cfg)
    engine.warmup(profile=sps is None)
    if sps is not None:
        engine.set_sps(sps)
    reqs = [Request(prompt=p, max_new_tokens=max_new, temperature=temperature, seed=i,
                    stop_tokens=stop) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    return summarize(results, time.perf_counter() - t0, engine), engine


def poisson(target, drafter, params, frozen, cfg, prompts, max_new, temperature, rate, sps,
            stop=()):
    """Open loop: requests arrive with exponential gaps (rate per second)."""
    engine = Engine(target, drafter, params, frozen, cfg)
    engine.warmup(profile=False)
    engine.set_sps(sps)
    rng = np.random.default_rng(1)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=len(prompts)))
    t0 = time.perf_counter()
    i, ids = 0, []
    while i < len(prompts) or engine.has_work():
        now = time.perf_counter() - t0
        while i < len(prompts) and arrivals[i] <= now:
            ids.append(engine.submit(Request(prompt=prompts[i], max_new_tokens=max_new,
                                             temperature=temperature, seed=i, stop_tokens=stop)))
            i += 1
        if engine.has_work():
            engine.step()
        else:
            time.sleep(min(0.002, max(0.0, arrivals[i] - now)) if i < len(prompts) else 0)
    results = [engine.finished[r] for r in ids]
    out = summarize(results, time.perf_counter() - t0, engine)
    out["ttft_ms"] = 1e3 * float(np.median([r.first_token_time - r.submit_time for r in results]))
    return out


def _machine() -> str:
    cpu = cpu_model() or platform.machine()
    try:
        load = open("/proc/loadavg").read().split()[0]
    except OSError:
        load = "?"
    return f"{cpu}, {os.cpu_count()} cpus, 1-min load {load} at start"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter-workdir")
    ap.add_argument("--target-workdir")
    ap.add_argument("--prompts", help="npz of token rows (e.g. the reproduction's heldout.npz)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated, from {', '.join((*POLICIES, *CALIBRATED))}")
    ap.add_argument("--requests-per-slot", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--stop-tokens", default="",
                    help="comma-separated stop token ids (e.g. 0, the embedded corpus' separator: "
                         "requests end where a document would)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--overlap-at", type=int, default=8)
    ap.add_argument("--poisson-rates", default="", help="requests/s, e.g. 2,4,8 (32 slots)")
    ap.add_argument("--poisson-loads", default="",
                    help="offered loads as fractions of the no-speculation capacity measured in "
                         "the closed loop at the highest concurrency, e.g. 0.5,0.9 (rate = load × "
                         "aggregate tok/s of 'none' / its mean tokens per request)")
    ap.add_argument("--loop", default="device", choices=("device", "host"),
                    help="engine loop (the overlap experiment always uses the host loop)")
    ap.add_argument("--loop-steps", type=int, default=16)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--render", metavar="JSON",
                    help="only re-render the markdown and the plot from a saved results JSON")
    ap.add_argument("--out", default="benchmarks/results/serving.json")
    ap.add_argument("--md", default="docs/SERVING_RESULTS.md")
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            report = json.load(f)
        report["goals"] = goals(report)
        dump_json(args.render, report)
        write_markdown(report, args.md, report.get("argv"))
        plot_pareto(report, os.path.splitext(args.render)[0] + "_pareto.png")
        print(f"re-rendered {args.md} from {args.render}")
        return report
    if args.quick:
        # A smoke run: every code path once at the smallest shapes. Each (concurrency, policy)
        # compiles its own device loop and each concurrency its profiling engine, so the compile
        # time is the run time: one concurrency (2 slots, so admission into a busy engine
        # happens), γ = 3 (buckets 2, 4, 8); the host-loop overlap (one verification program per
        # bucket) runs there too.
        args.preset, args.concurrency, args.reps = "tiny", "2", 1
        args.max_new_tokens, args.requests_per_slot, args.prompt_len = 8, 2, 16
        args.policies = "none,fixed2,dspark,production,production+cal"  # (mtp1: fixed K = 1)
        args.gamma, args.overlap_at = 3, 2
    target, drafter, params, frozen, gamma = load_models(args)
    vocab = frozen.vocab_size
    conc = [int(c) for c in args.concurrency.split(",")]
    stop = tuple(int(t) for t in args.stop_tokens.split(",") if t.strip())
    pols = args.policies.split(",")
    report = {"machine": _machine(), "backend":
              jax.default_backend(), "gamma": gamma, "args": portable_values(vars(args)), "closed_loop": {},
              "overlap": {}, "poisson": {},
              "argv": portable_argv(list(argv) if argv is not None else sys.argv[1:])}
    max_len = args.prompt_len + args.max_new_tokens + gamma + 2
    for c in conc:
        prompts = load_prompts(args, vocab, args.requests_per_slot * c)
        base = EngineConfig(num_slots=c, max_len=max_len, gamma=gamma,
                            prefill_buckets=(args.prompt_len,), filters=False,
                            loop=args.loop, loop_steps=args.loop_steps)
        prof_engine = Engine(target, drafter, params, frozen, base)
        prof_engine.warmup(profile=True)
        sps = prof_engine.sps
        # production on the device loop times its own loop program (specjax/engine/loop_profile.py):
        # its first run profiles, the later ones reuse that profile
        self_profiled = {"production"} if args.loop == "device" else set()
        if "production+cal" in pols and ("production" not in pols or
                                         pols.index("production") > pols.index("production+cal")):
            raise SystemExit("production+cal reuses production's profile: list production "
                             "before it in --policies")
        own = {}
        runs = {p: [] for p in pols}
        for rep in range(args.reps):
            for p in pols:
                cfg = policy_config(base, p)
                owner = _base_policy(p)
                prof = own.get(owner) if owner in self_profiled else sps
                r, eng = run_one(target, drafter, params, frozen, cfg, prompts,
                                 args.max_new_tokens, args.temperature, prof, stop)
                if p in self_profiled:
                    own[p] = eng.sps
                runs[p].append(r)
                print(f"C={c:3d} {p:13s} rep {rep}: agg {r['aggregate_tok_s']:8.1f} tok/s  "
                      f"user {r['per_user_tok_s']:7.1f}  tau {r['tau']:.2f}  "
                      f"bucket {r['mean_bucket']:.1f}  host {100 * r['host_frac']:.2f}%",
                      flush=True)
        report["closed_loop"][c] = {
            "sps": sps.to_dict(), **{f"sps_{p}": v.to_dict() for p, v in own.items()},
            "policies": {p: {k: _median([x[k] for x in rs]) for k in rs[0]}
                         for p, rs in runs.items()}}
        if c == args.overlap_at:
            ratios = []
            # a policy that drafts (overlap hides host work behind drafting)
            ov_pol = next((p for p in ("dspark", "production", *pols) if p in pols
                           and p != "none" and p not in CALIBRATED), pols[0])
            for rep in range(args.reps):
                res = {}
                for ov in (False, True):
                    cfg = policy_config(base, ov_pol, overlap=ov, loop="host")
                    res[ov] = run_one(target, drafter, params, frozen, cfg, prompts,
                                      args.max_new_tokens, args.temperature, sps, stop)[0]
                ratios.append(res[True]["aggregate_tok_s"] / res[False]["aggregate_tok_s"])
            report["overlap"] = {"concurrency": c, "policy": ov_pol,
                                 "on_over_off_aggregate": ratios,
                                 "median": statistics.median(ratios)}
            print(f"overlap on/off aggregate throughput at C={c}: {ratios}")
    rates = [float(r) for r in args.poisson_rates.split(",")] if args.poisson_rates else []
    if args.poisson_loads:
        top = report["closed_loop"][max(conc)]["policies"]
        if "none" not in top:
            raise SystemExit("--poisson-loads needs the 'none' policy in --policies")
        # requests/s: tokens/s over the measured mean tokens per request (stop tokens end some early)
        mean_len = top["none"]["tokens"] / (args.requests_per_slot * max(conc))
        cap = top["none"]["aggregate_tok_s"] / mean_len
        rates += [round(float(x) * cap, 3) for x in args.poisson_loads.split(",")]
    if rates:
        c = max(conc)
        prompts = load_prompts(args, vocab, args.requests_per_slot * c)
        base = EngineConfig(num_slots=c, max_len=max_len, gamma=gamma,
                            prefill_buckets=(args.prompt_len,), filters=False,
                            loop=args.loop, loop_steps=args.loop_steps)
        from specjax.buckets import SPSProfile
        block = report["closed_loop"][c]
        prof = SPSProfile.from_dict(block["sps"])
        own = {k[4:]: SPSProfile.from_dict(v) for k, v in block.items() if k.startswith("sps_")}
        for rate in rates:
            report["poisson"][rate] = {}
            for p in pols:
                cfg = policy_config(base, p)
                report["poisson"][rate][p] = poisson(target, drafter, params, frozen, cfg,
                                                     prompts, args.max_new_tokens,
                                                     args.temperature, rate,
                                                     own.get(_base_policy(p), prof), stop)
                print(f"poisson {rate}/s {p}: {report['poisson'][rate][p]}", flush=True)
    report["goals"] = goals(report)
    dump_json(args.out, report)
    write_markdown(report, args.md, report["argv"])
    plot_pareto(report, os.path.splitext(args.out)[0] + "_pareto.png")
    print(f"wrote {args.out}, {args.md}")
    return report


if __name__ == "__main__":
    main()
