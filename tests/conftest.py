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

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
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


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(CACHE_ROOT, ignore_errors=True)
