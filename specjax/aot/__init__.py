"""Ahead-of-time compilation for TPU topologies on a machine without a TPU (see docs/TPU.md).

:mod:`~specjax.aot.env` finds libtpu (kept off the Python import path), :mod:`~specjax.aot.chips`
holds the per-chip figures, :mod:`~specjax.aot.compile` compiles one program and reports its per-chip
memory, cost and roofline time (:mod:`~specjax.aot.peak`: what is alive at its memory peak), and
:mod:`~specjax.aot.programs` builds specjax's programs (train steps, engine steps, the Pallas
rejection sampler) from abstract sharded inputs.
"""
from specjax.aot.chips import CHIPS, ChipSpec, chip_of, num_chips, topology_name
from specjax.aot.compile import (HBM_BUDGET, ProgramReport, compile_report, count_copies,
                                 parse_oom, recount_model_flops, topology_devices, topology_mesh)
from specjax.aot.env import (LibtpuMissing, ensure_libtpu, libtpu_path, no_persistent_cache_writes,
                             without_persistent_cache)
from specjax.aot.peak import format_breakdown, peak_breakdown
from specjax.aot.programs import (EngineFlops, EngineShapes, Program, engine_flops, engine_steps,
                                  rejection_kernel, train_step)

__all__ = [
    "CHIPS", "ChipSpec", "chip_of", "num_chips", "topology_name", "HBM_BUDGET", "ProgramReport",
    "compile_report", "count_copies", "parse_oom", "recount_model_flops", "topology_devices",
    "topology_mesh",
    "LibtpuMissing", "ensure_libtpu", "libtpu_path", "no_persistent_cache_writes",
    "without_persistent_cache",
    "format_breakdown", "peak_breakdown",
    "EngineFlops", "EngineShapes", "Program", "engine_flops", "engine_steps", "rejection_kernel",
    "train_step",
]


def compile_program(program: Program, mesh, topology: str, *, explain_memory: bool = False,
                    compiler_options=None) -> ProgramReport:
    """:func:`compile_report` of a :class:`Program`."""
    return compile_report(program.name, program.lower, mesh, topology, shapes=program.shapes,
                          model_flops=program.model_flops, notes=program.notes,
                          loop_multiplier=program.loop_multiplier,
                          copy_watch=program.copy_watch, explain_memory=explain_memory,
                          compiler_options=compiler_options)
