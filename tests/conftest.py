"""Test setup: 8 fake CPU devices (must be set before JAX starts), f32 matmuls, and every
specjax cache under a temporary directory of this test process.

Hermetic caches: without this, tests would read and write ``~/.cache/specjax`` (prepared data,
pretrained targets, the quickstart's target), so a stale or half-written artefact from another
checkout could decide a test's outcome, and tests would leave gigabytes behind. The variables are
set before any test module is imported and inherited by the subprocesses tests spawn; the
directory is removed when the session ends.
"""
import os
import shutil
import tempfile

import pytest

from _xla_flags import DEVICE_COUNT_FLAG, with_compile_speed_flags

os.environ.setdefault("XLA_FLAGS", "")
if DEVICE_COUNT_FLAG not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += f" --{DEVICE_COUNT_FLAG}=8"
# Compile-time settings (LLVM -O0; jaxlib 0.10's legacy fusion emitters): why, and what they
# change, in _xla_flags.py. Subprocesses inherit them through XLA_FLAGS.
os.environ["XLA_FLAGS"] = with_compile_speed_flags(os.environ["XLA_FLAGS"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Keep each xdist worker from oversubscribing the 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Every cache location specjax reads from the environment (see specjax.training.run,
# experiments/reproduce.py, experiments/quickstart.py, the notebooks).
CACHE_ENV = ("SPECJAX_DATA_DIR", "SPECJAX_TARGET_CACHE", "SPECJAX_QUICKSTART_DIR",
             "SPECJAX_NOTEBOOK_WORKDIR")
CACHE_ROOT = tempfile.mkdtemp(prefix="specjax-test-caches-")
for _name in CACHE_ENV:
    os.environ[_name] = os.path.join(CACHE_ROOT, _name.lower())

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Makes ``--dist loadgroup`` keep each ``xdist_group`` on one worker under pytest 9.

    xdist 3.8's worker marks a grouped test by appending ``@group`` to ``item._nodeid``; pytest 9
    derives ``nodeid`` from ``item._id`` instead, so the mark never reached the scheduler and
    groups were spread over both workers (each then built the group's module fixtures and tiny
    models again). Running after xdist's hook, copy its suffix into ``_id``. A no-op without
    xdist, and once pytest or xdist agree again."""
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:  # pytest < 9: nodeid is _nodeid
        return
    for item in items:
        marked = getattr(item, "_nodeid", None)
        if isinstance(marked, str) and "@" in marked and marked != item.nodeid:
            item._id = coerce_node_id(marked)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(CACHE_ROOT, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def worker_compilation_cache(tmp_path_factory):
    """JAX's persistent compilation cache for this pytest process only (one per xdist worker, under
    its own temporary directory; subprocesses do not inherit it).

    Many in-process tests build the same programs again (a fresh Engine or Trainer jits new
    functions, so JAX's in-memory cache misses); the persistent cache turns those rebuilds into
    loads. XLA keys an entry on the whole program, its compile options and the XLA flags, so a hit
    is the executable a fresh compile would build. One writer per directory, so no file lock is
    needed. Compile-count tests count cache loads too (``_shared_once.count_compiles``).

    Not one cache for the whole run shared with every subprocess: measured alone, two
    subprocess-heavy tests ran about 6 % slower with it (cold writes, few repeats across
    processes), and the suite with it was not measurably faster."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = tmp_path_factory.getbasetemp() / "jax_compile_cache_worker"
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    cc.reset_cache()
    yield path
