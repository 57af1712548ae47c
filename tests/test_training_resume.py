"""Kill-and-resume: a run interrupted by SIGKILL during an async save, then by a crash between
checkpoints, resumes from the last complete checkpoint and ends bit-identical to an
uninterrupted run (params, optimizer, step, data-iterator position and RNG all restored)."""
import json
import os
import subprocess
import sys

import numpy as np

WORKER = os.path.join(os.path.dirname(__file__), "_train_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(spec, timeout=180):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    proc = subprocess.run([sys.executable, WORKER, json.dumps(spec)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc


def _complete_steps(ckpt_dir):
    return sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())


def test_sigkill_during_async_save_then_crash_then_resume_matches_uninterrupted(tmp_path):
    common = {"devices": 2, "config": {"mesh.fsdp": 2, "train.num_steps": 8,
                                       "checkpoint.every": 2},
              "compile_cache": str(tmp_path / "jax_cache")}  # later workers skip compiling
    ref_out = str(tmp_path / "ref.npz")
    ref = _worker({**common, "workdir": str(tmp_path / "ref"), "out": ref_out})
    assert ref.returncode == 0, ref.stderr[-3000:]

    work = str(tmp_path / "run")
    # 1) SIGKILL right after the async save of step 6 was started.
    killed = _worker({**common, "workdir": work, "kill_at": 6})
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-3000:])
    ckpt_dir = os.path.join(work, "checkpoints")
    assert _complete_steps(ckpt_dir)[-1] == 4, os.listdir(ckpt_dir)
    leftovers = [d for d in os.listdir(ckpt_dir) if not d.isdigit()]
    assert leftovers, "expected orbax's unfinished temporary directory of step 6"

    # 2) Resume from step 4, then crash (no save) after step 7: last complete is 6.
    crashed = _worker({**common, "workdir": work, "stop_after": 7})
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert 6 in _complete_steps(ckpt_dir)
    assert 7 not in _complete_steps(ckpt_dir)

    # 3) Resume from step 6 to the end.
    out = str(tmp_path / "resumed.npz")
    done = _worker({**common, "workdir": work, "out": out})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done at step 8" in done.stdout

    a, b = np.load(ref_out), np.load(out)
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)  # bit-identical

    # The metrics file describes one run: each train step once, in order.
    steps = [r["step"] for r in map(json.loads, open(os.path.join(work, "metrics.jsonl")))
             if r["split"] == "train"]
    assert steps == list(range(1, 9)), steps
