r"""TPU pre-flight: compile a training config's programs for a TPU topology, on any machine.

Per compiled program it writes per-chip memory (arguments, outputs, temporaries, against the chip's
HBM), FLOPs and bytes, a roofline step time and, for training, an MFU estimate (see
:mod:`specjax.aot.compile` for what each number means), as JSON and a markdown table::

    python -m experiments.tpu_plan --config experiments/configs/tpu_pod.py:qwen3-8b,mtp,v5p-64 \
        --topology v5p-64 --out plan
    python -m experiments.tpu_plan --config experiments/configs/pretrain_target.py \
        --config.model.preset qwen3-0.6b --topology v5e:2x2 --programs train

``--programs`` picks from ``train`` (the config's train step: LM or drafter), ``engine`` (the serving
engine's draft / verification / prefill steps and its device loop, for the config's target and
drafter, tensor-parallel over ``gcd(chips, KV heads)`` chips, replicated over the rest; or one kind
of them: ``engine.draft``, ``engine.verify``, ``engine.prefill``, ``engine.loop``) and
``rejection`` (the Pallas rejection sampler: the single-pass kernel, and the two-phase one where
the vocabulary is a multiple of 128). ``--fit`` halves the sequence of a train step that
does not fit until one does (at most ``--fit_tries`` times) and reports every attempt.
``--explain_memory`` also prints, per program, what is alive at its memory peak, grouped by the
op it comes from and its shape (:mod:`specjax.aot.peak`; ``notes.peak_live`` in the JSON), and
``--xla_option NAME=VALUE`` (repeatable) compiles with a compiler option, as ``LIBTPU_INIT_ARGS``
would set it on the TPU VM::

    python -m experiments.tpu_plan --config experiments/configs/tpu_pod.py:qwen3-8b,mtp,v5e-8,4096 \
        --topology v5e-8 --explain_memory --out plan \
        --xla_option xla_tpu_enable_latency_hiding_scheduler=false

``--table`` compiles the documented grid instead (Qwen3-0.6B / 4B / 8B targets x MTP / DSpark
drafters x v5e-8 / v5e-256 / v5p-64 / v6e-16, configs of ``experiments/configs/tpu_pod.py``), the
table of docs/TPU.md: each row from 4096 tokens per row, halved until it fits (down to 512), at
the pod config's 256 x 4096 tokens per step (twice the rows at half the sequence). With
``--recount_model_flops`` it compiles nothing: it counts the model FLOPs of the rows already in
``--out``'s ``table.json`` again (after a change to the formulas) and derives their roofline and
MFU from them, the compiled numbers kept.

Needs libtpu (``make libtpu``); the compilation runs on the CPU.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

# The compiler runs on the CPU: never let JAX try to start a TPU backend with the libtpu that
# specjax.aot points TPU_LIBRARY_PATH at.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags

from experiments.config_flag import define_config_flag

_CONFIG = define_config_flag("Training config file[:arg].")
_TOPOLOGY = flags.DEFINE_string("topology", "v5p-64", "Topology (v5p:4x4x4) or slice (v5e-8).")
# --programs: "engine" compiles every engine device step, one of ENGINE_STEPS that kind only
ENGINE_STEPS = ("engine.draft", "engine.verify", "engine.prefill", "engine.loop")
_PROGRAMS = flags.DEFINE_list(
    "programs", ["train"], f"train, engine, rejection, or one kind of engine step: "
    f"{', '.join(ENGINE_STEPS)}.")
_OUT = flags.DEFINE_string("out", "tpu_plan", "Output directory (plan.json, plan.md).")
_FIT = flags.DEFINE_bool("fit", False, "Halve the sequence of a train step until it fits.")
_FIT_TRIES = flags.DEFINE_integer("fit_tries", 2, "Most halvings with --fit.")
_TABLE = flags.DEFINE_bool("table", False, "Compile the docs/TPU.md grid (ignores --config).")
_RECOUNT = flags.DEFINE_bool(
    "recount_model_flops", False, "With --table: derive the model FLOPs, roofline and MFU of the "
    "rows of --out/table.json again from the current formulas, without compiling.")
_SLOTS = flags.DEFINE_integer("engine_slots", 64, "Engine slots S.")
_MAX_LEN = flags.DEFINE_integer("engine_max_len", 4096, "Engine cache length per slot.")
_FLOPS_CONTEXT = flags.DEFINE_integer(
    "engine_flops_context", 0, "Cached positions each query attends to in the engine programs' "
    "model FLOPs (MFU); 0: half of --engine_max_len.")
_EXPLAIN = flags.DEFINE_bool("explain_memory", False, "Report what is alive at each program's "
                             "memory peak (from a dump of the compilation; a few seconds more).")
_XLA_OPTIONS = flags.DEFINE_multi_string(
    "xla_option", [], "NAME=VALUE compiler option for every program (repeatable), as "
    "LIBTPU_INIT_ARGS would set it on a TPU VM, e.g. "
    "xla_tpu_enable_latency_hiding_scheduler=false.")
_BUCKETS = flags.DEFINE_list("engine_buckets", [], "Verification token buckets (default: S and "
                             "S * (gamma + 1)).")

TABLE_TARGETS = ("qwen3-0.6b", "qwen3-4b", "qwen3-8b")
TABLE_DRAFTERS = ("mtp", "dspark")


def _gib(x) -> str:
    return f"{x / 2**30:.1f}"


def markdown(rows: list[dict]) -> str:
    """One line per compiled program (the columns of docs/TPU.md)."""
    head = ("| program | model | topology (devices) | mesh | batch x seq (accum) | args GiB | "
            "temps GiB | used / HBM GiB | fits | TFLOP/chip | GB/chip | roofline s | bound | "
            "MFU | compile s |")
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        s = r["shapes"]
        mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items() if v > 1) or "1"
        if "seq" in s:
            shape = f"{s['batch']} x {s['seq']}" + (f" ({s['grad_accum']})"
                                                    if s.get("grad_accum", 1) > 1 else "")
        elif "bucket" in s:
            shape = f"{s['slots']} slots, N={s['bucket']}"
        elif "chunk" in s:
            shape = f"{s['slots']} x {s['chunk']}"
        elif "vocab" in s:
            shape = f"B={s['batch']} K={s['gamma']} V={s['vocab']}"
        else:
            shape = f"{s.get('slots', '')} slots"
        mfu = "" if r.get("mfu") is None else f"{100 * r['mfu']:.0f}%"
        fits = "yes" if r["fits"] else ("no" if r["compiled"] else "no (refused)")
        lines.append(
            f"| {r['name']} | {s.get('model', '')} | {r['topology']} ({r['num_devices']}) | {mesh} "
            f"| {shape} | {_gib(r['argument_bytes'])} | {_gib(r['temp_bytes'])} | "
            f"{_gib(r['used_bytes'])} / {_gib(r['hbm_bytes'])} | {fits} | "
            f"{r['flops'] / 1e12:.2f} | {r['bytes_accessed'] / 1e9:.1f} | "
            f"{r['roofline_seconds']:.3g} | {r['bound']} | {mfu} | {r['compile_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def _show(report, label: str = "") -> None:
    """Prints a program's line (``label``, default its name: fits or not, memory, compile time)
    and its pre-flight notes: the FSDP tile warning, what its loops add to the compiler's FLOPs,
    and the memory breakdown (or, for a program that does not fit, how to get one)."""
    from specjax.aot import format_breakdown
    print(f"  {label or report.name}: {'fits' if report.fits else 'does NOT fit'} "
          f"({report.used_bytes / 2**30:.1f} of {report.hbm_bytes / 2**30:.1f} GiB) "
          f"[{report.compile_seconds:.0f}s]", flush=True)
    if report.notes.get("warning"):
        print(f"    note: {report.notes['warning']}", flush=True)
    line = _loops_line(report)
    if line:
        print(line, flush=True)
    if "peak_live" in report.notes:
        live = report.notes["peak_live"]
        print(format_breakdown(live) if live else
              "    alive at the peak: no live-range peak in the compiler's dump", flush=True)
    elif not report.fits:
        print("    note: --explain_memory lists what is alive at the memory peak", flush=True)


def _loops_line(report) -> str:
    """What the loops add to the compiler's FLOPs (it counts each loop body once), or ``""`` for
    a program without matmuls in loops."""
    loops = report.notes.get("loops") or {}
    if "costliest" not in loops or not (loops["costliest"] or loops["unknown_trip_loops"]):
        return ""  # no loop with matmuls in it, none of unknown length
    ratio = ""
    if report.model_flops:
        ratio = (f" = {report.loop_flops / report.model_flops:.2f}x model FLOPs (cost "
                 f"analysis: {report.flops / report.model_flops:.2f}x)")
    top = ", ".join(f"{c['name']} x {c['trips']}" for c in loops["costliest"][:3])
    unknown = (f"; {loops['unknown_trip_loops']} with a trip count the HLO does not show, "
               f"counted once" if loops["unknown_trip_loops"] else "")
    total = loops["matmul_flops"]
    sources = ", ".join(f"{s['source'] or '?'} {100 * s['matmul_flops'] / total:.0f}%"
                        for s in loops.get("by_source", [])[:4]) if total else ""
    return (f"    loops: {report.loop_flops / 1e12:.3g} TFLOP per chip with every trip{ratio}; "
            f"matmuls in loops: {top or 'none'}{unknown}"
            + (f"\n    matmul FLOPs by source line: {sources}" if sources else ""))


def _train_reports(config, topology: str, fit: bool, tries: int, compile_kw: dict) -> list:
    from specjax import aot
    reports = []
    cfg = config
    for attempt in range(tries + 1 if fit else 1):
        mesh = aot.topology_mesh(topology, cfg.mesh.to_dict())
        report = aot.compile_program(aot.train_step(cfg, mesh), mesh, topology, **compile_kw)
        report.shapes["model"] = cfg.model.preset
        reports.append(report)
        _show(report, f"{report.name} {cfg.model.preset} {cfg.data.batch_size}x{cfg.data.seq_len}")
        if report.fits or cfg.data.seq_len <= 256:
            break
        cfg = cfg.copy_and_resolve_references()
        cfg.unlock()
        cfg.data.seq_len //= 2
        cfg.lock()
    return reports


def plan(config, topology: str, programs, *, fit=False, tries=2, slots=64, max_len=4096,
         buckets=None, explain=False, xla_options=None, flops_context=None) -> list:
    """Compiles the requested programs of ``config`` for ``topology``; returns report dicts.

    ``flops_context``: the engine programs' model FLOPs attend to this many cached positions
    (``EngineShapes.flops_context``; None: half of ``max_len``).

    ``explain``: also report what is alive at each program's memory peak (``--explain_memory``);
    ``xla_options``: compiler options for every program (``--xla_option``).
    """
    compile_kw = dict(explain_memory=explain, compiler_options=xla_options)
    from specjax import aot
    from specjax.training.lm_task import model_config_from
    reports = []
    if "train" in programs:
        reports += _train_reports(config, topology, fit, tries, compile_kw)
    target = model_config_from(config)
    engine = [p for p in programs if p == "engine" or p in ENGINE_STEPS]
    if engine:
        if config.task.name != "drafter":
            raise ValueError("--programs engine needs a drafter config (config.task.name)")
        n = len(aot.topology_devices(topology))
        tp = math.gcd(n, target.num_kv_heads)
        mesh = aot.topology_mesh(topology, {"data": n // tp, "fsdp": 1, "tensor": tp})
        gamma = config.task.gamma
        shapes = aot.EngineShapes(num_slots=slots, max_len=max_len, gamma=gamma,
                                  buckets=tuple(buckets or (slots, slots * (gamma + 1))),
                                  prefill_chunk=256, flops_context=flops_context)
        for p in aot.engine_steps(target, config.task, mesh, shapes):
            # "engine": every device step; "engine.prefill" (.draft, .verify, .loop): those only
            if "engine" not in engine and p.name.split("[")[0] not in engine:
                continue
            p.shapes["model"] = config.model.preset
            reports.append(aot.compile_program(p, mesh, topology, **compile_kw))
            _show(reports[-1])
    if "rejection" in programs:
        n = len(aot.topology_devices(topology))
        mesh = aot.topology_mesh(topology, {"data": -1})
        gamma = config.task.gamma if config.task.name == "drafter" else 4
        from pallas_kernels.rejection_sampling import compiled_backends
        # The single-pass kernel, and the two-phase one (one row per batch row; V % 128 == 0).
        for backend in compiled_backends("tpu", target.vocab_size):
            p = aot.rejection_kernel(mesh, batch=n * max(1, slots // n), gamma=gamma,
                                     vocab=target.vocab_size, backend=backend)
            reports.append(aot.compile_program(p, mesh, topology, **compile_kw))
            _show(reports[-1])
    return [r.to_dict() for r in reports]


def table(out: str, **plan_kw) -> list:
    """The docs/TPU.md grid (see the module docstring); rewrites ``out/table.*`` after each row.

    ``plan_kw``: ``explain`` / ``xla_options`` for every row (see :func:`plan`).
    """
    from experiments.configs.tpu_pod import TABLE_SLICES, get_config, table_sequences
    rows, errors = [], []
    os.makedirs(out, exist_ok=True)
    for slice_name in TABLE_SLICES:
        for target in reversed(TABLE_TARGETS):
            for drafter in TABLE_DRAFTERS:
                # From 4096 tokens per row on every slice, halved until the step fits; each try
                # is the pod config at that sequence (the same tokens per step).
                try:
                    for seq in table_sequences():
                        config = get_config(f"{target},{drafter},{slice_name},{seq}")
                        rows += plan(config, slice_name, ["train"], **plan_kw)
                        if rows[-1]["fits"]:
                            break
                except Exception as e:  # noqa: BLE001 - record it, compile the other rows
                    errors.append({"target": target, "drafter": drafter, "slice": slice_name,
                                   "error": f"{type(e).__name__}: {e}"[:2000]})
                    print(f"  ERROR {target} {drafter} {slice_name}: {errors[-1]['error'][:300]}")
                    with open(os.path.join(out, "table_errors.json"), "w") as f:
                        json.dump(errors, f, indent=1)
                _write(rows, out, "table")
    return rows


def recount_table(out: str) -> list:
    """``out/table.json``'s rows with their model FLOPs counted again by the current formulas
    (:func:`specjax.aot.recount_model_flops`: roofline, bound and MFU follow; the compiled
    numbers stay). Each row's program is built again from the pod config of its target, drafter,
    slice and sequence, not compiled, and must have the row's name and shapes."""
    from experiments.configs.tpu_pod import TABLE_SLICES, get_config
    from specjax import aot
    slices = {aot.topology_name(s): s for s in TABLE_SLICES}
    with open(os.path.join(out, "table.json")) as f:
        rows = json.load(f)
    recounted = []
    for row in rows:
        sh = row["shapes"]
        config = get_config(f"{sh['model']},{sh['drafter']},{slices[row['topology']]},{sh['seq']}")
        mesh = aot.topology_mesh(row["topology"], config.mesh.to_dict())
        program = aot.train_step(config, mesh)
        # a setting added since the row was compiled must be off (0) in it: the row ran without
        added = [program.shapes[k] for k in program.shapes if k not in sh]
        if program.name != row["name"] or any(added) or \
                any(program.shapes.get(k) != v for k, v in sh.items()):
            raise ValueError(f"{row['name']} {sh}: the pod config now builds {program.name} "
                             f"{program.shapes}; compile the table again")
        recounted.append(aot.recount_model_flops(row, program.model_flops / row["num_devices"]))
        before, now = row.get("mfu") or 0.0, recounted[-1]["mfu"] or 0.0
        print(f"  {row['name']} {sh['model']} {row['topology']} {sh['seq']}: model FLOPs "
              f"x{recounted[-1]['model_flops'] / row['model_flops']:.3f}, MFU "
              f"{100 * before:.0f}% -> {100 * now:.0f}%")
    return recounted


def _write(rows: list, out: str, stem: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(rows, f, indent=1, sort_keys=True)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(markdown(rows))
    print(f"wrote {out}/{stem}.json and {stem}.md")


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from specjax.aot import LibtpuMissing, without_persistent_cache
    from specjax.compiler_options import parse_compiler_options
    without_persistent_cache()  # TPU executables cannot be read back on this machine
    start = time.time()
    try:
        xla_options = parse_compiler_options(_XLA_OPTIONS.value)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    try:
        if _RECOUNT.value and not _TABLE.value:
            raise app.UsageError("--recount_model_flops works on --table's output")
        if _RECOUNT.value and not os.path.exists(os.path.join(_OUT.value, "table.json")):
            raise app.UsageError(f"--recount_model_flops: no table.json in --out {_OUT.value} "
                                 f"(write one with --table first)")
        if _TABLE.value:
            rows = (recount_table(_OUT.value) if _RECOUNT.value else
                    table(_OUT.value, explain=_EXPLAIN.value, xla_options=xla_options))
            stem = "table"
        else:
            if _CONFIG.value is None:
                raise app.UsageError("--config is required (or --table)")
            from specjax.aot import topology_name
            try:
                topology_name(_TOPOLOGY.value)
            except ValueError as e:
                raise app.UsageError(f"--topology: {e}") from None
            bad = set(_PROGRAMS.value) - {"train", "engine", "rejection", *ENGINE_STEPS}
            if bad:
                raise app.UsageError(f"unknown --programs {sorted(bad)}")
            if not 0 <= _FLOPS_CONTEXT.value <= _MAX_LEN.value:
                raise app.UsageError(f"--engine_flops_context must be in 0..--engine_max_len "
                                     f"({_MAX_LEN.value}), got {_FLOPS_CONTEXT.value}")
            rows = plan(_CONFIG.value, _TOPOLOGY.value, _PROGRAMS.value, fit=_FIT.value,
                        tries=_FIT_TRIES.value, slots=_SLOTS.value, max_len=_MAX_LEN.value,
                        buckets=[int(b) for b in _BUCKETS.value] or None,
                        explain=_EXPLAIN.value,
                        xla_options=xla_options,
                        flops_context=_FLOPS_CONTEXT.value or None)
            stem = "plan"
    except LibtpuMissing as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    _write(rows, _OUT.value, stem)
    print(markdown(rows))
    print(f"total {time.time() - start:.0f}s")


if __name__ == "__main__":
    app.run(main)
