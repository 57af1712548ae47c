"""The reproduction driver end to end, fastest path: ``experiments.reproduce --mode tiny`` with
the Bebop part only (tiny target from the cache or pretrained, token rows, a CE warm start and two
1-step fine-tunes, evaluation, summary files). Run as a subprocess, like the command line."""
import json
import os
import subprocess
import sys

import pytest
from _shared_once import compile_cache, compile_cache_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.xdist_group("tiny_target")  # shares the cached tiny target with the notebook test
def test_reproduce_tiny_fastest_path(tmp_path, tmp_path_factory):
    # the compilation cache of this test run: the warm start's programs serve the CE fine-tune
    env = dict(os.environ, **compile_cache_env(compile_cache(tmp_path_factory)))
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    cmd = [sys.executable, "-m", "experiments.reproduce", "--mode", "tiny",
           "--workdir", str(tmp_path / "repro"), "--results_dir", str(tmp_path / "results"),
           "--parts", "bebop", "--bebop_losses", "ce,e2e_tv", "--warm", "1", "--fine", "1",
           "--eval_rows", "2", "--anchors", "2", "--mtp_grid", "RS@1,TO@1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.load(open(tmp_path / "repro" / "summary.json"))
    table = summary["bebop"]["table"]
    assert set(table) == {"ce", "e2e_tv"}
    for loss in table:
        for d, m in table[loss].items():
            assert 0.0 <= m["rs"] <= 1.0 and 0.0 <= m["to"] <= 1.0
    for name in ("summary.md", "summary.json", "bebop/results.md", "bebop/results.json",
                 "bebop/acceptance_per_position.png", "bebop/acceptance_vs_entropy.png"):
        assert os.path.exists(tmp_path / "results" / name), name
    assert "Bebop Table 2 analogue" in open(tmp_path / "results" / "summary.md").read()
