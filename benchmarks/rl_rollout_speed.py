"""Rollout-only speed of the RL study's speculative rollouts against the fastest plain decoder.

One GRPO batch (``--prompts`` train prompts of the RL task x ``--generations`` samples each, at
``--temperature``, up to ``--new-tokens`` tokens, stopping at EOS) is sampled, on the same weights
in the same run, by:

* ``generate``: :func:`specjax.models.generate.generate` (one jitted ``lax.while_loop`` over the
  whole batch: the decoder the study's ``no_spec`` arm rolls out with);
* ``engine_none``: the engine's device loop with policy "none" (plain decoding);
* ``engine_none_rows``: the same with row buckets (see ``spec_rows``);
* ``spec``: the engine with the trained drafter, fixed K = γ, rejection sampling, in the study's
  engine configuration (``experiments/rl_study_arms.py:study_engine_config``: one slot per
  sequence, no top-k / top-p filters);
* ``spec_filters``: the same engine with the top-k / top-p filters compiled in (what the study's
  rollouts ran with before; the tokens are the same, only the time differs);
* ``spec_rows``: the same engine with row buckets (``EngineConfig.row_buckets="auto"``: as
  sequences end, later device-loop calls run on the unfinished ones only; the tokens can differ
  from ``spec``'s only through the drafting noise, drawn per row).

Each decoder runs once untimed (compilation), then ``--reps`` times, alternating, each rep with
its own sampling seeds (the same seeds for every decoder); the medians are reported. The speed-up
of ``spec`` is over the fastest plain decoder. Beside it, the analytic bound
``τ · t_plain / (t_draft + t_verify)`` from the measured τ and the three steps timed on their own
inside a jitted loop (``benchmarks/spec_vs_plain.py:_step_costs``), and measured / bound. The
engines also report ``prefill_s``: the median time of a rep spent admitting the batch (feeding
the prompts, :attr:`specjax.engine.Engine.prefill_s`), which the bound leaves out.

Run (a pretrain_target.py workdir and a drafter workdir trained against it, e.g. the RL study's
e2e-TV head ``<study workdir>/adapt/e2e_tv_g3_c256_t1.0``)::

    python -m benchmarks.rl_rollout_speed --target runs/quickstart_target \\
        --drafter runs/rl_study_qs_online/adapt/e2e_tv_g3_c256_t1.0 \\
        --out benchmarks/results/rl_rollout_speed.json
    python -m benchmarks.rl_rollout_speed --quick ...     # 2 prompts x 2, 8 tokens, one rep
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np

from specjax.machine import cpu_model
from specjax.paths import dump_json, portable_argv, portable_values

# the plain decoders: every speed-up is over the fastest of them in the same run
PLAIN = ("generate", "engine_none", "engine_none_rows")


def measure(model, drafter, dparams, prompts: list[list[int]], *, eos_id: int, gamma: int,
            new_tokens: int, max_prompt_length: int, temperature: float, reps: int,
            cost_reps: int = 3, prefill_buckets=None) -> dict:
    """Times the four decoders on ``prompts`` (token lists, one per sequence) and returns the
    medians, speed-ups and the analytic bound (see the module docstring). ``prefill_buckets``:
    the engines' prompt chunk sizes instead of the study's."""
    import dataclasses

    from benchmarks.spec_vs_plain import _step_costs
    from experiments.rl_study_arms import study_engine_config
    from specjax.drafters import NGramDrafter, shared_head
    from specjax.engine import Engine, Request
    from specjax.models.generate import generate
    from specjax.scheduling import SchedulerConfig

    if reps < 1 or not prompts or max(len(p) for p in prompts) > max_prompt_length:
        raise ValueError("need reps >= 1 and prompts of 1..max_prompt_length tokens")
    p = dict(num_slots=len(prompts), max_prompt_length=max_prompt_length,
             max_new_tokens=new_tokens, gamma=gamma)
    cfg = study_engine_config(p, "rejection")
    if prefill_buckets is not None:
        cfg = dataclasses.replace(cfg, prefill_buckets=tuple(prefill_buckets))
    head = shared_head(model)
    engines = {
        "engine_none": Engine(model, NGramDrafter(model.config.vocab_size), None, None,
                              dataclasses.replace(cfg, gamma=1,
                                                  scheduler=SchedulerConfig("none", k=0))),
        "engine_none_rows": Engine(model, NGramDrafter(model.config.vocab_size), None, None,
                                   dataclasses.replace(cfg, gamma=1, row_buckets="auto",
                                                       scheduler=SchedulerConfig("none", k=0))),
        "spec": Engine(model, drafter, dparams, head, cfg),
        "spec_filters": Engine(model, drafter, dparams, head,
                               dataclasses.replace(cfg, filters=True)),
        "spec_rows": Engine(model, drafter, dparams, head,
                            dataclasses.replace(cfg, row_buckets="auto")),
    }
    for e in engines.values():
        e.warmup(profile=False)

    def run_engine(name, rep):
        eng = engines[name]
        n0, p0 = len(eng.loop_stats), eng.prefill_s
        res = eng.generate([Request(prompt=pr, max_new_tokens=new_tokens, stop_tokens=(eos_id,),
                                    temperature=temperature, seed=rep * 100_003 + i)
                            for i, pr in enumerate(prompts)])
        toks = sum(len(r.tokens) for r in res)
        return {"tokens": toks, "request_steps": sum(r.steps for r in res),
                "loop_steps": sum(s.steps for s in eng.loop_stats[n0:]),
                "prefill_s": eng.prefill_s - p0}

    def run_generate(rep):
        out = generate(model, prompts, new_tokens, temperature=temperature, eos_id=eos_id,
                       seed=rep, max_len=cfg.max_len)
        return {"tokens": sum(len(t) for t in out)}

    decoders = {"generate": run_generate,
                **{n: (lambda rep, n=n: run_engine(n, rep)) for n in engines}}
    runs: dict[str, list] = {n: [] for n in decoders}
    for rep in range(reps + 1):  # rep 0: compilation, not timed
        for name, fn in decoders.items():
            t0 = time.perf_counter()
            r = fn(rep)
            r["wall_s"] = time.perf_counter() - t0
            if rep:
                runs[name].append(r)
    out = {}
    for name, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        toks = sum(r["tokens"] for r in rs) / len(rs)
        out[name] = {"wall_s": wall, "tokens_per_s": toks / wall, "walls": [r["wall_s"] for r in rs],
                     "tokens": [r["tokens"] for r in rs]}
        if "request_steps" in rs[0]:
            steps = sum(r["request_steps"] for r in rs)
            out[name]["tau"] = (sum(r["tokens"] for r in rs) - len(prompts) * len(rs)) / steps
            out[name]["loop_steps"] = [r["loop_steps"] for r in rs]
            out[name]["prefill_s"] = statistics.median(r["prefill_s"] for r in rs)
    base = max(PLAIN, key=lambda n: out[n]["tokens_per_s"])
    for name in ("spec", "spec_filters", "spec_rows", "engine_none", "engine_none_rows"):
        out[name]["speedup"] = out[name]["tokens_per_s"] / out[base]["tokens_per_s"]
    context = int(np.mean([len(x) for x in prompts])) + new_tokens // 2
    costs = _step_costs(engines["spec"], cost_reps, context, temperature)
    bound = out["spec"]["tau"] * costs["plain_s"] / (costs["draft_s"] + costs["verify_s"])
    return {"sequences": len(prompts), "baseline": base, "decoders": out, "step_costs": costs,
            "bound": bound, "measured_over_bound": out["spec"]["speedup"] / bound,
            "filters_slowdown": out["spec_filters"]["wall_s"] / out["spec"]["wall_s"],
            "rows_speedup": out["spec"]["wall_s"] / out["spec_rows"]["wall_s"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="pretrain_target.py workdir")
    ap.add_argument("--drafter", required=True, help="drafter workdir trained against it")
    ap.add_argument("--prompts", type=int, default=8, help="train prompts of the RL task")
    ap.add_argument("--generations", type=int, default=4, help="samples per prompt (GRPO's G)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-length", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--problem-seed", type=int, default=1234, help="the RL study's split")
    ap.add_argument("--out", default="benchmarks/results/rl_rollout_speed.json")
    ap.add_argument("--prefill-buckets", default="",
                    help="comma-separated prompt chunk sizes for the engines (default: the study's)")
    ap.add_argument("--quick", action="store_true", help="2 prompts x 2, 8 tokens, one rep")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.generations, args.new_tokens, args.reps = 2, 2, 8, 1
    import ml_collections

    from experiments.rl import build_target
    from specjax.rl import task as T
    from specjax.training.drafter_run import load_drafter
    model, tok = build_target(ml_collections.ConfigDict(dict(
        target_workdir=args.target, preset="", seed=0, data_dir="")))
    drafter, dparams, dtask = load_drafter(args.drafter)
    train, _ = T.split_problems(args.problem_seed, 2000, 200)
    # as the study's rollouts see them: [EOS] + the prompt text's tokens, G copies of each prompt
    prompts = [[tok.eos_id] + tok.encode(q.prompt) for q in train[:args.prompts]
               for _ in range(args.generations)]
    r = measure(model, drafter, dparams, prompts, eos_id=tok.eos_id,
                gamma=dtask.gamma, new_tokens=args.new_tokens,
                max_prompt_length=args.max_prompt_length, temperature=args.temperature,
                reps=args.reps,
                prefill_buckets=[int(b) for b in args.prefill_buckets.split(",")]
                if args.prefill_buckets else None)
    r = {"machine": {"cpu": cpu_model() or platform.processor() or platform.machine(),
                     "cores": os.cpu_count(),
                     "backend": jax.default_backend()},
         "config": portable_values(vars(args)), "argv": portable_argv(sys.argv[1:]),
         "target_params": model.config.num_params(), **r}
    dump_json(args.out, r)
    d = r["decoders"]
    print(f"{r['sequences']} sequences; tokens/s: " + ", ".join(
        f"{n} {d[n]['tokens_per_s']:.0f}" for n in d))
    print(f"spec: τ {d['spec']['tau']:.2f}, {d['spec']['speedup']:.2f}x of {r['baseline']} "
          f"(bound {r['bound']:.2f}x, measured / bound {r['measured_over_bound']:.2f}); "
          f"with the filters compiled in: {d['spec_filters']['speedup']:.2f}x; with row buckets: "
          f"{d['spec_rows']['speedup']:.2f}x ({r['rows_speedup']:.2f}x the engine without)")


if __name__ == "__main__":
    main()
