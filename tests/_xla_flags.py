"""The XLA flags the test suite compiles with, shared by ``conftest.py`` and the subprocesses tests
start (training CLIs, multi-process workers), so that every process of the suite compiles alike.

Most of the suite's time is XLA compiling many small programs, each run only a few times. Two CPU
backend settings cut that time. Both change how the programs JAX builds become machine code, not
those programs; the results may differ in their last bits (e.g. no fused multiply-adds, another
emission of a fused reduction), which no test may depend on: tolerances are derived for any
summation order, and timing assertions compare programs compiled with the same flags.

- ``--xla_backend_optimization_level=0``: LLVM's code generation at -O0 (about a quarter of the
  compile time).
- ``--xla_cpu_use_fusion_emitters=false`` (jaxlib 0.10 only): jaxlib 0.10 emits fusions with its
  new MLIR fusion emitters by default, and its legacy LLVM-IR emitters compile them in less time
  (measured on a 2-vCPU VM: ``tests/test_speculative_lossless.py`` 36-37 s against 48-59 s, and the
  whole suite under ``pytest -n 2`` 8 min 32 s against 13-14 min). jaxlib 0.11 removed the legacy
  emitters and rejects the flag (an unknown XLA flag is fatal), so newer jaxlibs do without it.

A flag already in ``XLA_FLAGS`` is kept as given: to test at another level or with the new emitters,
set it there.
"""
import importlib.metadata

DEVICE_COUNT_FLAG = "xla_force_host_platform_device_count"


def jaxlib_version() -> tuple:
    """jaxlib's ``(major, minor, patch)`` from its package metadata, without importing JAX (flags
    must be set before it starts); ``(0, 0, 0)`` when it cannot be read."""
    try:
        parts = importlib.metadata.version("jaxlib").split(".")[:3]
        return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return (0, 0, 0)


def compile_speed_flags() -> dict:
    """``{flag name: value}`` of the compile-time settings above that this jaxlib accepts."""
    flags = {"xla_backend_optimization_level": "0"}
    if jaxlib_version()[:2] == (0, 10):
        flags["xla_cpu_use_fusion_emitters"] = "false"
    return flags


def with_compile_speed_flags(xla_flags: str) -> str:
    """``xla_flags`` with each flag of :func:`compile_speed_flags` appended unless already set."""
    out = xla_flags.split()
    for name, value in compile_speed_flags().items():
        if not any(f.lstrip("-").startswith(name + "=") for f in out):
            out.append(f"--{name}={value}")
    return " ".join(out)


def without_device_count(xla_flags: str) -> str:
    """``xla_flags`` without the fake-device count (for subprocesses that choose their own)."""
    return " ".join(f for f in xla_flags.split() if DEVICE_COUNT_FLAG not in f)
