"""Speculative decoding against the fastest plain decoder: same weights, same max_len, same run.

For each held-out domain (math / code / prose), batch B and temperature T, it times (wall, after a
warm-up run; median of ``--reps`` runs, prefill included for every decoder):

* ``generate_host``: :func:`specjax.models.generate.generate` with ``loop="host"`` (one dispatch
  per token: the classic decoder, the reference for the device loop's gain);
* ``generate``: the same with ``loop="device"`` (one ``lax.while_loop``);
* ``engine_none``: the engine's device loop with policy "none" (plain decoding);
* ``spec:<drafter>``: the engine's device loop with each trained drafter and policy.

The baseline of every speed-up is the fastest plain decoder of that cell (``generate`` or
``engine_none``), measured in the same run. Each speculative cell also gets the analytic
prediction ``τ · t_plain / (t_draft + t_verify(B·(K+1)))`` from its measured τ (tokens per slot
step) and a plain decode step, a draft step and a verification step each timed on its own inside
a jitted ``fori_loop`` at the cell's mid-generation context and temperature, and the measured /
predicted ratio.

Run (after ``make quickstart``, which trains the target and the MTP head)::

    python -m benchmarks.spec_vs_plain --target runs/target --drafter mtp=runs/mtp \\
        --drafter dspark=runs/dspark --out benchmarks/results/spec_vs_plain.json
    python -m benchmarks.spec_vs_plain --quick ...     # one cell, one rep (smoke run)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np

from specjax.paths import dump_json, portable_argv, portable_values

PLAIN = ("generate_host", "generate", "engine_none")


def _prompts(tok, domain: str, n: int, prompt_len: int) -> list[list[int]]:
    from specjax.data.corpus import load_corpus
    docs = load_corpus(domain, "heldout")
    out = []
    for d in docs:
        ids = tok.encode(d)
        if len(ids) >= prompt_len + 8:
            out.append([tok.eos_id] + ids[:prompt_len - 1])
        if len(out) == n:
            break
    while len(out) < n:  # short held-out splits: reuse prompts (other seeds at T > 0)
        out.append(out[len(out) % max(1, len(out))])
    return out


def _median_time(fn, reps: int) -> tuple[float, object]:
    fn()  # warm-up (compiles)
    times, last = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        last = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), last


def _engine(target, drafter, params, frozen, *, slots, gamma, policy, k, max_len):
    from specjax.engine import Engine, EngineConfig
    from specjax.scheduling import SchedulerConfig
    cfg = EngineConfig(num_slots=slots, max_len=max_len, gamma=gamma, filters=False,
                       prefill_buckets=(64,), loop="device", loop_steps=64,
                       scheduler=SchedulerConfig(policy, k=k))
    eng = Engine(target, drafter, params, frozen, cfg)
    eng.warmup(profile=policy in ("dspark", "production"))
    return eng


def _run_engine(eng, prompts, new_tokens, temperature):
    from specjax.engine import Request
    eng.loop_stats.clear()
    res = eng.generate([Request(prompt=p, max_new_tokens=new_tokens, temperature=temperature,
                                seed=i) for i, p in enumerate(prompts)])
    return res


def _step_costs(eng, reps: int, context: int, temperature: float, n: int = 64) -> dict:
    """The pieces of a speculative step and a plain decode step, each timed inside a device loop
    at a fixed context of ``context`` positions per slot and every slot at ``temperature``: the
    draft step, the verification of a full fixed-K batch (its bucket's read-only forward, then
    rejection sampling and the target and drafter commits, as the device loop runs them) and one
    plain decode step (the target forward and the same sampling as the engine's plain step).

    The draft and verification steps are the engine's profiled steps
    (:func:`specjax.engine.step_costs.profile_steps`): weights, drafts, lengths and sampling travel
    in the loop's carry, so XLA can neither fold them as constants nor drop a commit whose result
    is unused (``tests/test_production_plain.py`` checks those programs' flops)."""
    import jax.numpy as jnp
    from specjax.engine.device_loop import plain_step, init_loop_state
    from specjax.engine.step_costs import loop_time, profile_steps
    s, g = eng.config.num_slots, eng.config.gamma
    k = min(eng.config.scheduler.k, g)
    bucket = next(b for b in eng.buckets if b >= s * (k + 1))
    fns, carries = profile_steps(eng, context)
    sampling = eng._sampling()._replace(temperature=jnp.full((s,), temperature, jnp.float32))

    def carry(name: str, **aux):
        st, ax = carries[name]
        return st, ax._replace(sampling=sampling, **aux)

    every_slot = init_loop_state(carries["plain"][0], s, g, g + 1)._replace(
        active=jnp.ones((s,), bool))

    def plain(i, c):
        # the device loop's plain step as `none` runs it: no drafter to keep up to date
        st, ax = c
        dev, _ = plain_step(eng.graphdef, ax.weights[0], every_slot._replace(dev=st),
                             ax.sampling, ax.keys)
        return dev._replace(cache=dev.cache.rollback(ax.lengths)), ax

    full_k = carry(f"verify/{bucket}", num_draft=jnp.full((s,), k, jnp.int32))
    return {"draft_s": loop_time(fns["draft"], carry("draft"), reps, n),
            "verify_s": loop_time(fns[f"verify/{bucket}"], full_k, reps, n),
            "plain_s": loop_time(plain, carry("plain"), reps, n),
            "bucket": bucket, "k": k, "context": context, "temperature": temperature,
            "iterations": n}


def run(args, on_cell=None) -> dict:
    """Measures every (batch, domain, temperature) cell; ``on_cell(out)`` is called after each one
    (``main`` writes the partial JSON there, so that a run stopped by a time limit keeps its cells)."""
    from flax import nnx

    from experiments.offline_eval import load_trained
    from experiments.reproduce_steps import load_target_run
    from specjax.drafters import NGramDrafter
    from specjax.models.generate import generate_timed
    tcfg, (graphdef, tparams), tok = load_target_run(args.target)
    model = nnx.merge(graphdef, tparams)
    target = nnx.split(model)
    drafters = {}
    for spec in args.drafter:
        name, path = spec.split("=", 1)
        drafters[name] = load_trained(path, tparams)
    out = {"machine": {"cpu": platform.processor() or platform.machine(),
                       "cores": os.cpu_count(), "backend": jax.default_backend()},
           "config": portable_values({k: v for k, v in vars(args).items() if k != "drafter"}),
           "drafters": {n: {"gamma": int(d[3]), "type": type(d[0]).__name__}
                        for n, d in drafters.items()},
           "target_params": tcfg.num_params(), "cells": []}
    max_len = args.max_len
    for b in args.batch:
        # plain decoding never drafts: the cheapest drafter keeps its prefill out of the timing
        engines = {"engine_none": _engine(target, NGramDrafter(tcfg.vocab_size), None, None,
                                          slots=b, gamma=1, policy="none", k=0, max_len=max_len)}
        for name, (d, p, f, gamma) in drafters.items():
            for policy in args.policies:
                engines[f"spec:{name}:{policy}"] = _engine(
                    target, d, p, f, slots=b, gamma=gamma, policy=policy,
                    k=min(args.k, gamma), max_len=max_len)
        context = args.prompt_len + args.new_tokens // 2
        costs = {(n, t): _step_costs(e, args.reps, context, t) for n, e in engines.items()
                 if n.startswith("spec:") for t in args.temperatures}
        for domain in args.domains:
            prompts = _prompts(tok, domain, b, args.prompt_len)
            for temp in args.temperatures:
                cell = {"domain": domain, "batch": b, "temperature": temp, "decoders": {}}
                for loop in ("host", "device"):
                    name = "generate" if loop == "device" else "generate_host"
                    t, r = _median_time(lambda: generate_timed(
                        model, prompts, args.new_tokens, temperature=temp, max_len=max_len,
                        loop=loop, seed=1), args.reps)
                    n_tok = r.num_generated
                    cell["decoders"][name] = {"wall_s": t, "tokens": n_tok,
                                              "tokens_per_s": n_tok / t,
                                              "step_s": t / max(1, r.decode_steps + 1)}
                for name, eng in engines.items():
                    t, res = _median_time(lambda: _run_engine(eng, prompts, args.new_tokens,
                                                              temp), args.reps)
                    n_tok = sum(len(r.tokens) for r in res)
                    steps = sum(s.steps for s in eng.loop_stats)
                    slot_steps = sum(r.steps for r in res)
                    drafted = np.sum([s.drafted for s in eng.loop_stats], axis=0)
                    accepted = np.sum([s.accepted for s in eng.loop_stats], axis=0)
                    reached = np.sum([s.reached for s in eng.loop_stats], axis=0)
                    entry = {"wall_s": t, "tokens": n_tok, "tokens_per_s": n_tok / t,
                             "steps": steps, "step_s": t / max(1, steps),
                             "tau": (n_tok - len(res)) / max(1, slot_steps)}
                    if name.startswith("spec:"):
                        entry["acceptance_per_position"] = (
                            accepted / np.maximum(drafted, 1)).tolist()  # survival of 1..k
                        entry["alpha_per_position"] = (  # conditional α_k
                            accepted / np.maximum(reached, 1)).tolist()
                        entry["step_costs"] = costs[(name, temp)]
                    cell["decoders"][name] = entry
                _speedups(cell)
                out["cells"].append(cell)
                print(_line(cell), flush=True)
                if on_cell is not None:
                    on_cell(out)
    out["_model"], out["_tok"] = model, tok  # for the max_len sweep (not serialised)
    return out


def max_len_sweep(model, target, tok, args) -> list[dict]:
    """Plain decoders' time per step at fixed context (``--prompt-len`` + ``--new-tokens``) while
    ``max_len`` grows: attention must follow the context, not the cache size."""
    from specjax.drafters import NGramDrafter
    from specjax.models.generate import generate_timed
    rows = []
    for b in args.batch:
        prompts = _prompts(tok, "math", b, args.prompt_len)
        for max_len in args.sweep_max_len:
            t_gen, r = _median_time(lambda: generate_timed(
                model, prompts, args.new_tokens, temperature=0.0, max_len=max_len), args.reps)
            eng = _engine(target, NGramDrafter(model.config.vocab_size), None, None, slots=b,
                          gamma=1, policy="none", k=0, max_len=max_len)
            t_eng, _ = _median_time(lambda: _run_engine(eng, prompts, args.new_tokens, 0.0),
                                    args.reps)
            rows.append({"batch": b, "max_len": max_len,
                         "generate_step_s": t_gen / args.new_tokens,
                         "engine_none_step_s": t_eng / args.new_tokens})
            print(f"max_len sweep B={b} L={max_len}: generate {1e3 * rows[-1]['generate_step_s']:.2f}"
                  f" ms/step, engine none {1e3 * rows[-1]['engine_none_step_s']:.2f} ms/step",
                  flush=True)
    return rows


def _speedups(cell: dict) -> None:
    """Adds the fastest plain decoder and, per speculative decoder, speed-up and prediction."""
    dec = cell["decoders"]
    best = max(("generate", "engine_none"), key=lambda n: dec[n]["tokens_per_s"])
    cell["baseline"] = best
    base = dec[best]
    cell["device_loop_vs_host_loop"] = dec["generate"]["tokens_per_s"] / \
        dec["generate_host"]["tokens_per_s"]
    cell["engine_none_vs_fastest"] = dec["engine_none"]["tokens_per_s"] / base["tokens_per_s"]
    for name, e in dec.items():
        if not name.startswith("spec:"):
            continue
        e["speedup"] = e["tokens_per_s"] / base["tokens_per_s"]
        c = e["step_costs"]
        # τ tokens per speculative step (draft + verify) against one token per plain decode
        # step, all three timed inside a device loop at the same context: the device-side bound
        # (prefill, host calls and the loop's own bookkeeping are left out on both sides).
        e["predicted_speedup"] = e["tau"] * c["plain_s"] / (c["draft_s"] + c["verify_s"])
        e["measured_over_predicted"] = e["speedup"] / e["predicted_speedup"]


def _line(cell: dict) -> str:
    dec = cell["decoders"]
    parts = [f"{cell['domain']:>5} B={cell['batch']:<3} T={cell['temperature']:.0f}",
             f"plain {dec[cell['baseline']]['tokens_per_s']:7.0f} tok/s ({cell['baseline']})",
             f"dev/host {cell['device_loop_vs_host_loop']:.2f}",
             f"none/fastest {cell['engine_none_vs_fastest']:.2f}"]
    for name, e in dec.items():
        if name.startswith("spec:"):
            parts.append(f"{name} {e['speedup']:.2f}x (τ {e['tau']:.2f}, "
                         f"pred {e['predicted_speedup']:.2f})")
    return " | ".join(parts)


def render(res: dict, md_path: str, png_path: str) -> None:
    """The docs table (markdown) and a PNG of speed-ups per cell, from the benchmark JSON."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    specs = sorted({n for c in res["cells"] for n in c["decoders"] if n.startswith("spec:")})
    m = res["machine"]
    lines = [f"Command: `python -m benchmarks.spec_vs_plain {' '.join(res.get('argv', []))}`", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, backend {m['backend']}; target "
             f"{res['target_params'] / 1e6:.2f}M parameters; medians of {res['config']['reps']} "
             f"runs after a warm-up; prompt {res['config']['prompt_len']} tokens, "
             f"{res['config']['new_tokens']} new tokens, max_len {res['config']['max_len']}.", "",
             "| domain | B | T | fastest plain (tok/s) | device / host loop | engine none / fastest | "
             + " | ".join(f"{s} speed-up (τ, predicted, measured/predicted)" for s in specs) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(specs)]
    for c in res["cells"]:
        d = c["decoders"]
        row = [c["domain"], str(c["batch"]), f"{c['temperature']:g}",
               f"{d[c['baseline']]['tokens_per_s']:.0f} ({c['baseline']})",
               f"{c['device_loop_vs_host_loop']:.2f}", f"{c['engine_none_vs_fastest']:.2f}"]
        for s in specs:
            e = d[s]
            row.append(f"**{e['speedup']:.2f}x** ({e['tau']:.2f}, {e['predicted_speedup']:.2f}, "
                       f"{e['measured_over_predicted']:.2f})")
        lines.append("| " + " | ".join(row) + " |")
    with open(md_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(max(6, len(res["cells"]) * 0.5), 3.5))
    labels = [f"{c['domain']}\nB{c['batch']} T{c['temperature']:g}" for c in res["cells"]]
    x = np.arange(len(labels))
    w = 0.8 / max(1, len(specs))
    for i, s in enumerate(specs):
        ax.bar(x + i * w, [c["decoders"][s]["speedup"] for c in res["cells"]], w, label=s)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x + w * (len(specs) - 1) / 2, labels, fontsize=6)
    ax.set_ylabel("speed-up vs fastest plain decoder")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="target training workdir")
    ap.add_argument("--drafter", action="append", required=True, help="name=drafter workdir")
    ap.add_argument("--policies", nargs="+", default=["fixed"])
    ap.add_argument("--k", type=int, default=3, help="K of the fixed policy (capped at γ)")
    ap.add_argument("--domains", nargs="+", default=["math", "code", "prose"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sweep-max-len", type=int, nargs="*", default=[256, 2048],
                    help="max_len values of the fixed-context step-time sweep (none: skip)")
    ap.add_argument("--out", default="benchmarks/results/spec_vs_plain.json")
    ap.add_argument("--md", default="", help="also write the docs table here")
    ap.add_argument("--png", default="", help="also write the speed-up plot here")
    ap.add_argument("--quick", action="store_true", help="one cell, one rep, one max_len in the sweep")
    args = ap.parse_args(argv)
    if args.quick:
        args.domains, args.batch, args.temperatures, args.reps = ["math"], [1], [0.0], 1
        args.new_tokens, args.max_len = 16, 128
        # the sweep's code path once, at the max_len above: its decoders reuse the cell's
        # compiled programs (a second max_len would compile both plain decoders again)
        args.sweep_max_len = [args.max_len]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    cmd = portable_argv(list(argv) if argv is not None else sys.argv[1:])

    def write_partial(out):  # replaced by the complete result at the end
        with open(args.out, "w") as f:
            json.dump({**{k: v for k, v in out.items() if not k.startswith("_")}, "argv": cmd,
                       "partial": True}, f, indent=1)

    res = run(args, on_cell=write_partial)
    if args.sweep_max_len:
        from flax import nnx
        model = res.pop("_model")
        res["max_len_sweep"] = max_len_sweep(model, nnx.split(model), res.pop("_tok"), args)
    res.pop("_model", None), res.pop("_tok", None)
    res["argv"] = cmd
    dump_json(args.out, res)
    print(f"wrote {args.out}")
    if args.md or args.png:
        render(res, args.md or os.devnull, args.png or os.path.splitext(args.out)[0] + ".png")
    return res


if __name__ == "__main__":
    main()
