"""`python -m experiments.quickstart --tiny` end to end, asserting on the numbers it writes.

The run is a subprocess (a user's single CPU device, not the 8 fake devices of conftest.py) with
every cache under a temporary directory of this test run, made once for all xdist workers. The
assertions are bookkeeping identities and ranges that hold for any model, so a tiny, barely
trained target passes them while a broken pipeline (tokens lost or invented, acceptance counted
wrong, a comparison against the wrong baseline, a cache that does not reuse) does not.
"""
import json
import math
import os
import subprocess
import sys

import pytest
from _shared_once import build_once, compile_cache
from _tiny_runs import hermetic_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The notebook test of 01_quickstart runs on this run's caches: one worker for both.
pytestmark = pytest.mark.xdist_group("tiny_target")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The quickstart's tiny run, once per pytest run (``_shared_once.py``): its target, head and
    summary under a directory of its own. Returns (summary, summary dir, stdout, environment)."""
    cache = compile_cache(tmp_path_factory)

    def build(base):
        proc = subprocess.run([sys.executable, "-m", "experiments.quickstart", "--tiny"],
                              cwd=ROOT, env=hermetic_env(base, cache), capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        (base / "stdout.txt").write_text(proc.stdout)
    base = build_once(tmp_path_factory, "quickstart_tiny", build)
    env = hermetic_env(base, cache)
    out_dir = os.path.join(env["SPECJAX_QUICKSTART_DIR"], "summary_tiny")
    with open(os.path.join(out_dir, "summary.json")) as f:
        s = json.load(f)
    return s, out_dir, (base / "stdout.txt").read_text(), env


def check_comparison(s: dict, sizes) -> None:
    """Asserts the bookkeeping of ``experiments.quickstart.speculative_vs_plain``'s output ``s``
    (also used by the notebook test)."""
    g = s["gamma"]
    assert g == 3 and s["batch"] == 1
    assert [(c["domain"], c["temperature"]) for c in s["cells"]] == [
        ("math", 0.0), ("math", 1.0), ("code", 0.0), ("code", 1.0)]
    for c in s["cells"]:
        dec = c["decoders"]
        for name in ("generate", "engine_none", "speculative"):
            e = dec[name]
            # no stop tokens: every decoder generates exactly what was asked
            assert e["tokens"] == e["requested"] == sizes.prompts_per_domain * sizes.new_tokens
            assert e["wall_s"] > 0 and math.isclose(e["tokens_per_s"], e["tokens"] / e["wall_s"])
        assert c["baseline"] == max(("generate", "engine_none"),
                                    key=lambda n: dec[n]["tokens_per_s"])
        assert math.isclose(c["speedup"], dec["speculative"]["tokens_per_s"] /
                            dec[c["baseline"]]["tokens_per_s"])
        spec = dec["speculative"]
        n, steps = spec["requests"], spec["steps"]
        drafted, accepted = spec["drafted"], spec["accepted"]
        assert n == sizes.prompts_per_domain and len(drafted) == len(accepted) == g
        # at most one verification per step and position; a later position is verified / accepted
        # only with the earlier ones
        assert steps >= drafted[0] > 0
        assert all(a >= b for a, b in zip(drafted, drafted[1:]))
        assert all(a >= b for a, b in zip(accepted, accepted[1:]))
        assert all(0 <= a <= d for a, d in zip(accepted, drafted))
        # each request emits one token at prefill, then accepted + 1 per step; its last step can
        # lose at most γ tokens to max_new_tokens
        emitted = steps + sum(accepted)
        assert spec["tokens"] - n <= emitted <= spec["tokens"] - n + g * n
        assert 1.0 <= spec["tau"] <= g + 1
        assert math.isclose(spec["tau"], (spec["tokens"] - n) / steps)
        for k in range(g):
            assert 0.0 <= spec["reach"][k] <= 1.0 and 0.0 <= spec["alpha"][k] <= 1.0
            if drafted[k]:
                assert math.isclose(spec["reach"][k], accepted[k] / drafted[k])
    # at T = 1 the head's drafts (trained to match the target) are accepted somewhere: an engine
    # that rejects everything fails here
    assert sum(c["decoders"]["speculative"]["accepted"][0] for c in s["cells"]
               if c["temperature"] == 1.0) > 0


def test_tiny_quickstart_counts_add_up(tiny_run):
    from experiments import quickstart
    s, _, stdout, _ = tiny_run
    assert s["tiny"] and s["sizes"]["head_steps"] == quickstart.TINY.head_steps
    check_comparison(s, quickstart.TINY)
    assert "speed-up" in stdout and "α per position" in stdout


def test_tiny_quickstart_writes_the_summary_page(tiny_run):
    s, out_dir, _, _ = tiny_run
    md = open(os.path.join(out_dir, "summary.md")).read()
    png = os.path.join(out_dir, "summary.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 10_000  # two panels, not an empty canvas
    for c in s["cells"]:
        assert f"{c['speedup']:.2f}x" in md
    assert "![summary](summary.png)" in md


def test_tiny_quickstart_head_is_cached_and_keyed(tiny_run, monkeypatch):
    """The head is reused from the cache by a second call, and its key follows its config."""
    import dataclasses

    from experiments import quickstart
    s, _, _, env = tiny_run
    monkeypatch.setenv("SPECJAX_QUICKSTART_DIR", env["SPECJAX_QUICKSTART_DIR"])
    target = quickstart._workdir(True)
    assert s["target_workdir"] == target
    assert not s["head_reused"]  # the run's cache started empty: it trained the head
    config = quickstart.head_config(quickstart.TINY, target)
    assert quickstart.head_workdir(config) == s["head_workdir"]
    wd, _, reused = quickstart.train_head(quickstart.TINY, target)
    assert wd == s["head_workdir"] and reused
    longer = quickstart.head_config(dataclasses.replace(quickstart.TINY, head_steps=6), target)
    assert quickstart.head_workdir(longer) != s["head_workdir"]
