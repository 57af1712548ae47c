r"""Per-chip cost of a training step at one row per chip as the chips grow, before and after each
of the two FSDP fixes in docs/TPU.md. Compiles for TPU on the CPU (needs libtpu, ``make libtpu``).

``--study batch`` (default; "FSDP kept the batch replicated"): 4 and 16 chips, with and without
the batch constraint of ``specjax.models.partitioning``::

    python -m experiments.fsdp_scaling --out experiments/results/tpu/batch_fix/scaling.json

``--study chunk`` ("The TV loss's row chunks"): the MTP + e2e-TV step with the loss's row chunk
before the fix (sized by the vocabulary alone) and after it (a multiple of the mesh's batch
shards); the tiny model at the Qwen3 vocabulary on 4 and 64 chips (the regression test's pair),
and Qwen3-0.6B at one 512-token row per chip on 8, 64, 128 and 256 v5e chips. About ten minutes
on 2 CPU cores::

    python -m experiments.fsdp_scaling --study chunk \
        --out experiments/results/tpu/chunk_fix/scaling.json

``--study tiling``: why the new chunk saves memory even where the old one split evenly. Qwen3-0.6B
+ MTP at one 512-token row per chip on 8 v5e chips (6,144 loss rows: 2,048 anchors x 3 heads) with
the row chunk forced to 48, 64, 96, 128 and 384 rows, i.e. 6, 8, 12, 16 and 48 rows per chip per
loop step (48 is the old rule's chunk there, 384 the new one's). About seven minutes::

    python -m experiments.fsdp_scaling --study tiling \
        --out experiments/results/tpu/chunk_fix/tiling.json

``--study rounding``: would rounding the default chunk to 8 rows per chip pay? The same step
with 200 anchors per row (4,800 loss rows, 600 per chip), where the default chunk is 400 rows (50
per chip, padded to 56 in TPU's (8, 128) tiles) and the largest with a multiple of 8 rows per chip
is 320 (40 per chip); both compiled, forced. About four minutes::

    python -m experiments.fsdp_scaling --study rounding \
        --out experiments/results/tpu/chunk_fix/rounding.json

``--study accum``: Qwen3-4B + MTP needs more memory per chip on v5e-256 (one 4096-token row
per chip, no accumulation) than on v5e-8 (the same microbatch of one row per chip, 32 of them
accumulated). Both on 8 chips: the pod config's 256 x 4096 step (32 microbatches) and an 8 x 4096
step (one microbatch, as every v5e-256 step is). About five minutes::

    python -m experiments.fsdp_scaling --study accum \
        --out experiments/results/tpu/chunk_fix/accum.json

``--study width``: Qwen3-4B and Qwen3-8B + MTP at one 4096-token row per chip on v5e-256, FSDP
over all 256 chips and over 32 (data parallel over the other factor of 8). The pod config's width
(``tpu_pod.fsdp_width``) is 32 for 4B, whose 2560 hidden rows leave 10 per chip over 256 chips,
and 256 for 8B (16 rows each). About nine minutes::

    python -m experiments.fsdp_scaling --study width \
        --out experiments/results/tpu/width/width.json

``--study remat``: what each ``config.train.remat`` policy saves in memory and pays in
recomputation. The Qwen3-0.6B pretraining step (its 151,936-token vocabulary, loss in chunks of
256 positions) at 1 and at 4 rows of 2048 tokens per chip on v5e-8, FSDP over the 8 chips,
under ``none``, ``dots``, ``all_dots`` and ``full``; FLOPs counted with every loop's trips
(``specjax.aot.hlo_loops``). About a quarter of an hour::

    python -m experiments.fsdp_scaling --study remat \
        --out experiments/results/tpu/remat/remat.json

Tiny mode (``--quick``: the constrained ``mtp`` row on 4 chips only, under a minute)::

    python -m experiments.fsdp_scaling --quick --out /tmp/scaling_quick.json

Rows (tiny model, 32,768-token vocabulary, 256 tokens per row, FSDP over every chip):

* ``mtp``: the MTP + e2e-TV drafter step of ``experiments/configs/tpu_pod.py``, every position an
  anchor (the target's full ``[B, T, V]`` logits, its embedding and the drafter's shared head);
* ``lm``: the LM pretraining step of ``experiments/configs/pretrain_target.py``;
* ``remat``: the LM step with the Qwen3 vocabulary (151,936) at 32 x 1024 tokens on 4 chips,
  without remat and with ``remat = full, logits_chunk = 128``.

"Without" lowers the same program inside ``partitioning.unconstrained()``: the code before the fix.
"Old chunk" lowers it inside :func:`old_row_chunk`: the loss's chunk rule before its fix.
"""
from __future__ import annotations

import argparse
import contextlib

from specjax import aot
from specjax.losses import tv as tv_losses
from specjax.models import get_preset, partitioning
from specjax.paths import dump_json

TOPOLOGIES = (("v5e:2x2", 4), ("v5e:4x4", 16))
# --study chunk: (model, topology, chips, vocabulary or None for the model's own)
CHUNK_ROWS = (("tiny", "v5e:2x2", 4, 151936), ("tiny", "v5e:8x8", 64, 151936),
              ("qwen3-0.6b", "v5e:2x4", 8, None), ("qwen3-0.6b", "v5e:8x8", 64, None),
              ("qwen3-0.6b", "v5e:8x16", 128, None), ("qwen3-0.6b", "v5e:16x16", 256, None))


@contextlib.contextmanager
def old_row_chunk():
    """The TV / DSpark loss's default row chunk as it was before the fix: sized by the vocabulary
    alone (``shards = 1``), whatever the mesh (``specjax.losses.tv._rows_per_chunk``)."""
    rule = tv_losses._rows_per_chunk
    tv_losses._rows_per_chunk = lambda n_rows, vocab, chunk_size, shards=1: rule(
        n_rows, vocab, chunk_size, 1)
    try:
        yield
    finally:
        tv_losses._rows_per_chunk = rule


@contextlib.contextmanager
def forced_row_chunk(rows: int):
    """The TV / DSpark loss's row chunk fixed at ``rows`` (a divisor of the loss's rows),
    whatever the vocabulary and the mesh (``specjax.losses.tv._rows_per_chunk``). Yields a list that
    collects the row count of each chunked loss traced inside."""
    rule = tv_losses._rows_per_chunk
    seen = []

    def fixed(n_rows, vocab, chunk_size, shards=1):
        if n_rows % rows:
            raise ValueError(f"a {rows}-row chunk does not divide the loss's {n_rows} rows")
        seen.append(n_rows)
        return rows
    tv_losses._rows_per_chunk = fixed
    try:
        yield seen
    finally:
        tv_losses._rows_per_chunk = rule


def pod_mtp_config(target: str, topology: str, chips: int, seq: int = 512, data: int = 1):
    """``experiments/configs/tpu_pod.py``'s MTP + e2e-TV step for ``target`` at one ``seq``-token
    row per chip and no gradient accumulation, FSDP over ``chips // data`` chips (default: every
    chip, whatever width the pod config picks) and data parallel over ``data``."""
    from experiments.configs.tpu_pod import get_config
    c = get_config(f"{target},mtp,{topology}")
    c.unlock()
    c.data.seq_len, c.data.batch_size, c.train.grad_accum_steps = seq, chips, 1
    c.mesh.data, c.mesh.fsdp = data, -1
    c.lock()
    return c


def mtp_config(topology: str, chips: int, vocab: int = 32768):
    """The tiny MTP + e2e-TV step at one 256-token row per chip (:func:`pod_mtp_config`) with a
    ``vocab``-token vocabulary, every position an anchor."""
    c = pod_mtp_config("tiny", topology, chips, seq=256)
    c.unlock()
    c.model.overrides.vocab_size = vocab
    c.task.anchors_per_row = 256
    c.lock()
    return c


def lm_config(chips: int, *, vocab: int = 32768, seq: int = 256, rows_per_chip: int = 1,
              remat: str = "none", logits_chunk: int = 0):
    """The tiny LM pretraining step, FSDP over every chip."""
    from experiments.configs.pretrain_target import get_config
    c = get_config(None)
    c.unlock()
    c.model.preset = "tiny"
    c.model.overrides.vocab_size = vocab
    c.data.seq_len, c.data.batch_size = seq, chips * rows_per_chip
    c.train.grad_accum_steps, c.train.remat, c.train.logits_chunk = 1, remat, logits_chunk
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.lock()
    return c


def compile_step(config, topology: str, *, constrained: bool = True,
                 old_chunk: bool = False) -> aot.ProgramReport:
    """The trainer's step of ``config`` compiled for ``topology`` (``constrained=False``: the batch
    constraint switched off while tracing; ``old_chunk=True``: the loss's row chunk before its
    fix, :func:`old_row_chunk`)."""
    mesh = aot.topology_mesh(topology, config.mesh.to_dict())
    program = aot.train_step(config, mesh)
    lower = program.lower

    def lower_as_asked():
        with contextlib.ExitStack() as stack:
            if not constrained:
                stack.enter_context(partitioning.unconstrained())
            if old_chunk:
                stack.enter_context(old_row_chunk())
            return lower()
    program.lower = lower_as_asked
    return aot.compile_program(program, mesh, topology)


def _row(name: str, topology: str, chips: int, constrained: bool, r, **extra) -> dict:
    row = {"step": name, "topology": topology, "chips": chips, "constrained": constrained,
           **extra, "compiled": r.compiled, "temp_gib": r.temp_bytes / 2**30,
           "used_gib": r.used_bytes / 2**30, "bytes_accessed_gb": r.bytes_accessed / 1e9}
    if not r.compiled:
        row["error"] = (r.error or "")[:300]
    tags = " ".join(f"{k}={v}" for k, v in extra.items())
    print(f"{name:6s} {topology} ({chips:3d}) constrained={constrained!s:5s} {tags} "
          f"temps {row['temp_gib']:6.2f} GiB, used {row['used_gib']:6.2f} GiB, "
          f"{row['bytes_accessed_gb']:7.2f} GB accessed{'' if r.compiled else ' (refused)'}",
          flush=True)
    return row


def chunk_study(rows_spec=CHUNK_ROWS) -> list:
    """Rows of ``--study chunk``: each ``(model, topology, chips, vocab)`` of ``rows_spec`` with
    the old and the new row chunk, in that order."""
    rows = []
    for model, topology, chips, vocab in rows_spec:
        config = (mtp_config(topology, chips, vocab) if model == "tiny"
                  else pod_mtp_config(model, topology, chips))
        for old in (True, False):
            r = compile_step(config, topology, old_chunk=old)
            rows.append(_row("mtp", topology, chips, True, r, model=model,
                             vocab=vocab or get_preset(model).vocab_size,
                             chunk="old" if old else "new"))
    return rows


TILING_CHUNKS = (48, 64, 96, 128, 384)


def tiling_study(topology: str = "v5e:2x4", chips: int = 8, chunks=TILING_CHUNKS) -> list:
    """Rows of ``--study tiling``: Qwen3-0.6B + MTP at one 512-token row per chip with each row
    chunk of ``chunks`` forced (:func:`forced_row_chunk`)."""
    config = pod_mtp_config("qwen3-0.6b", topology, chips)
    rows = []
    for chunk in chunks:
        with forced_row_chunk(chunk) as loss_rows:  # compile_step lowers inside it
            r = compile_step(config, topology)
        rows.append(_row("mtp", topology, chips, True, r, model="qwen3-0.6b",
                         vocab=get_preset("qwen3-0.6b").vocab_size, chunk_rows=chunk,
                         rows_per_chip=chunk / chips, loss_rows=sorted(set(loss_rows))))
    return rows


def rounding_study(topology: str = "v5e:2x4", chips: int = 8, anchors: int = 200) -> list:
    """Rows of ``--study rounding``: Qwen3-0.6B + MTP at one 512-token row per chip and
    ``anchors`` anchors per row, with the default row chunk and with the largest chunk within the
    same budget whose rows per chip are a multiple of 8, each forced."""
    config = pod_mtp_config("qwen3-0.6b", topology, chips)
    config.unlock()
    config.task.anchors_per_row = anchors
    config.lock()
    vocab = get_preset("qwen3-0.6b").vocab_size
    n = chips * anchors * config.task.gamma  # loss rows: one per anchor and drafted position
    default = tv_losses._rows_per_chunk(n, vocab, None, chips)
    budget = chips * (tv_losses.DEFAULT_CHUNK_ELEMENTS // vocab)
    tiled = next(k for k in range(budget - budget % (8 * chips), 0, -8 * chips) if n % k == 0)
    rows = []
    for name, chunk in (("default", default), ("tiled", tiled)):
        with forced_row_chunk(chunk) as loss_rows:
            r = compile_step(config, topology)
        rows.append(_row("mtp", topology, chips, True, r, model="qwen3-0.6b", vocab=vocab,
                         anchors_per_row=anchors, chunk=name, chunk_rows=chunk,
                         rows_per_chip=chunk / chips, loss_rows=sorted(set(loss_rows))))
    return rows


def accum_study(target: str = "qwen3-4b", topology: str = "v5e:2x4", chips: int = 8,
                seq: int = 4096) -> list:
    """Rows of ``--study accum``: ``target`` + MTP on ``topology`` at one ``seq``-token row per
    chip per microbatch, with the pod config's accumulation and without any."""
    from experiments.configs.tpu_pod import get_config
    pod = get_config(f"{target},mtp,{topology},{seq}")
    rows = []
    for config in (pod, pod_mtp_config(target, topology, chips, seq=seq)):
        r = compile_step(config, topology)
        rows.append(_row("mtp", topology, chips, True, r, model=target, seq=seq,
                         batch=config.data.batch_size,
                         grad_accum_steps=config.train.grad_accum_steps))
    return rows


def width_study(targets=("qwen3-4b", "qwen3-8b"), topology: str = "v5e:16x16", chips: int = 256,
                seq: int = 4096, narrow: int = 32) -> list:
    """Rows of ``--study width``: each ``target`` + MTP at one ``seq``-token row per chip, FSDP
    over every chip and over ``narrow`` chips (data parallel over the rest). Each row names the
    pod config's width (``tpu_pod.fsdp_width``: whole bf16 tiles of the hidden dimension per
    chip) and the hidden rows per chip."""
    from experiments.configs.tpu_pod import fsdp_width
    from specjax.models import get_preset
    rows = []
    for target in targets:
        hidden = get_preset(target).hidden_size
        for fsdp in (chips, narrow):
            r = compile_step(pod_mtp_config(target, topology, chips, seq=seq,
                                            data=chips // fsdp), topology)
            rows.append(_row("mtp", topology, chips, True, r, model=target, seq=seq, fsdp=fsdp,
                             data=chips // fsdp, hidden_per_chip=hidden // fsdp,
                             pod_width=fsdp_width(chips, hidden)))
    return rows


# The remat policies in the order of the table (specjax.training.memory.REMAT_POLICIES).
REMAT_ORDER = ("none", "dots", "all_dots", "full")


def remat_study(model: str = "qwen3-0.6b", topology: str = "v5e:2x4", chips: int = 8,
                rows_per_chip=(1, 4), seq: int = 2048, logits_chunk: int = 256,
                policies=REMAT_ORDER) -> list:
    """Rows of ``--study remat``: the LM pretraining step of ``model`` (its own vocabulary), for
    each of ``rows_per_chip`` rows of ``seq`` tokens per chip and each remat policy, FSDP over
    every chip, the vocabulary loss in chunks of ``logits_chunk`` positions. Each row has the
    memory, the cost analysis' FLOPs, the loop-aware FLOPs (the chunked loss is a loop) and their
    ratio to the model FLOPs: what each policy saves in memory and pays in recomputation."""
    from experiments.configs.pretrain_target import get_config
    rows = []
    for per_chip, remat in ((n, p) for n in rows_per_chip for p in policies):
        c = get_config(None)
        c.unlock()
        c.model.preset, c.model.overrides = model, {}
        c.data.seq_len, c.data.batch_size = seq, chips * per_chip
        c.train.grad_accum_steps, c.train.remat, c.train.logits_chunk = 1, remat, logits_chunk
        c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
        c.lock()
        r = compile_step(c, topology)
        row = _row("lm", topology, chips, True, r, model=model, seq=seq, batch=chips * per_chip,
                   remat=remat, logits_chunk=logits_chunk)
        row.update(fits=r.fits, compile_seconds=r.compile_seconds)
        if r.compiled:
            row.update(flops=r.flops, loop_flops=r.loop_flops, model_flops=r.model_flops,
                       loop_over_model=r.loop_flops / r.model_flops,
                       roofline_seconds=r.roofline_seconds, bound=r.bound, mfu=r.mfu)
            print(f"       loop-aware {r.loop_flops / 1e12:.1f} TFLOP/chip = "
                  f"{row['loop_over_model']:.2f}x model (cost analysis "
                  f"{r.flops / r.model_flops:.2f}x), roofline {r.roofline_seconds:.3g} s "
                  f"({r.bound}), fits: {r.fits}", flush=True)
        rows.append(row)
    return rows


def batch_study(quick: bool = False, vocab: int = 32768) -> list:
    """Rows of ``--study batch``: per constraint setting (without, then with; ``quick``: with
    only), the ``mtp`` (``vocab``-token vocabulary) and ``lm`` steps on each of TOPOLOGIES, then
    the ``remat`` pair on the smallest (``quick``: the ``mtp`` row on the smallest only)."""
    rows = []
    for constrained in ((True,) if quick else (False, True)):
        for topology, chips in (TOPOLOGIES[:1] if quick else TOPOLOGIES):
            rows.append(_row("mtp", topology, chips, constrained,
                             compile_step(mtp_config(topology, chips, vocab), topology,
                                          constrained=constrained)))
            if quick:
                continue
            rows.append(_row("lm", topology, chips, constrained,
                             compile_step(lm_config(chips), topology, constrained=constrained)))
        topology, chips = TOPOLOGIES[0]
        for remat, chunk in (() if quick else (("none", 0), ("full", 128))):
            c = lm_config(chips, vocab=151936, seq=1024, rows_per_chip=8, remat=remat,
                          logits_chunk=chunk)
            rows.append(_row(f"remat:{remat}", topology, chips, constrained,
                             compile_step(c, topology, constrained=constrained)))
    return rows


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="experiments/results/tpu/batch_fix/scaling.json")
    ap.add_argument("--quick", action="store_true",
                    help="the constrained mtp row on the smallest topology only")
    ap.add_argument("--vocab", type=int, default=32768, help="vocabulary of the mtp rows")
    ap.add_argument("--study",
                    choices=("batch", "chunk", "tiling", "rounding", "accum", "width",
                             "remat"),
                    default="batch",
                    help="batch: the batch-constraint fix (4 and 16 chips); chunk: the loss's "
                    "row-chunk fix (8-256 chips); tiling: forced row chunks on 8 chips; "
                    "rounding: the default chunk against one of 8k rows per chip; accum: "
                    "with and without gradient accumulation on 8 chips; width: FSDP over all 256 "
                    "chips of a v5e-256 and over 32; remat: Qwen3-0.6B pretraining under each "
                    "remat policy on 8 chips")
    args = ap.parse_args(argv)
    if aot.libtpu_path() is None:
        raise SystemExit("fsdp_scaling compiles for TPU and needs libtpu: run `make libtpu`")
    if args.study != "batch" and (args.quick or args.vocab != 32768):
        raise SystemExit(f"--study {args.study} has fixed rows: drop --quick / --vocab")
    studies = {"chunk": chunk_study, "tiling": tiling_study, "rounding": rounding_study,
               "accum": accum_study, "width": width_study, "remat": remat_study}
    rows = studies.get(args.study, lambda: batch_study(args.quick, args.vocab))()
    dump_json(args.out, rows)
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    aot.without_persistent_cache()  # TPU executables cannot be read back on this machine
    main()
