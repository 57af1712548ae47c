"""Finding libtpu for ahead-of-time compilation on a machine without a TPU.

libtpu holds the TPU compiler. Installed as a Python package it makes every ``import jax`` on a
CPU-only machine try (and fail, noisily) to initialise a TPU, so specjax keeps it *off* the import
path: ``make libtpu`` (part of ``make test``) puts it in ``.venv/libtpu`` with ``pip install
--target``, and :func:`ensure_libtpu` points ``TPU_LIBRARY_PATH`` at its ``libtpu.so`` the first
time ahead-of-time code asks for a TPU topology. Ordinary runs never load it.

This works in a process where JAX is already running on CPU (e.g. under pytest with
``JAX_PLATFORMS=cpu``): ``jax.experimental.topologies.get_topology_desc`` loads the library on its
own, without creating a TPU backend, so everything else in the process stays on the CPU.

Search order for the library: ``$TPU_LIBRARY_PATH``, ``$SPECJAX_LIBTPU``, then
``<prefix>/libtpu/libtpu/libtpu.so`` for the running interpreter's ``sys.prefix`` (the venv that
``make install`` created) and the repository's ``.venv``.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RELATIVE = os.path.join("libtpu", "libtpu", "libtpu.so")


class LibtpuMissing(RuntimeError):
    """No libtpu found: ahead-of-time TPU compilation is impossible on this machine."""


def libtpu_path() -> Optional[str]:
    """Path of ``libtpu.so`` (see the module docstring for the search order), or ``None``."""
    for var in ("TPU_LIBRARY_PATH", "SPECJAX_LIBTPU"):
        path = os.environ.get(var)
        if path and os.path.isfile(path):
            return path
    for prefix in (sys.prefix, os.path.join(REPO_ROOT, ".venv")):
        path = os.path.join(prefix, _RELATIVE)
        if os.path.isfile(path):
            return path
    return None


def ensure_libtpu() -> str:
    """Sets the environment libtpu reads (once) and returns the library's path.

    ``TPU_ACCELERATOR_TYPE`` and ``TPU_WORKER_HOSTNAMES`` are set only if unset: without them
    libtpu probes the (absent) TPU host metadata and logs errors. ``ALLOW_MULTIPLE_LIBTPU_LOAD``
    lets several processes compile at once.

    Raises:
      LibtpuMissing with the install command.
    """
    path = libtpu_path()
    if path is None:
        raise LibtpuMissing(
            "libtpu not found; `make libtpu` puts it in .venv/libtpu, or run "
            "`pip install --target .venv/libtpu 'libtpu==<the version jax pins>'` and/or set "
            "TPU_LIBRARY_PATH=<dir>/libtpu/libtpu.so")
    os.environ["TPU_LIBRARY_PATH"] = path
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # libtpu takes a machine-wide lock file on load; compiling touches no TPU, so several
    # processes (pytest workers, a pre-flight next to a test run) may load it at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return path


def without_persistent_cache() -> None:
    """Turns JAX's persistent compilation cache off in this process.

    An executable compiled for a TPU topology on a machine without a TPU cannot be loaded back
    there: with a cache directory set (``JAX_COMPILATION_CACHE_DIR``), the second compilation of
    the same program fails to read its entry, warns and compiles again, and every compilation
    writes a TPU executable into the cache that no later run can use. The
    ahead-of-time entry points call this first: JAX decides whether a process uses the cache at
    its first compilation, so it must come before any."""
    import jax
    jax.config.update("jax_enable_compilation_cache", False)


@contextlib.contextmanager
def no_persistent_cache_writes():
    """Within this context, JAX writes no compiled program into its persistent compilation cache.

    :func:`without_persistent_cache` must run before a process's first compilation; code that
    compiles TPU programs in a process already using the cache (a notebook, a test worker) gets
    this instead, around each TPU compilation (:func:`specjax.aot.compile_report`): an executable
    for a TPU topology cannot be loaded back on a machine without a TPU, so a cached one only makes
    the next compilation of the same program warn ("Error reading persistent compilation cache
    entry") and compile again. Reads still happen and find nothing; other programs are cached as
    before. Raises the minimum compile time for a write to infinity and restores it after (a
    process-wide setting: a compilation in another thread meanwhile is not cached either)."""
    import jax
    name = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, name)
    jax.config.update(name, float("inf"))
    try:
        yield
    finally:
        jax.config.update(name, before)
