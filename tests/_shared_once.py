"""Expensive test artefacts (a tiny trained target, a quickstart run) built once per test session,
not once per xdist worker.

Each xdist worker is its own process with its own session fixtures. ``xdist_group`` marks keep
a group on one worker (``--dist loadgroup``; see ``conftest.pytest_collection_modifyitems`` for
what pytest 9 needs), but an artefact used by tests of two groups, or by a run without the mark
honoured, would be built once per worker. :func:`build_once` builds under the directory all
workers of one run share (the parent of each worker's base temp dir), behind a file lock: the
first worker to arrive builds, the others wait and reuse. Without xdist it is the session's base
temp dir.

The command-line runs of the tests also share JAX's persistent compilation cache
(:func:`compile_cache`): a tiny target's train step, say, is compiled by the first subprocess that
needs it and loaded by the others. XLA keys an entry on the whole program and its compile options,
so a hit is the executable a fresh compile would build.
"""
import contextlib
import fcntl
import os
import pathlib
import shutil
from typing import Callable

import jax

_DONE = ".built"


def shared_root(tmp_path_factory) -> pathlib.Path:
    """The directory shared by every worker of this pytest run."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(tmp_path_factory, name: str, build: Callable[[pathlib.Path], None]
               ) -> pathlib.Path:
    """``shared_root / name``, made by ``build(path)`` unless a worker of this run already did.

    A build that raised leaves no completion mark: the next caller starts over in a clean
    directory (and fails the same way if the failure is real)."""
    out = shared_root(tmp_path_factory) / name
    with open(str(out) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if not (out / _DONE).exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            build(out)
            (out / _DONE).touch()
    return out


def compile_cache(tmp_path_factory) -> pathlib.Path:
    """JAX's persistent compilation cache directory of this pytest run (all workers)."""
    return shared_root(tmp_path_factory) / "jax_compile_cache"


def compile_cache_env(path: pathlib.Path) -> dict:
    """Environment variables that point a subprocess's JAX at the compilation cache ``path``."""
    return {"JAX_COMPILATION_CACHE_DIR": str(path),
            # cache the sub-second compiles too: a tiny model's programs are many and small
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.1",
            # a size bound turns on JAX's file lock around cache reads and writes (processes of
            # both workers use the cache at once)
            "JAX_COMPILATION_CACHE_MAX_SIZE": str(8 << 30)}


@contextlib.contextmanager
def in_process_compile_cache(path: pathlib.Path):
    """JAX's persistent compilation cache at ``path`` for this process, inside the ``with`` only.

    For a test that builds the same programs again in one process (a run, then its resume: fresh
    trainers whose jitted steps are new functions to JAX's in-memory cache). Afterwards the cache
    is off again, so later tests of this process compile as before."""
    from jax.experimental.compilation_cache import compilation_cache as cc
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    saved = {n: getattr(jax.config, n) for n in names}
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    cc.reset_cache()  # JAX decides once whether the cache is used: make it decide again
    try:
        yield
    finally:
        for n, v in saved.items():
            jax.config.update(n, v)
        cc.reset_cache()


@contextlib.contextmanager
def count_compiles():
    """Yields a list that collects one entry per executable built inside the ``with``: an XLA
    compile, or a load from the persistent compilation cache (the suite runs with one, see
    conftest.py; a program traced again after warm-up is a defect either way)."""
    built = []

    def on_duration(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            built.append(("compiled", kw))

    def on_event(event, **kw):
        if event == "/jax/compilation_cache/cache_hits":
            built.append(("cache_hit", kw))

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    try:
        yield built
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_event_listener(on_event)


@contextlib.contextmanager
def count_graphdef_hashes():
    """Yields a list that collects one entry per ``nnx.GraphDef`` hash computed inside the
    ``with`` (a :class:`specjax.models.graphdef.HashedGraphDef` computes its hash once, on first
    use; a plain graphdef on every call of a jitted function that takes it as a static argument)."""
    from flax import nnx
    computed = []
    plain = nnx.GraphDef.__hash__

    def counting(self):
        computed.append(type(self).__name__)
        return plain(self)
    nnx.GraphDef.__hash__ = counting
    try:
        yield computed
    finally:
        nnx.GraphDef.__hash__ = plain
