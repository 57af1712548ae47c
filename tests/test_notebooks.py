"""Executes the notebooks headless (nbclient; the same as ``pytest --nbmake notebooks/``) in their
tiny mode (``SPECJAX_NOTEBOOK_TINY=1``) and asserts on the numbers they produce.

The kernel is a fresh process with one CPU device (a user's session, not the 8 fake devices of
conftest.py), this checkout first on its path, and the caches of the test worker (notebooks run
by the same worker share its tiny target and MTP head). Assertions are ranges and bookkeeping
identities any model satisfies: a tiny, barely trained model passes them, a broken pipeline does
not.
"""
import json
import math
import os

import pytest
from _notebook_extras import (SITE_DIR, blocked_modules, declared_extras, installed_extras,
                              setup_cell, setup_cell_pip, setup_cfg_extras)
from _shared_once import compile_cache, compile_cache_env
from _xla_flags import without_device_count
from test_quickstart import tiny_run  # noqa: F401  (module fixture: the command-line tiny run)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")


def _execute(name: str, workdir, jax_cache=None, env=None) -> str:
    """Runs notebooks/<name> in tiny mode with ``workdir`` as its work directory; returns the
    text of its outputs. With ``jax_cache``, the kernel uses JAX's persistent compilation cache
    there (see ``_shared_once.compile_cache``); ``env``: more variables for the kernel."""
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed")
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        f"{name}: outputs must be stripped in git"
    extra = dict(compile_cache_env(jax_cache) if jax_cache is not None else {}, **(env or {}))
    # The packages of the extras the setup cell does not install are hidden from the kernel
    # (notebook_site/sitecustomize.py): as on a fresh Colab runtime after that cell.
    extra["SPECJAX_NOTEBOOK_BLOCK"] = ",".join(
        blocked_modules(declared_extras(setup_cell(nb))))
    keys = ("SPECJAX_NOTEBOOK_WORKDIR", "SPECJAX_NOTEBOOK_TINY", "XLA_FLAGS", "PYTHONPATH",
            *extra)
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(extra)
    os.environ["SPECJAX_NOTEBOOK_WORKDIR"] = str(workdir)
    os.environ["SPECJAX_NOTEBOOK_TINY"] = "1"
    os.environ["XLA_FLAGS"] = without_device_count(saved["XLA_FLAGS"] or "")
    os.environ["PYTHONPATH"] = os.pathsep.join([SITE_DIR, ROOT, saved["PYTHONPATH"] or ""])
    try:
        client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                         resources={"metadata": {"path": NOTEBOOKS}})
        client.execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []))


def test_no_notebook_forces_a_backend():
    for name in sorted(os.listdir(NOTEBOOKS)):
        if name.endswith(".ipynb"):
            text = open(os.path.join(NOTEBOOKS, name)).read()
            assert "JAX_PLATFORMS" not in text, name
            assert "SPECJAX_NOTEBOOK_TINY" in text, f"{name} has no tiny mode"


def test_setup_cells_install_the_extras_their_notebook_needs(tmp_path, monkeypatch):
    """Each notebook's setup cell installs the checkout with the extras it names (the ones the
    kernels of the tests below keep; the others' packages are hidden there) when the package or
    one of those extras is missing, and installs nothing when all are there. Notebook 04 trains
    through Tunix: it needs the ``rl`` extra."""
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed")
    extras_of = setup_cfg_extras()
    names = sorted(n for n in os.listdir(NOTEBOOKS) if n.endswith(".ipynb"))
    needs = {}
    for name in names:
        source = setup_cell(nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4))
        declared = declared_extras(source)
        needs[name] = declared
        with monkeypatch.context() as m:
            assert setup_cell_pip(source, set(), m, tmp_path) is None, name
        with monkeypatch.context() as m:
            line = setup_cell_pip(source, {"specjax"}, m, tmp_path)
        assert line is not None and installed_extras(line) == declared, (name, line)
        for extra in declared:
            for dist in extras_of[extra]:
                with monkeypatch.context() as m:
                    line = setup_cell_pip(source, {dist}, m, tmp_path)
                assert line is not None and installed_extras(line) == declared, (name, dist)
    assert needs["04_rl_grpo.ipynb"] == {"rl"}


def test_kernels_cannot_import_the_packages_of_undeclared_extras():
    """The hiding the notebook kernels run under: a blocked package (and its submodules) fails to
    import as if absent; everything else imports."""
    import subprocess
    import sys
    code = ("import importlib, json\n"
            "for m in ('tunix', 'tunix.rl', 'json', 'numpy'):\n"
            "    try:\n"
            "        importlib.import_module(m); print(m, 'ok')\n"
            "    except ModuleNotFoundError as e:\n"
            "        print(m, 'missing', e.name)\n")
    env = dict(os.environ, PYTHONPATH=SITE_DIR, SPECJAX_NOTEBOOK_BLOCK="tunix,torch")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[:4] == ["tunix missing tunix", "tunix.rl missing tunix", "json ok", "numpy ok"]
    pytest.importorskip("tunix", reason="tunix (the rl extra) is not installed")
    assert "tunix" in blocked_modules(set()) and "tunix" not in blocked_modules({"rl"})


@pytest.mark.xdist_group("tiny_target")
def test_01_quickstart(tmp_path, tmp_path_factory, tiny_run):
    """The notebook's path after ``make quickstart``: the tiny target and head come from the
    caches of the command-line run (``test_quickstart.tiny_run``, which trains them); the
    notebook loads them, compares the decoders and plots."""
    from test_quickstart import check_comparison

    from experiments import quickstart
    cached = {k: tiny_run[3][k] for k in ("SPECJAX_DATA_DIR", "SPECJAX_TARGET_CACHE",
                                          "SPECJAX_QUICKSTART_DIR")}
    out = _execute("01_quickstart.ipynb", tmp_path, compile_cache(tmp_path_factory), env=cached)
    assert "reused from the cache" in out  # the head the command-line run trained
    with open(tmp_path / "01_quickstart.json") as f:
        comparison = json.load(f)
    check_comparison(comparison, quickstart.TINY)
    assert "checks passed" in out
    with open(tmp_path / "01_quickstart.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.xdist_group("tiny_target")
def test_02_bebop_losses(tmp_path, tmp_path_factory):
    out = _execute("02_bebop_losses.ipynb", tmp_path, compile_cache(tmp_path_factory))
    with open(tmp_path / "02_bebop" / "summary.json") as f:
        summary = json.load(f)
    table = summary["bebop"]["table"]
    assert set(table) == {"ce", "e2e_tv"}
    for loss, row in table.items():
        assert set(row) == {"math", "code", "prose", "all"}, loss
        for d, m in row.items():
            assert 0 <= m["rs"] <= 1 and 0 <= m["to"] <= 1, (loss, d)
            assert math.isfinite(m["rs_slope"]) and math.isfinite(m["to_slope"]), (loss, d)
    for name, cells in summary["bebop"]["results"].items():
        assert set(cells) == {"RS@1", "TO@1"}, name
        for cell, by_domain in cells.items():
            for d, m in by_domain.items():
                alpha = m["acceptance"]  # None: a position no draft reached
                assert len(alpha) == 3 and alpha[0] is not None, (name, cell, d)
                assert all(a is None or 0 <= a <= 1 for a in alpha), (name, cell, d)
                reached = [a for a in alpha if a is not None]
                assert alpha[:len(reached)] == reached, (name, cell, d)  # unreached: a suffix
                # τ = 1 + accepted per step: between 1 and γ + 1, and accept_rate = (τ − 1) / γ
                assert 1 <= m["tau"] <= 4, (name, cell, d)
                assert math.isclose(m["accept_rate"], (m["tau"] - 1) / 3, abs_tol=1e-9)
    assert "checks passed" in out
    for png in ("acceptance_per_position.png", "acceptance_vs_entropy.png"):
        assert os.path.getsize(tmp_path / "02_bebop" / "results" / "bebop" / png) > 10_000
    # The notebook runs the reproduction driver's Bebop part through its argv entry point
    # (experiments.reproduce.main): the summary files and per-part results it writes.
    assert "Bebop Table 2 analogue" in (tmp_path / "02_bebop" / "summary.md").read_text()
    for name in ("results.md", "results.json"):
        assert (tmp_path / "02_bebop" / "results" / "bebop" / name).exists(), name


@pytest.mark.xdist_group("tiny_target")
def test_03_dspark(tmp_path, tmp_path_factory):
    out = _execute("03_dspark.ipynb", tmp_path, compile_cache(tmp_path_factory))
    with open(tmp_path / "03_dspark.json") as f:
        res = json.load(f)
    gamma = res["gamma"]
    assert gamma == 7
    assert set(res["served"]) == {"fixed", "threshold", "dspark"}
    for name, s in res["served"].items():
        assert s["tokens"] == s["requested"] == 4 * 16, name
        assert 1 <= s["tau"] <= gamma + 1, name
        # a 2-slot engine emits at most 2 slot-steps of tokens per engine step
        assert s["tokens_per_engine_step"] <= 2 * (gamma + 1), name
    assert {"DFlash", "DSpark-Markov"} <= set(res["table"])
    for label in ("DFlash", "DSpark-Markov"):
        for cell, m in res["table"][label].items():
            assert 1 <= m["tau"] <= gamma + 1 and 1 <= m["tau_pred"] <= gamma + 1, (label, cell)
    cal = res["calibration"]["dspark_markov_g7"]
    assert len(cal["ece_before"]) == len(cal["ece_after"]) == gamma
    assert all(0 <= e <= 1 for e in cal["ece_before"] + cal["ece_after"])
    assert all(t > 0 for t in cal["temperatures"])
    assert "checks passed" in out
    assert os.path.getsize(tmp_path / "03_dspark" / "results" / "dspark_g7" /
                           "reliability_dspark_markov_g7.png") > 10_000


@pytest.mark.xdist_group("tiny_target")  # shares the cached tiny target with the notebooks above
def test_drafter_quicktour_runs(tmp_path, tmp_path_factory):
    out = _execute("drafter_quicktour.ipynb", tmp_path, compile_cache(tmp_path_factory))
    assert "predicted 1 + sum prod alpha" in out
    assert os.path.exists(tmp_path / "eval" / "acceptance_per_position.png")


@pytest.mark.xdist_group("rl")
def test_04_rl_grpo(tmp_path, tmp_path_factory):
    pytest.importorskip("tunix", reason="tunix (the rl extra) is not installed")
    out = _execute("04_rl_grpo.ipynb", tmp_path, compile_cache(tmp_path_factory))
    with open(tmp_path / "04_rl_grpo.json") as f:
        res = json.load(f)
    cfg, steps = res["config"], res["steps"]
    g, new = cfg["gamma"], cfg["max_new_tokens"]
    batch = cfg["prompts_per_step"] * cfg["num_generations"]
    assert res["results"]["start_step"] == 0 and res["results"]["end_step"] == cfg["steps"] == 2
    assert [s["step"] for s in steps] == list(range(cfg["steps"]))  # one rollout per step run
    versions = [s["weights_version"] for s in steps]
    assert all(a < b for a, b in zip(versions, versions[1:]))  # each step served updated weights
    for s in steps:
        assert s["sequences"] == batch and batch <= s["tokens"] <= batch * new, s
        assert 0 <= s["accepted"] <= s["drafted"], s
        assert math.isclose(s["acceptance"], s["accepted"] / s["drafted"]), s
        assert math.isclose(s["tau"], (s["tokens"] - batch) / s["steps"]) and 1 <= s["tau"] <= g + 1
        emitted = s["tokens"] - batch  # a verification step emits accepted + 1 tokens, fewer at a stop
        assert emitted <= s["steps"] + s["accepted"] <= emitted + g * batch, s
        assert set(s["reward"]) == {"correct", "fmt"}, s
        assert all(r["n"] == batch and 0 <= r["mean"] <= 1 for r in s["reward"].values()), s
        # the exactness monitor's panel: a finite gap (no impossible token) with a spread
        assert math.isfinite(s["exactness_gap"]) and s["exactness_gap_se"] > 0, s
    ex = res["results"]["exactness"]  # pooled over the two steps: too few for a verdict
    assert ex["steps"] == 2 and ex["holds"] is None
    assert math.isclose(ex["gap_nats"][0], sum(s["exactness_gap"] for s in steps) / 2)
    speed = res["results"]["rollout_speed"]
    assert speed["sequences"] == batch and speed["max_new_tokens"] == new
    for name in ("speculative", "plain"):
        d = speed[name]
        assert len(d["tokens"]) == len(d["seconds"]) == speed["repeats"] >= 1, name
        assert all(batch <= t <= batch * new for t in d["tokens"]), name
        rates = sorted(t / s for t, s in zip(d["tokens"], d["seconds"]))
        assert rates[0] <= d["tokens_per_s"] <= rates[-1], name  # the median of the timed calls
    r = res["results"]
    assert r["eval_samples"] >= 1 and "held-out sampled accuracy" in out
    for key in ("heldout_sampled_accuracy_start", "heldout_sampled_accuracy_end"):
        assert 0.0 <= r[key] <= 1.0, key
    assert math.isclose(r["heldout_sampled_gain"][0], r["heldout_sampled_accuracy_end"] -
                        r["heldout_sampled_accuracy_start"], abs_tol=1e-12)
    assert "checks passed" in out
    assert os.path.getsize(tmp_path / "04_rl_grpo.png") > 10_000
