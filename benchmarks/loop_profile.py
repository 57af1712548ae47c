"""Where the time of a speculative step goes: the engine's device loop traced with the JAX
profiler, the self time of every compiled op summed by the line of JAX code that made it.

The speed-up of speculation is bounded by the cost of its pieces (``benchmarks/spec_vs_plain.py``
times them apart and compares), but the device loop adds its own work around them: the policy,
sampling, emitting tokens, the statistics. This traces real ``Engine.generate`` calls and splits
the loop program's time by source line (``file:line (function)``, the innermost user frame XLA
keeps for each instruction), per engine step, so a slow line is found by name rather than guessed.

How: the run sets ``--xla_dump_to`` for the ``run_loop`` module (the source table of each
instruction comes from the dumped HLO), warms the engine up, then runs ``--reps`` generate calls
inside ``jax.profiler.trace``. Self time = an op's traced duration minus the ops nested in it
(a ``while`` or a conditional contains its body's ops). Host events (dispatch, Python, the
prefill program) are not in it: ``loop_s`` (the traced loop program) against ``wall_s`` (the
calls' wall time) says how much that leaves out. Tracing every op costs time of its own; the
same calls are also timed untraced (``untraced_wall_s_per_call``), so read the shares, not the
absolute milliseconds. Checked on the CPU; on a GPU or TPU the trace has other planes and is
untested here. XLA flags are read when JAX starts its backend, so this must run in a fresh
process (``python -m``), not after other JAX work in the same process.

Run:
    python -m benchmarks.loop_profile --target runs/qs_target --drafter runs/qs_mtp_e2e_tv_ws
    python -m benchmarks.loop_profile --quick     # random tiny target, fresh MTP head (smoke run)
    ... --policy none     # the engine's plain decode loop (what it adds around the target step)
Writes ``--out`` (JSON, default ``benchmarks/results/loop_profile.json``; ``--quick``: a file in
the temp directory) and prints the top ``--top`` lines as a markdown table.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import platform
import statistics
import sys
import tempfile
import time

from specjax.paths import dump_json, portable_values

MODULE = "run_loop"  # the device loop's jitted function (specjax.engine.device_loop.run_loop)


def self_times(events) -> collections.Counter:
    """Self time per name of ``(start, end, name)`` events of one timeline: each event's duration
    less that of the events directly nested in it (a loop body's op inside its ``while``)."""
    totals: collections.Counter = collections.Counter()
    stack: list = []
    for start, end, name in sorted(events, key=lambda ev: (ev[0], -ev[1])):
        while stack and stack[-1][1] <= start:
            stack.pop()
        if stack:
            totals[stack[-1][2]] -= end - start
        totals[name] += end - start
        stack.append((start, end, name))
    return totals


def op_self_times(xplane_path: str, module: str = MODULE) -> dict[str, float]:
    """Seconds of self time per HLO op of the modules whose name contains ``module``, summed over
    the timelines of a profiler trace (``*.xplane.pb``; :func:`self_times` on each)."""
    from jax.profiler import ProfileData

    totals: collections.Counter = collections.Counter()
    for plane in ProfileData.from_file(xplane_path).planes:
        for line in plane.lines:
            events = []
            for e in line.events:
                stats = dict(e.stats)
                if "hlo_op" in stats and module in str(stats.get("hlo_module", "")):
                    events.append((e.start_ns, e.start_ns + e.duration_ns, stats["hlo_op"]))
            totals.update(self_times(events))
    return {op: ns * 1e-9 for op, ns in totals.items()}


def op_table(hlo_text: str) -> tuple[dict[str, str], set[str]]:
    """``(sources, matmuls)`` of a module's text. ``sources``: HLO instruction name ->
    ``"file:line (function)"`` of the JAX code that made it, for every instruction; a fusion
    without a source of its own takes its fused computation's (the last of its instructions that
    has one: the root, mostly); what has none is named by its opcode (``<copy>``; a fusion by its
    root's, ``<fusion of reduce-window>``). ``matmuls``: the instructions that are a ``dot`` or
    ``convolution`` or a fusion holding one."""
    import re

    from specjax.aot.hlo_loops import parse_hlo

    computations, _ = parse_hlo(hlo_text, all_sources=True)
    last = {name: next((i.source for i in reversed(instructions) if i.source), "")
            for name, instructions in computations.items()}
    has_dot = {name for name, instructions in computations.items()
               if any(i.op in ("dot", "convolution") for i in instructions)}
    sources, matmuls = {}, set()
    for instructions in computations.values():
        for ins in instructions:
            called = re.search(r"\bcalls=%([\w.\-]+)", ins.attrs)
            body = computations.get(called.group(1)) if called else None
            sources[ins.name] = (ins.source or (last[called.group(1)] if body else "")
                                 or (f"<{ins.op} of {body[-1].op}>" if body else f"<{ins.op}>"))
            if ins.op in ("dot", "convolution") or (body and called.group(1) in has_dot):
                matmuls.add(ins.name)
    return sources, matmuls


def by_source(times: dict[str, float], sources: dict[str, str]) -> list[tuple[str, float]]:
    """``times`` (per op) summed per source line, largest first; ops missing from ``sources``
    count under their own name."""
    out: collections.Counter = collections.Counter()
    for op, s in times.items():
        out[sources.get(op, op)] += s
    return out.most_common()


def _engine(args):
    """``(engine, prompts)``: a trained target and drafter from workdirs with held-out prompts of
    ``--domain`` (as ``benchmarks/spec_vs_plain.py`` takes them), or (``--quick``) a random tiny
    target with a fresh MTP head and random prompts."""
    import numpy as np
    from flax import nnx

    from specjax.engine import Engine, EngineConfig
    from specjax.scheduling import SchedulerConfig
    if args.quick:
        from specjax.drafters import MTPConfig, MTPDrafter, shared_head
        from specjax.models import get_preset, init_model
        config = get_preset("tiny")
        target = nnx.split(init_model(config, seed=0))
        drafter, params = MTPDrafter.create(config, MTPConfig(shared=True), seed=0)
        frozen, gamma = shared_head(target), args.gamma or 3
        rng = np.random.default_rng(0)
        prompts = [rng.integers(1, config.vocab_size, size=args.prompt_len).tolist()
                   for _ in range(args.batch)]
    else:
        from benchmarks.spec_vs_plain import _prompts
        from experiments.offline_eval import load_trained
        from experiments.reproduce_steps import load_target_run
        _, target, tok = load_target_run(args.target)
        drafter, params, frozen, trained_gamma = load_trained(args.drafter, target[1])
        gamma = args.gamma or trained_gamma
        prompts = _prompts(tok, args.domain, args.batch, args.prompt_len)
    cfg = EngineConfig(num_slots=args.batch, max_len=args.max_len, gamma=gamma, filters=False,
                       prefill_buckets=(64,), loop="device", loop_steps=64,
                       scheduler=SchedulerConfig(args.policy, k=gamma))
    eng = Engine(target, drafter, params, frozen, cfg)
    eng.warmup(profile=False)
    return eng, prompts


def profile(args, dump_dir: str) -> dict:
    import jax

    from specjax.engine import Request

    eng, prompts = _engine(args)

    def call():
        eng.loop_stats.clear()
        t0 = time.perf_counter()
        eng.generate([Request(prompt=p, max_new_tokens=args.new_tokens,
                              temperature=args.temperature, seed=i)
                      for i, p in enumerate(prompts)])
        return time.perf_counter() - t0, sum(s.steps for s in eng.loop_stats), \
            sum(s.tokens for s in eng.loop_stats)

    call()  # warm: every program compiled
    untraced = statistics.median(call()[0] for _ in range(args.reps))
    trace_dir = tempfile.mkdtemp(prefix="specjax_trace_")
    walls, steps, tokens = [], 0, 0
    with jax.profiler.trace(trace_dir):
        for _ in range(args.reps):
            wall, n, t = call()
            walls.append(wall)
            steps, tokens = steps + n, tokens + t
    traces = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    dumps = glob.glob(os.path.join(dump_dir, f"*{MODULE}*after_optimizations.txt"))
    if not traces or not dumps:
        raise RuntimeError(f"no trace ({trace_dir}) or no dumped {MODULE} module ({dump_dir}): "
                           f"was JAX's backend started before XLA_FLAGS was set?")
    times = op_self_times(traces[0])
    sources, matmuls = {}, set()
    for path in dumps:  # each compilation of the loop (one per bucket set / policy)
        with open(path) as f:
            text = f.read()
        module_sources, module_matmuls = op_table(text)
        sources.update(module_sources)
        matmuls |= module_matmuls
    loop_s = sum(times.values())
    rows = [{"source": src, "ms_per_step": s / steps * 1e3, "share": s / loop_s}
            for src, s in by_source(times, sources)]
    return {"machine": {"cpu": platform.processor() or platform.machine(),
                        "cores": os.cpu_count(), "backend": jax.default_backend(),
                        "device_kind": jax.devices()[0].device_kind},
            "config": portable_values({k: v for k, v in vars(args).items() if k != "out"}),
            "steps": steps, "tokens": tokens, "tau": tokens / max(steps, 1) / args.batch,
            "wall_s": sum(walls), "loop_s": loop_s,
            "untraced_wall_s_per_call": untraced,
            "traced_wall_s_per_call": statistics.median(walls),
            # more than one compiled loop (another policy or bucket set in the same run) would
            # share instruction names; one engine compiles one
            "loop_programs": len(dumps),
            "ms_per_step": loop_s / steps * 1e3,
            "matmul_share": sum(t for op, t in times.items() if op in matmuls) / loop_s,
            "rows": rows}


def _print(result: dict, top: int) -> None:
    print(f"\n{result['steps']} loop steps, {result['tokens']} tokens (tau {result['tau']:.2f}); "
          f"loop program {result['loop_s']:.3f} s of {result['wall_s']:.3f} s wall, "
          f"{result['ms_per_step']:.3f} ms per step; a call took "
          f"{result['traced_wall_s_per_call']:.3f} s traced, "
          f"{result['untraced_wall_s_per_call']:.3f} s untraced (the profiler's own cost: read "
          f"shares, not absolute times); matmuls {result['matmul_share']:.0%} of the loop program")
    print("| source | ms per step | share |\n|---|---|---|")
    for r in result["rows"][:top]:
        print(f"| {r['source']} | {r['ms_per_step']:.4f} | {r['share']:.1%} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="target trainer workdir")
    parser.add_argument("--drafter", help="drafter run workdir (experiments.train_drafter)")
    parser.add_argument("--gamma", type=int, default=0, help="drafts per step (default: trained)")
    parser.add_argument("--batch", type=int, default=1, help="engine slots, one request each")
    parser.add_argument("--policy", default="fixed", choices=("fixed", "mtp1", "none"),
                        help="engine policy (fixed: K = gamma; none: the plain decode loop)")
    parser.add_argument("--domain", default="math", help="held-out prompts of this domain")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--reps", type=int, default=3, help="traced generate calls")
    parser.add_argument("--top", type=int, default=25, help="source lines printed")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: random tiny target, fresh MTP head, 16 new tokens, 1 rep")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.new_tokens, args.reps, args.prompt_len, args.max_len = 16, 1, 8, 128
    elif not (args.target and args.drafter):
        parser.error("--target and --drafter are required (or --quick)")
    if args.out is None:
        args.out = (os.path.join(tempfile.gettempdir(), "specjax_quick", "loop_profile.json")
                    if args.quick else "benchmarks/results/loop_profile.json")
    import jax._src.xla_bridge as xb

    from specjax.aot.env import without_persistent_cache
    if xb.backends_are_initialized():
        sys.exit("benchmarks.loop_profile: JAX's backend is already running in this process; "
                 "run it as its own process (python -m benchmarks.loop_profile)")
    # a program loaded from JAX's persistent cache is not compiled, so its HLO is not dumped
    without_persistent_cache()
    dump_dir = tempfile.mkdtemp(prefix="specjax_hlo_")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir} "
                               f"--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*{MODULE}.*")
    result = profile(args, dump_dir)
    _print(result, args.top)
    dump_json(args.out, result)
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
