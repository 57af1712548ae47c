"""Idle slots on a lightly loaded engine: one S-slot engine serving C requests at once, with and
without row buckets, against an engine sized to the load and plain batched decoding.

A server is built once with S slots and then sees whatever load arrives. Without row buckets
every device-loop call computes all S slots and every admission feeds an ``[S, C]`` prompt chunk;
with them (``EngineConfig.row_buckets="auto"``, :mod:`specjax.engine.loop_rows`) a call and an
admission run on the active slots only, padded to a power of two. Per policy ("none": plain
decoding in the engine; "fixed": the MTP head drafting γ tokens, all verified) and load C, the
same C held-out math prompts are served, all submitted at once, by

* ``all_slots``: the S-slot engine, every call on every slot (row buckets off);
* ``row_buckets``: the same S-slot engine with row buckets;
* ``sized``: a C-slot engine (what row buckets try to match: no idle slot at all);
* ``generate``: ``generate(loop="device")`` on the C prompts as one batch (the fastest plain
  decoder in the repo at batch C; no admission, no stop handling);

on the same weights in the same run, timed runs alternating (the order rotates every round),
median of ``--reps`` after a warm-up call. At C = S the two S-slot engines run the same program
(a null control). At temperature 0 all four must emit the same tokens: the JSON says whether
they did. Warm-up (compile) time per S-slot engine is recorded: row buckets compile one more
loop and prefill program per row count.

Run:
    python -m benchmarks.row_buckets --target <quickstart dir>/target-<key> \\
        --drafter <quickstart dir>/mtp_e2e_tv_ws-<key>
    python -m benchmarks.row_buckets --quick     # random tiny target, fresh MTP head (smoke run)
Writes ``--out`` (JSON, default ``benchmarks/results/row_buckets.json``; ``--quick``: a file in
the temp directory) and a PNG beside it, and prints one line per cell.
"""
from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

from benchmarks.timing import alternating_runs, decoder_figures
from specjax.machine import cpu_model
from specjax.paths import dump_json, portable_values

VARIANTS = ("all_slots", "row_buckets", "sized", "generate")


def run(args) -> dict:
    import jax
    from flax import nnx

    from benchmarks.mtp_window import load_models
    from experiments.quickstart import b1_max_len
    from specjax.engine import Request
    from specjax.models.generate import generate_timed
    args.domains = ["math"]
    args.prompts = max(args.loads)
    target, drafter, params, frozen, gamma, prompts = load_models(args)
    prompts = prompts["math"]
    model = nnx.merge(*target)
    max_len = b1_max_len(args.prompt_len, args.new_tokens, gamma)

    def engine(policy: str, slots: int, row_buckets):
        return timed_engine((target, drafter, params, frozen), args, max_len, gamma, policy,
                            num_slots=slots, row_buckets=row_buckets)

    cells, warmup_s = [], {}
    for policy in args.policies:
        big = {}
        for name, rb in (("all_slots", ()), ("row_buckets", "auto")):
            big[name], warmup_s[f"{policy}/{name}"] = engine(policy, args.slots, rb)
        for c in args.loads:
            ps = prompts[:c]
            sized = big["all_slots"] if c == args.slots else engine(policy, c, ())[0]
            engines = {**big, "sized": sized}

            def served(eng):
                def call():
                    res = eng.generate([Request(prompt=p, max_new_tokens=args.new_tokens,
                                                temperature=args.temperature, seed=i)
                                        for i, p in enumerate(ps)])
                    return [list(r.tokens) for r in res], sum(r.steps for r in res)
                return call

            def plain():
                return generate_timed(model, ps, args.new_tokens, temperature=args.temperature,
                                      max_len=max_len, loop="device", seed=0).tokens, None

            calls = {**{n: served(e) for n, e in engines.items()}, "generate": plain}
            outs, times = alternating_runs(calls, args.reps)  # outs: the emitted tokens
            dec = {}
            for n in VARIANTS:
                toks, steps = outs[n]
                dec[n] = decoder_figures(toks, times[n], None if policy == "none" else steps)
            rate = {n: dec[n]["tokens_per_s"] for n in VARIANTS}
            cell = {"policy": policy, "load": c, "decoders": dec,
                    "same_tokens": all([list(t) for t in outs[n][0]] == outs["all_slots"][0]
                                       for n in VARIANTS),
                    # tokens/s ratios, each pair from this run
                    "rows_over_all": rate["row_buckets"] / rate["all_slots"],
                    "rows_over_sized": rate["row_buckets"] / rate["sized"],
                    "rows_over_generate": rate["row_buckets"] / rate["generate"]}
            cells.append(cell)
            print(f"  {policy:>5} C={c:>2}: all slots {rate['all_slots']:6.0f}, row buckets "
                  f"{rate['row_buckets']:6.0f}, sized {rate['sized']:6.0f}, generate "
                  f"{rate['generate']:6.0f} tokens/s; rows / all {cell['rows_over_all']:.2f}x, "
                  f"rows / sized {cell['rows_over_sized']:.2f}x"
                  + ("" if cell["same_tokens"] else "  (tokens differ)"), flush=True)
    return {"machine": {"cpu": cpu_model() or platform.processor() or platform.machine(),
                        "cores": os.cpu_count(), "backend": jax.default_backend(),
                        "device_kind": jax.devices()[0].device_kind},
            "config": portable_values({k: v for k, v in vars(args).items() if k != "out"}),
            "gamma": int(gamma), "max_len": max_len, "warmup_s": warmup_s, "cells": cells}


def timed_engine(models, args, max_len: int, gamma: int, policy: str, *, profile: bool = False,
                 **config):
    """``(engine, warm-up seconds)``: a device-loop engine of ``models`` (target, drafter, params,
    frozen) as the load sweeps build it: prompts prefilled in one ``--prompt_len`` chunk,
    ``--loop_steps`` steps per call, no sampling filters, fixed K = γ (other policies: K unused);
    ``config``: the remaining :class:`~specjax.engine.EngineConfig` fields (slots, row buckets,
    ...). ``profile``: warm-up also times the SPS profiles."""
    from specjax.engine import Engine, EngineConfig
    from specjax.scheduling import SchedulerConfig
    cfg = EngineConfig(max_len=max_len, gamma=gamma, filters=False,
                       prefill_buckets=(args.prompt_len,), loop="device",
                       loop_steps=args.loop_steps,
                       scheduler=SchedulerConfig(policy, k=gamma if policy == "fixed" else 0),
                       **config)
    eng = Engine(*models, cfg)
    t0 = time.perf_counter()
    eng.warmup(profile=profile)
    return eng, time.perf_counter() - t0


def plot_loads(result: dict, path: str, panel_key: str, titles: dict, labels: dict,
               dashed: tuple) -> None:
    """tokens/s against load: one panel per value of each cell's ``panel_key`` (titled
    ``titles[value]``), one line per decoder in ``labels`` (name -> legend), ``dashed`` ones
    dashed (the references). Writes ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = list(dict.fromkeys(c[panel_key] for c in result["cells"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, value in zip(axes[0], panels):
        cells = [c for c in result["cells"] if c[panel_key] == value]
        loads = [c["load"] for c in cells]
        for n, label in labels.items():
            ax.plot(loads, [c["decoders"][n]["tokens_per_s"] for c in cells], marker="o",
                    label=label, linestyle="--" if n in dashed else "-")
        ax.set_xscale("log", base=2)
        ax.set_xticks(loads, [str(x) for x in loads])
        ax.set_xlabel("requests at once (C)")
        ax.set_ylabel("tokens/s")
        ax.set_title(titles[value])
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(result: dict, path: str) -> None:
    """tokens/s against load, one panel per policy, one line per variant."""
    slots = result["config"]["slots"]
    labels = {"all_slots": f"{slots} slots, every call on every slot",
              "row_buckets": f"{slots} slots, row buckets",
              "sized": "engine with C slots", "generate": "generate(), batch C"}
    titles = {p: f'policy "{p}"' for p in ("none", "fixed")}
    plot_loads(result, path, "policy", titles, labels, dashed=("sized", "generate"))


def add_load_args(p: argparse.ArgumentParser) -> None:
    """The flags of a server at loads C: slots, loads, prompt and answer lengths, loop steps per
    call, timed runs and ``--out``."""
    p.add_argument("--slots", type=int, default=32, help="slots of the server's engine (S)")
    p.add_argument("--loads", nargs="+", type=int, default=[1, 2, 4, 8, 32],
                   help="requests served at once (C <= S)")
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--new_tokens", type=int, default=96)
    p.add_argument("--loop_steps", type=int, default=16, help="device-loop steps per call")
    p.add_argument("--reps", type=int, default=5, help="timed runs per variant and cell")
    p.add_argument("--out", default=None)


def check_load_args(p: argparse.ArgumentParser, args) -> None:
    """Usage errors for :func:`add_load_args`' flags; sorts the loads; ``--quick`` shrinks the
    run to a 4-slot engine at loads 1 and 4, 8-token prompts and answers, one timed run."""
    if args.reps < 1 or args.new_tokens < 1 or args.slots < 2:
        p.error("--reps and --new_tokens must be >= 1, --slots >= 2")
    if any(not 1 <= c <= args.slots for c in args.loads):
        p.error(f"--loads must lie in [1, --slots = {args.slots}], got {args.loads}")
    args.loads = sorted(set(args.loads))
    if args.quick:
        args.slots, args.loads, args.new_tokens, args.reps = 4, [1, 4], 8, 1
        args.prompt_len, args.loop_steps = 8, 4


def write_results(args, name: str, result: dict, plot_fn) -> str:
    """``result`` to ``--out`` (default ``benchmarks/results/<name>.json``; ``--quick``: the temp
    directory) and ``plot_fn(result, png)`` beside it. Returns the JSON's path."""
    out = args.out or (
        os.path.join(tempfile.gettempdir(), "specjax_quick", f"{name}.json") if args.quick
        else os.path.join("benchmarks", "results", f"{name}.json"))
    dump_json(out, result)
    png = os.path.splitext(out)[0] + ".png"
    plot_fn(result, png)
    print(f"-> {out}, {png}")
    return out


def main(argv=None) -> dict:
    from benchmarks.mtp_window import add_model_args, check_model_args
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p)
    add_load_args(p)
    p.add_argument("--policies", nargs="+", default=["none", "fixed"],
                   choices=["none", "fixed"])
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args(argv)
    check_model_args(p, args)
    check_load_args(p, args)
    result = run(args)
    write_results(args, "row_buckets", result, plot)
    return result


if __name__ == "__main__":
    main()
