"""Compile a jitted program for a TPU topology and report per-chip memory, cost and roofline time.

Usage::

    mesh = topology_mesh("v5e:2x2", {"data": 1, "fsdp": -1, "tensor": 1})
    report = compile_report("train_step", lambda: jitted.lower(*abstract_args), mesh,
                            model_flops=6 * n_params * tokens)

``lower`` must build a ``jax.stages.Lowered`` from abstract inputs (``jax.ShapeDtypeStruct`` with
``NamedSharding`` over ``mesh``, or a jit with ``in_shardings``): nothing is allocated. It is called
inside ``jax.set_mesh(mesh)``: some Pallas TPU lowering rules ask the default device for the TPU
generation, and under a mesh of topology devices they read it from the mesh instead.

What the report means (all per TPU device, which is one chip except on v4 topologies, which list
each TensorCore of a chip as a device):

* memory: the compiler's buffer assignment (``compiled.memory_analysis()``): arguments, outputs,
  temporaries, aliased (donated) bytes and its peak; ``fits`` when the larger of the peak and
  ``arguments + outputs + temporaries - aliased`` is at most :data:`HBM_BUDGET` of the chip's HBM.
  When the compiler itself refuses the program (``RESOURCE_EXHAUSTED``), the numbers of its
  message are reported and ``compiled`` is False.
* cost: ``compiled.cost_analysis()`` FLOPs and bytes accessed (HBM traffic as the compiler models
  it; a Pallas kernel counts as the bytes of its operands and results). XLA counts the body of a
  loop once: gradient accumulation's microbatch loop is scaled by ``loop_multiplier``. Inner
  loops (chunked losses, and the windowed einsums XLA may compile FSDP matmuls to) are counted
  from the HLO instead: ``loop_flops`` is the compiler's FLOPs plus the matmul FLOPs of every
  further trip of every loop whose trip count the HLO shows (:mod:`specjax.aot.hlo_loops`;
  ``notes["loops"]`` lists the costliest). The compute time uses ``max(compiler FLOPs,
  loop_flops, model FLOPs)``, so that loops do not make a step look cheaper than it is. The
  loops' bytes are counted once: the memory side of the roofline stays a looser lower bound.
* roofline: ``max(flops / peak_flops, bytes / hbm_bandwidth)`` with the chip figures of
  :mod:`specjax.aot.chips`: a lower bound on the step time (collectives and imperfect overlap are
  not in it). ``mfu``: the caller's model FLOPs (e.g. ``6 N`` per trained token) over
  ``roofline_seconds x peak`` — the MFU the step would have if it ran at its roofline, an upper
  bound on the real one. :func:`recount_model_flops` derives both again for a report whose model
  FLOPs are counted anew (the compilation does not depend on them).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import tempfile
import time
from typing import Any, Callable, Mapping, Optional

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax.aot import chips as chips_lib
from specjax.aot import hlo_loops
from specjax.aot import peak as peak_lib
from specjax.aot.env import ensure_libtpu, no_persistent_cache_writes
from specjax.training import sharding as sharding_lib

HBM_BUDGET = 0.90  # a program "fits" when it needs at most this fraction of a device's HBM


@functools.lru_cache(maxsize=None)
def topology_devices(topology: str) -> tuple:
    """The TPU devices of a topology (``"v5e:2x2"``, or a slice name like ``"v5p-64"``)."""
    ensure_libtpu()
    from jax.experimental import topologies
    name = chips_lib.topology_name(topology)
    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)


def topology_mesh(topology: str, mesh_shape: Mapping[str, int]) -> Mesh:
    """The ``(data, fsdp, tensor)`` mesh (all axes Auto) over a topology's devices."""
    return sharding_lib.make_mesh(dict(mesh_shape), devices=list(topology_devices(topology)))


def abstract(tree: Any, shardings: Any) -> Any:
    """``jax.ShapeDtypeStruct`` leaves (from arrays or structs) carrying the given shardings."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def replicated_like(tree: Any, mesh: Mesh) -> Any:
    """Abstract ``tree`` replicated over ``mesh``."""
    rep = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), tree)


@dataclasses.dataclass
class ProgramReport:
    """Per-device numbers of one compiled program (see the module docstring)."""

    name: str
    topology: str
    chip: str
    num_devices: int
    mesh: dict
    shapes: dict
    compiled: bool
    error: Optional[str] = None
    compile_seconds: float = 0.0
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    peak_bytes: int = 0
    hbm_bytes: int = 0
    flops: float = 0.0
    bytes_accessed: float = 0.0
    compiler_seconds: Optional[float] = None
    roofline_seconds: float = 0.0
    bound: str = ""
    model_flops: Optional[float] = None
    mfu: Optional[float] = None
    # The compiler's own count (before any loop_multiplier scaling) plus the matmul FLOPs of
    # every further trip of every loop whose trip count the HLO shows, the accumulation loop's
    # included (specjax.aot.hlo_loops); None where the HLO could not be read.
    loop_flops: Optional[float] = None
    notes: dict = dataclasses.field(default_factory=dict)

    @property
    def used_bytes(self) -> int:
        """Bytes this program needs on one device (the larger of the two accountings)."""
        return max(self.peak_bytes,
                   self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes)

    @property
    def hbm_fraction(self) -> float:
        return self.used_bytes / self.hbm_bytes if self.hbm_bytes else math.inf

    @property
    def fits(self) -> bool:
        return self.compiled and self.hbm_fraction <= HBM_BUDGET

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(used_bytes=self.used_bytes, hbm_fraction=self.hbm_fraction, fits=self.fits)
        return d


_SIZE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_oom(message: str) -> Optional[tuple[int, int]]:
    """``(used, capacity)`` bytes from a TPU compiler RESOURCE_EXHAUSTED message, if present."""
    patterns = (r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm",
                r"required for HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM "
                r"\(([\d.]+)([KMGT]?)\)")
    for pattern in patterns:
        m = re.search(pattern, message)
        if m:
            return (int(float(m.group(1)) * _SIZE[m.group(2)]),
                    int(float(m.group(3)) * _SIZE[m.group(4)]))
    return None


def _chip_and_share(num_devices: int, topology: str):
    """The chip of ``topology`` and how many of ``num_devices`` share one (v4: two cores)."""
    chip = chips_lib.chip_of(topology)
    per_chip = max(1, num_devices // chips_lib.num_chips(topology))
    return chip, per_chip


def compile_report(name: str, lower: Callable[[], Any], mesh: Mesh, topology: str, *,
                   shapes: Optional[dict] = None, model_flops: Optional[float] = None,
                   notes: Optional[dict] = None, loop_multiplier: int = 1,
                   copy_watch: Optional[int] = None,
                   explain_memory: bool = False,
                   compiler_options: Optional[Mapping[str, Any]] = None) -> ProgramReport:
    """Lowers (``lower()`` under ``jax.set_mesh(mesh)``), compiles and reports one program.

    Args:
      name: label of the program.
      lower: ``() -> jax.stages.Lowered``.
      mesh: the topology mesh the inputs are sharded over.
      topology: topology string or slice name (for the chip figures).
      shapes: what to print with the report (batch, sequence, ...).
      model_flops: useful FLOPs of one step on the whole mesh (for the MFU; divided by the
        device count here).
      notes: free-form extras carried into the report.
      loop_multiplier: trip count of the program's outer loop (gradient accumulation's
        microbatches): the compiler's cost analysis counts a loop body once, so its FLOPs and
        bytes are multiplied by this.
      copy_watch: element count of one chip's share of a large array (the engine's layered KV
        cache): ``notes["whole_copies"]`` counts the compiled program's ``copy`` instructions
        with that many elements, in any shape (the compiler may flatten the array first).
      explain_memory: dump the compilation to a temporary directory and put what is alive at
        the memory peak, grouped by source op and shape, in ``notes["peak_live"]``
        (:func:`specjax.aot.peak.peak_breakdown`), also for a program the compiler refuses for
        lack of memory (its buffers are assigned before the refusal); ``None`` if the dump has no
        live-range peak (another libtpu may name or format it otherwise). Costs a few seconds
        and a dump of the HLO (up to a few hundred MB, removed afterwards); ``compile_seconds``
        includes writing the dump.
      compiler_options: XLA / libtpu options for this compilation, e.g.
        ``{"xla_tpu_enable_latency_hiding_scheduler": False}`` (what ``LIBTPU_INIT_ARGS`` would
        set on a TPU VM); kept in ``notes["compiler_options"]``. An unknown name is an error.
    Returns:
      A :class:`ProgramReport`; a compiler refusal for lack of memory is a report with
      ``compiled=False`` and the compiler's numbers, any other error is raised.
    """
    n = mesh.devices.size
    chip, per_chip = _chip_and_share(n, topology)
    report = ProgramReport(
        name=name, topology=chips_lib.topology_name(topology), chip=chip.name, num_devices=n,
        mesh={k: int(v) for k, v in mesh.shape.items()}, shapes=dict(shapes or {}),
        compiled=False, hbm_bytes=chip.hbm_bytes // per_chip, notes=dict(notes or {}),
        model_flops=None if model_flops is None else model_flops / n)
    start = time.perf_counter()
    options = dict(compiler_options or {})
    if options:  # on top of any the program's jit carries (already in notes, if so)
        report.notes["compiler_options"] = {**report.notes.get("compiler_options", {}), **options}
    dump = tempfile.TemporaryDirectory(prefix="specjax_xla_dump_") if explain_memory else None
    if dump is not None:
        options["xla_dump_to"] = dump.name
    try:
        with jax.set_mesh(mesh), no_persistent_cache_writes():
            lowered = lower()
            compiled = lowered.compile(options) if options else lowered.compile()
    except Exception as e:  # noqa: BLE001 - only the compiler's OOM is a result, re-raised else
        msg = str(e)
        oom = parse_oom(msg)
        if "RESOURCE_EXHAUSTED" not in msg or oom is None:
            raise
        report.compile_seconds = time.perf_counter() - start
        report.peak_bytes = oom[0]
        report.error = msg.strip().splitlines()[0][:400]
        _explain(report, dump)
        return report
    else:
        report.compile_seconds = time.perf_counter() - start
        _explain(report, dump)
    finally:
        if dump is not None:
            dump.cleanup()
    report.compiled = True
    hlo_text = compiled.as_text()  # tens of MB for a large step: read once, used twice
    if copy_watch is not None:
        report.notes["whole_copies"] = count_copies(hlo_text, copy_watch)
    mem = compiled.memory_analysis()
    report.argument_bytes = int(mem.argument_size_in_bytes)
    report.output_bytes = int(mem.output_size_in_bytes)
    report.alias_bytes = int(mem.alias_size_in_bytes)
    report.temp_bytes = int(mem.temp_size_in_bytes)
    report.peak_bytes = int(getattr(mem, "peak_memory_in_bytes", 0) or 0)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    report.flops = float(cost.get("flops", 0.0))
    report.bytes_accessed = float(cost.get("bytes accessed", 0.0))
    # XLA's own time estimate; libtpu reports a negative number where it has none (seen for
    # every v5e and v6e step), which must not pass for a time.
    if float(cost.get("optimal_seconds", -1.0)) >= 0:
        report.compiler_seconds = float(cost["optimal_seconds"])
    _count_loops(report, hlo_text)
    if loop_multiplier > 1:
        # XLA's cost analysis counts a while loop's body once, whatever its trip count; scale the
        # step by its microbatch count (this also repeats the once-per-step optimizer update, so
        # it overestimates the step a little: a conservative roofline).
        report.notes["compiler_flops_once"] = report.flops
        report.notes["compiler_bytes_once"] = report.bytes_accessed
        report.flops *= loop_multiplier
        report.bytes_accessed *= loop_multiplier
    _roofline(report, chip, per_chip)
    return report


def _roofline(report: ProgramReport, chip, per_chip: int) -> None:
    """``roofline_seconds``, ``bound`` and ``mfu`` of a compiled report from its counts."""
    peak = chip.peak_bf16_flops / per_chip
    bandwidth = chip.hbm_bandwidth / per_chip
    # Loops are counted once by the compiler. The loop-aware matmul count and the model FLOPs
    # (a lower bound of the work actually done) bound the compute time from below too.
    flops = max(report.flops, report.loop_flops or 0.0, report.model_flops or 0.0)
    t_flops, t_bytes = flops / peak, report.bytes_accessed / bandwidth
    report.roofline_seconds = max(t_flops, t_bytes)
    report.bound = "compute" if t_flops >= t_bytes else "memory"
    report.mfu = None
    if report.model_flops is not None and report.roofline_seconds > 0:
        report.mfu = report.model_flops / (report.roofline_seconds * peak)


def recount_model_flops(row: dict, model_flops: float) -> dict:
    """A compiled report's dict (:meth:`ProgramReport.to_dict`) with its model FLOPs replaced by
    ``model_flops`` (per device, as the report keeps them) and its roofline, bound and MFU derived
    again; the compiler's numbers (memory, FLOPs, bytes, loop counts) stay as compiled. That is
    what compiling the same program again reports when only the model-FLOPs formula changed (the
    compilation itself does not depend on it). The value it replaces is kept in
    ``notes["model_flops_compiled_with"]`` (the first one, if recounted twice)."""
    if not row.get("compiled"):
        raise ValueError(f"{row.get('name')}: only a compiled report has a roofline to recount")
    fields = {f.name for f in dataclasses.fields(ProgramReport)}
    report = ProgramReport(**{k: v for k, v in row.items() if k in fields})
    report.notes = dict(report.notes)
    report.notes.setdefault("model_flops_compiled_with", report.model_flops)
    report.model_flops = float(model_flops)
    _roofline(report, *_chip_and_share(report.num_devices, report.topology))
    return report.to_dict()


def _count_loops(report: ProgramReport, hlo_text: str) -> None:
    """``report.loop_flops`` and ``notes["loops"]`` from the compiled module's HLO text: the
    matmul FLOPs with every loop's trips, the costliest loops with matmuls in them (source,
    trips, matmul FLOPs of one trip) and the eight source lines with the most matmul FLOPs.
    Called before any ``loop_multiplier`` scaling."""
    try:
        counted = hlo_loops.loop_flops(hlo_text)
    except (ValueError, KeyError, IndexError, AttributeError) as e:  # an HLO this parser misreads
        report.notes["loops"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        return
    report.loop_flops = report.flops + counted.extra
    report.notes["loops"] = {
        "matmul_flops": counted.total, "matmul_flops_once": counted.once,
        "costliest": [{"name": n, "trips": t, "matmul_flops_per_trip": f}
                      for n, t, f in counted.loops if f > 0][:5],
        "counted_loops": len(counted.loops), "unknown_trip_loops": len(counted.unknown_loops),
        "by_source": [{"source": src, "matmul_flops": f} for src, f in counted.by_source[:8]]}


def _explain(report: ProgramReport, dump) -> None:
    """``notes["peak_live"]`` from a compilation's dump directory (``None``: no dump asked)."""
    if dump is not None:
        report.notes["peak_live"] = peak_lib.peak_breakdown(dump.name)


def count_copies(hlo_text: str, elements: int) -> int:
    """``copy`` instructions of an HLO module's text whose result has ``elements`` elements."""
    n = 0
    for m in re.finditer(r"= \w+\[([\d,]*)\]\S* copy\(", hlo_text):
        if math.prod(int(d) for d in m.group(1).split(",") if d) == elements:
            n += 1
    return n


def gib(x: float) -> float:
    return float(x) / chips_lib.GIB


def mesh_str(mesh: Mapping[str, int]) -> str:
    parts = [f"{k} {v}" for k, v in mesh.items() if v > 1]
    return " x ".join(parts) or "1"


