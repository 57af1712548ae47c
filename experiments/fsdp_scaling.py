r"""Per-chip cost of a training step at one row per chip, on 4 and 16 TPU chips, with and without
the batch constraint of ``specjax.models.partitioning`` (docs/TPU.md, "FSDP kept the batch
replicated"). Compiles for TPU on the CPU (needs libtpu, ``make libtpu``)::

    python -m experiments.fsdp_scaling --out experiments/results/tpu/batch_fix/scaling.json

Tiny mode (``--quick``: the constrained ``mtp`` row on 4 chips only, under a minute)::

    python -m experiments.fsdp_scaling --quick --out /tmp/scaling_quick.json

Rows (tiny model, 32,768-token vocabulary, 256 tokens per row, FSDP over every chip):

* ``mtp``: the MTP + e2e-TV drafter step of ``experiments/configs/tpu_pod.py``, every position an
  anchor (the target's full ``[B, T, V]`` logits, its embedding and the drafter's shared head);
* ``lm``: the LM pretraining step of ``experiments/configs/pretrain_target.py``;
* ``remat``: the LM step with the Qwen3 vocabulary (151,936) at 32 x 1024 tokens on 4 chips,
  without remat and with ``remat = full, logits_chunk = 128``.

"Without" lowers the same program inside ``partitioning.unconstrained()``: the code before the fix.
"""
from __future__ import annotations

import argparse
import json
import os

from specjax import aot
from specjax.models import partitioning

TOPOLOGIES = (("v5e:2x2", 4), ("v5e:4x4", 16))


def mtp_config(topology: str, chips: int, vocab: int = 32768):
    """The tiny MTP + e2e-TV step at one 256-token row per chip, every position an anchor."""
    from experiments.configs.tpu_pod import get_config
    c = get_config(f"tiny,mtp,{topology}")
    c.unlock()
    c.model.overrides.vocab_size = vocab
    c.data.seq_len, c.data.batch_size, c.train.grad_accum_steps = 256, chips, 1
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


def compile_step(config, topology: str, *, constrained: bool = True) -> aot.ProgramReport:
    """The trainer's step of ``config`` compiled for ``topology`` (``constrained=False``: the batch
    constraint switched off while tracing)."""
    mesh = aot.topology_mesh(topology, config.mesh.to_dict())
    program = aot.train_step(config, mesh)
    if not constrained:
        lower = program.lower

        def unconstrained_lower():
            with partitioning.unconstrained():
                return lower()
        program.lower = unconstrained_lower
    return aot.compile_program(program, mesh, topology)


def _row(name: str, topology: str, chips: int, constrained: bool, r) -> dict:
    row = {"step": name, "topology": topology, "chips": chips, "constrained": constrained,
           "compiled": r.compiled, "temp_gib": r.temp_bytes / 2**30,
           "used_gib": r.used_bytes / 2**30, "bytes_accessed_gb": r.bytes_accessed / 1e9}
    print(f"{name:6s} {topology} ({chips:2d}) constrained={constrained!s:5s} "
          f"temps {row['temp_gib']:6.2f} GiB, used {row['used_gib']:6.2f} GiB, "
          f"{row['bytes_accessed_gb']:7.2f} GB accessed{'' if r.compiled else ' (refused)'}",
          flush=True)
    return row


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="experiments/results/tpu/batch_fix/scaling.json")
    ap.add_argument("--quick", action="store_true",
                    help="the constrained mtp row on the smallest topology only")
    ap.add_argument("--vocab", type=int, default=32768, help="vocabulary of the mtp rows")
    args = ap.parse_args(argv)
    if aot.libtpu_path() is None:
        raise SystemExit("fsdp_scaling compiles for TPU and needs libtpu: run `make libtpu`")
    rows = []
    for constrained in ((True,) if args.quick else (False, True)):
        for topology, chips in (TOPOLOGIES[:1] if args.quick else TOPOLOGIES):
            rows.append(_row("mtp", topology, chips, constrained,
                             compile_step(mtp_config(topology, chips, args.vocab), topology,
                                          constrained=constrained)))
            if args.quick:
                continue
            rows.append(_row("lm", topology, chips, constrained,
                             compile_step(lm_config(chips), topology, constrained=constrained)))
        topology, chips = TOPOLOGIES[0]
        for remat, chunk in (() if args.quick else (("none", 0), ("full", 128))):
            c = lm_config(chips, vocab=151936, seq=1024, rows_per_chip=8, remat=remat,
                          logits_chunk=chunk)
            rows.append(_row(f"remat:{remat}", topology, chips, constrained,
                             compile_step(c, topology, constrained=constrained)))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
