"""Tiny runs made once per test session by the command-line entry points themselves, under a
temporary directory (not a test module): a tiny target (``python -m experiments.train``) and a tiny
DSpark drafter trained against it (``python -m experiments.train_drafter``). Every cache the
subprocesses could write (``SPECJAX_*`` directories, matplotlib) points into that directory.

Modules using :func:`tiny_runs` import it. The runs are built once per pytest run, whichever
worker asks first (``_shared_once.py``); each importing module gets its own fixture object, so
the result is also kept in a module-level cache.
"""
import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest
from _shared_once import build_once, compile_cache, compile_cache_env
from _xla_flags import without_device_count

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The DSpark drafter of the tests: the tiny preset of experiments/configs/train_drafter.py, made
# smaller still (γ = 3, one step of the DSpark loss, no eval pass) to keep compilation short.
DSPARK_FLAGS = ("--config.task.gamma=3", "--config.task.warm_start_loss=",
                "--config.task.switch_step=0", "--config.train.num_steps=1",
                "--config.checkpoint.every=1", "--config.data.eval_batches=0",
                "--config.data.seq_len=16", "--config.output.progress_bar=False",
                "--config.output.plot=False")


def hermetic_env(base: pathlib.Path, jax_cache: pathlib.Path = None) -> dict:
    """The environment for entry-point subprocesses: caches under ``base``, one CPU device, this
    checkout's ``specjax`` first on the path. With ``jax_cache``, JAX's persistent compilation
    cache there (see :func:`_shared_once.compile_cache`)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = without_device_count(env.get("XLA_FLAGS", ""))
    env.update(JAX_PLATFORMS="cpu", MPLBACKEND="Agg", MPLCONFIGDIR=str(base / "mpl"),
               SPECJAX_DATA_DIR=str(base / "data"), SPECJAX_TARGET_CACHE=str(base / "targets"),
               SPECJAX_QUICKSTART_DIR=str(base / "quickstart"),
               SPECJAX_NOTEBOOK_WORKDIR=str(base / "notebook"),
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p]))
    if jax_cache is not None:
        env.update(compile_cache_env(jax_cache))
    return env


def run_module(env: dict, module: str, *args, timeout: int = 600,
               check: bool = True) -> subprocess.CompletedProcess:
    """``python -m module args`` from the repository root; fails the test on a non-zero exit
    unless ``check=False`` (a test of the entry point's refusals reads the exit itself)."""
    cmd = [sys.executable, "-m", module, *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert not check or proc.returncode == 0, (" ".join(cmd) + "\n" + proc.stdout[-3000:]
                                               + proc.stderr[-3000:])
    return proc


@dataclasses.dataclass
class TinyRuns:
    base: pathlib.Path
    env: dict
    target: pathlib.Path  # experiments.train workdir (pretrain_target.py:tiny)
    dspark: pathlib.Path  # experiments.train_drafter workdir (dspark_markov,tiny)
    dspark_stdout: str


_RUNS: list = []


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory) -> TinyRuns:
    if not _RUNS:
        cache = compile_cache(tmp_path_factory)
        base = build_once(tmp_path_factory, "tiny_runs",
                          lambda b: _make_runs(b, hermetic_env(b, cache)))
        _RUNS.append(TinyRuns(base, hermetic_env(base, cache), base / "target", base / "dspark",
                              (base / "dspark_stdout.txt").read_text()))
    return _RUNS[0]


def _make_runs(base: pathlib.Path, env: dict) -> None:
    target, dspark = base / "target", base / "dspark"
    run_module(env, "experiments.train", "--config",
               "experiments/configs/pretrain_target.py:tiny", "--workdir", target,
               "--config.output.progress_bar=False", "--config.output.plot=False")
    proc = run_module(env, "experiments.train_drafter", "--config",
                      "experiments/configs/train_drafter.py:dspark_markov,tiny",
                      "--config.task.target_workdir", target, "--workdir", dspark, *DSPARK_FLAGS)
    (base / "dspark_stdout.txt").write_text(proc.stdout)
