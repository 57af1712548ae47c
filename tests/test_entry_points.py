"""Every command-line entry point runs, from the command line, in its tiny / quick mode, with every
cache and output under a temporary directory: ``experiments.train`` and
``experiments.train_drafter`` (the session's tiny runs, ``_tiny_runs.py``),
``experiments.reproduce --parts dspark``, ``experiments.offline_eval``, ``specjax.training.bench``
and each benchmark with ``--quick`` (``benchmarks.spec_vs_plain`` on the tiny runs, through
``benchmarks/device_check.sh`` and the bundle ``benchmarks.device_bundle`` packs). Checks are on
what the runs wrote, not only their exit codes."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from _shared_once import build_once, compile_cache
from _tiny_runs import ROOT, hermetic_env, run_module, tiny_runs  # noqa: F401  (session fixture)

from specjax.training import tensorboard as tb
from specjax.training.metrics import read_metrics

TINY_RUNS = pytest.mark.xdist_group("tiny_runs")
# The benchmarks use random weights, not the tiny runs: their own group, so that under
# ``-n 2 --dist loadgroup`` they run beside the tiny-runs chain.
BENCH = pytest.mark.xdist_group("quick_benchmarks")


@pytest.fixture(scope="session")
def repro(tiny_runs, tmp_path_factory):
    """``experiments.reproduce --mode tiny --parts dspark`` on the session's tiny target, made
    smaller still: the DSpark-Markov drafter only, one step per drafter, 2 rows x 2 anchors, two
    training seeds (the second mostly loads the first one's compiled programs). Run
    once per pytest run (``_shared_once.py``), next to the tiny runs it reads."""
    def build(base):
        run_module(tiny_runs.env, "experiments.reproduce", "--mode", "tiny", "--parts", "dspark",
                   "--workdir", base / "work", "--results_dir", base / "results",
                   "--target_workdir", tiny_runs.target, "--dspark_drafters", "dspark_markov",
                   "--dspark_steps", 1, "--draft_lm_steps", 1, "--dspark_eval_rows", 2,
                   "--dspark_anchors", 2, "--dspark_seeds", 2, timeout=900)
    base = build_once(tmp_path_factory, "tiny_runs_repro", build)
    return base / "work", base / "results"


@TINY_RUNS
def test_train_drafter_cli_writes_checkpoint_metrics_and_events(tiny_runs):
    wd = tiny_runs.dspark
    assert "trained 1 steps" in tiny_runs.dspark_stdout
    config = json.load(open(wd / "config.json"))
    assert config["task"]["drafter"] == "dspark" and config["task"]["gamma"] == 3
    assert config["task"]["target_workdir"] == str(tiny_runs.target)
    assert os.listdir(wd / "checkpoints") == ["1"]
    train = [r for r in read_metrics(str(wd / "metrics.jsonl")) if r["split"] == "train"]
    assert [r["step"] for r in train] == [1]
    # the TensorBoard event file next to metrics.jsonl holds the same scalars
    scalars = tb.read_scalars(str(wd))
    for key in ("loss", "alpha_1", "alpha_3", "accept_rate", "conf_bce"):
        assert scalars[f"train/{key}"] == [(1, np.float32(train[0][key]).item())], key
    for key in ("alpha_1", "alpha_2", "alpha_3", "accept_rate"):
        assert 0.0 <= train[0][key] <= 1.0
    # the target's run (experiments.train) writes them too
    assert "train/loss" in tb.read_scalars(str(tiny_runs.target))


@TINY_RUNS
def test_reproduce_dspark_part_tiny(repro):
    work, results = repro
    summary = json.load(open(work / "summary.json"))
    assert "bebop" not in summary
    table = summary["dspark"]["table"]
    assert {k for k, v in table.items() if v} == {"DSpark-Markov", "draft LM", "n-gram"}
    for label, row in table.items():
        for cell, m in row.items():
            assert cell.endswith("@7")
            assert 1.0 <= m["tau"] <= 8.0, (label, cell, m)  # accepted + 1 per step, γ = 7
    assert "dspark_markov_g7" in summary["dspark"]["calibration"]
    # two training seeds: seed 1 under its own run name, pooled in the table and the calibration
    assert summary["dspark"]["seeds"] == 2
    for label in ("DSpark-Markov", "draft LM"):
        assert {m["n_seeds"] for m in table[label].values()} == {2}, label
    assert {m["n_seeds"] for m in table["n-gram"].values()} == {1}  # nothing to train
    over = summary["dspark"]["calibration_over_seeds"]
    assert set(over) == {"dspark_markov_g7"} and over["dspark_markov_g7"]["n_seeds"] == 2
    assert "dspark_markov_g7_s1" in summary["dspark"]["calibration"]
    for name in ("summary.md", "summary.json", "dspark_g7/results.json",
                 "dspark_g7/calibration_dspark_markov_g7.json",
                 "dspark_g7/traces_dspark_markov_g7.npz"):
        assert (results / name).exists(), name
    # every drafter run of the driver wrote its event file
    for run in ("dspark_markov_g7", "draft_lm", "dspark_markov_g7_s1", "draft_lm_s1"):
        assert "train/loss" in tb.read_scalars(str(work / "drafters" / run)), run


@TINY_RUNS
def test_offline_eval_cli(tiny_runs, repro, tmp_path):
    work, _ = repro
    out = tmp_path / "eval"
    run_module(tiny_runs.env, "experiments.offline_eval", "--target_workdir", tiny_runs.target,
               "--eval_file", work / "data" / "heldout.npz", "--drafter",
               f"dspark={tiny_runs.dspark}", "--drafter", "ngram", "--max_rows", 2,
               "--anchors_per_row", 2, "--out", out)
    results = json.load(open(out / "results.json"))
    assert set(results) == {"dspark", "ngram"}
    for name, cells in results.items():
        assert {"greedy@0", "RS@1", "TO@1"} <= set(cells), name
        for cell, doms in cells.items():
            for d, m in doms.items():
                gamma = 3 if name == "dspark" else 4
                assert 1.0 <= m["tau"] <= gamma + 1, (name, cell, d)
                assert len(m["acceptance"]) == gamma
    for f in ("results.md", "acceptance_per_position.png", "calibration_dspark.json",
              "calibration.md"):
        assert (out / f).exists(), f


@TINY_RUNS
def test_device_bundle_then_device_check_quick(tiny_runs, tmp_path):
    """``benchmarks.device_bundle`` packs the tiny runs (params only), and
    ``benchmarks/device_check.sh`` runs from that bundle alone: on CPU its Pallas step skips, and
    its step-cost, verifier-throughput and ``benchmarks.spec_vs_plain --quick`` steps write their
    results."""
    bundle, out = tmp_path / "bundle", tmp_path / "out"
    run_module(tiny_runs.env, "benchmarks.device_bundle", "--target", tiny_runs.target,
               "--drafter", f"dspark={tiny_runs.dspark}", "--out", bundle, "--no-wheels")
    summary = json.load(open(bundle / "bundle.json"))
    assert summary["drafters"]["dspark"]["gamma"] == 3 and summary["target"]["params"] > 0
    run_size = sum(f.stat().st_size for f in (tiny_runs.target / "checkpoints").rglob("*")
                   if f.is_file())
    assert summary["bytes"] < run_size  # no optimizer state
    env = dict(tiny_runs.env, QUICK="1", PYTHON=sys.executable)
    proc = subprocess.run(["bash", "benchmarks/device_check.sh", str(out), str(bundle)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    log = (out / "device_check.log").read_text() if (out / "device_check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log[-3000:]
    steps = dict(line.split(" ", 1) for line in (out / "steps.txt").read_text().splitlines())
    assert set(steps) == {"env", "pallas", "step_cost", "verify", "spec"}, steps
    assert all(v.startswith("rc=0 ") for v in steps.values()), (steps, log[-3000:])
    pallas = log[log.index("===== pallas"):log.index("pallas rc=")]
    assert "1 skipped" in pallas and "passed" not in pallas  # the kernel test needs a GPU / TPU
    # QUICK=1 runs `model_step_cost --quick` and `verify_throughput --quick --reps 1` as they are
    # (their only smoke runs in the suite).
    step_cost = json.load(open(out / "model_step_cost.json"))
    assert "partial" not in step_cost
    (preset,) = step_cost["presets"]
    assert preset["preset"] == "tiny" and [v["K"] for v in preset["verify"]] == [1, 2]
    assert [v["K"] for v in preset["device"]["verify"]] == [1, 2]
    verify = json.load(open(out / "verify_throughput.json"))
    rows = verify["results"]
    assert verify["reps"] == 1
    assert [(r["B"], r["K"], r["V"]) for r in rows] == [(1, 8, 32000), (64, 8, 32000)]
    assert all(r["jnp_ms"] > 0 and not any(k.startswith("pallas_") for k in r) for r in rows)
    r = json.load(open(out / "spec_vs_plain.json"))
    assert "partial" not in r  # the complete result replaced the one written after the cell
    (cell,) = r["cells"]
    assert (cell["domain"], cell["batch"], cell["temperature"]) == ("math", 1, 0.0)
    spec = cell["decoders"]["spec:dspark:fixed"]
    assert spec["tokens"] == 16 and 1.0 <= spec["tau"] <= 4.0  # γ = 3
    assert set(cell["decoders"]) == {"generate_host", "generate", "engine_none",
                                     "spec:dspark:fixed"}
    assert (out / "spec_vs_plain.md").stat().st_size > 0 and (out / "spec_vs_plain.png").exists()


def test_spec_vs_plain_keeps_its_cells_when_stopped_early(tmp_path, monkeypatch):
    """``benchmarks.spec_vs_plain`` writes its JSON after every cell (marked ``partial``), so that a
    run stopped by a time limit, as device_check.sh's steps can be, keeps what it measured."""
    import benchmarks.spec_vs_plain as svp

    def stopped_after_one_cell(args, on_cell=None):
        out = {"cells": [{"domain": "math", "batch": 1}], "_model": object()}
        on_cell(out)
        raise TimeoutError("stopped")

    monkeypatch.setattr(svp, "run", stopped_after_one_cell)
    path = tmp_path / "res" / "spec_vs_plain.json"
    with pytest.raises(TimeoutError):
        svp.main(["--target", "t", "--drafter", "mtp=d", "--out", str(path)])
    r = json.load(open(path))
    assert r["partial"] is True and r["cells"] == [{"domain": "math", "batch": 1}]
    assert "_model" not in r and r["argv"][:2] == ["--target", "t"]


def test_model_step_cost_keeps_its_presets_when_stopped_early(tmp_path, monkeypatch):
    """``benchmarks.model_step_cost`` writes its JSON after every preset (marked ``partial``)."""
    import benchmarks.model_step_cost as msc

    def bench_preset(name, **kw):
        if name == "second":
            raise TimeoutError("stopped")
        return {"preset": name}

    monkeypatch.setattr(msc, "bench_preset", bench_preset)
    path = tmp_path / "res" / "model_step_cost.json"
    with pytest.raises(TimeoutError):
        msc.main(["--presets", "first,second", "--out", str(path)])
    r = json.load(open(path))
    assert r["partial"] is True and r["presets"] == [{"preset": "first"}]


def test_model_step_cost_reports_the_memory_read_bound():
    """A decode step's least read (every matmul weight and each row's cached keys and values
    once), counted by hand for the tiny preset (2 layers, d 64, 4 query / 2 KV heads of 16, MLP
    128, tied vocabulary 256, float32); given a bandwidth, each loop's row reports that read's time
    and the share of it the measured decode step reaches. This CPU is in no chip table: none."""
    import benchmarks.model_step_cost as msc
    from specjax.models import get_preset
    weights = 2 * (64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 128) + 256 * 64
    kv = 2 * 2 * 3 * 8 * 2 * 16  # k and v, 2 layers, 3 rows, 8 positions, 2 heads of 16
    assert msc.decode_read_bytes(get_preset("tiny"), 3, 8) == 4 * (weights + kv)
    row = msc.bench_preset("tiny", batch=1, context=8, max_k=1, reps=1, loops=("device",),
                           steps=2, bandwidth=1e9)
    dev = row["device"]
    assert dev["decode_read_bound_ms"] == pytest.approx(row["decode_read_bytes"] / 1e9 * 1e3)
    assert dev["decode_bandwidth_utilisation"] == pytest.approx(
        dev["decode_read_bound_ms"] / dev["decode_ms"])
    assert msc.device_bandwidth() is None


def test_verify_throughput_records_a_failing_kernel_and_times_the_rest(monkeypatch):
    """On an accelerator ``verify_throughput`` times each compiled Pallas kernel; one that fails to
    compile or run is recorded in the row (``pallas_<backend>_error``), and the row keeps the other
    kernels' and the jnp verifier's figures. On CPU, two stand-in backends: one that fails, and the
    plain-jnp reference, which picks the verifier's tokens."""
    import benchmarks.verify_throughput as vt
    import pallas_kernels.rejection_sampling as RS
    monkeypatch.setattr(RS, "compiled_backends", lambda platform, vocab=None: ["broken", "reference"])
    row = vt.bench_one(2, 3, 256, reps=1)
    assert row["pallas_broken_error"].startswith("ValueError: unknown Pallas backend 'broken'")
    assert "pallas_broken_ms" not in row and "pallas_broken_GBps" not in row
    assert row["pallas_reference_same_tokens"] is True and row["pallas_reference_GBps"] > 0
    assert row["jnp_ms"] > 0 and row["copy_GBps"] > 0


@BENCH
def test_training_bench_cli(tmp_path):
    proc = run_module(hermetic_env(tmp_path), "specjax.training.bench", "--preset", "tiny",
                      "--batch", 2, "--seq-len", 16, "--steps", 1)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["preset"] == "tiny" and r["batch"] == 2 and r["seq_len"] == 16
    assert r["steps_per_s"] > 0 and r["tokens_per_s"] > 0


def test_alternating_runs_rotate_the_order_and_keep_the_untimed_outputs():
    from benchmarks.timing import alternating_runs, decoder_figures
    order = []
    calls = {n: (lambda n=n: order.append(n) or [[n] * (len(order))]) for n in "abc"}
    outs, times = alternating_runs(calls, 3)
    assert order == list("abc") + list("abc") + list("bca") + list("cab")
    assert outs == {"a": [["a"]], "b": [["b", "b"]], "c": [["c"] * 3]}  # the untimed calls'
    assert {n: len(t) for n, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    f = decoder_figures([[1, 2], [3]], [2.0, 1.0, 4.0])
    assert f == {"wall_s": 2.0, "runs_s": [2.0, 1.0, 4.0], "tokens": 3, "tokens_per_s": 1.5}
    # τ leaves each request's first (prefill) token out: (3 - 2) tokens over 4 steps
    assert decoder_figures([[1, 2], [3]], [1.0], steps=4) == {
        "wall_s": 1.0, "runs_s": [1.0], "tokens": 3, "tokens_per_s": 3.0, "steps": 4, "tau": 0.25}


def test_loop_profile_self_times_take_nested_events_off_their_parent():
    """A ``while`` of 10 ns holding two ops of 3 and 4 ns, one of which holds a 1 ns op, and a
    later op on its own: self times 3, 2, 4 and 1 (and 5)."""
    from benchmarks.loop_profile import by_source, self_times
    events = [(0, 10, "while"), (1, 4, "a"), (2, 3, "a.inner"), (5, 9, "b"), (12, 17, "c")]
    assert self_times(events) == {"while": 3, "a": 2, "a.inner": 1, "b": 4, "c": 5}
    assert by_source({"a": 2.0, "b": 4.0, "x": 1.0}, {"a": "f.py:1", "b": "f.py:1"}) == [
        ("f.py:1", 6.0), ("x", 1.0)]


@BENCH
@pytest.mark.parametrize("module, extra, check", [
    ("benchmarks.loss_memory", [], lambda r: {(x["loss"], x["tokens"], x["vocab"])
                                              for x in r["rows"]} >= {("tv", 8, 512)}),
    ("benchmarks.serving", [], lambda r: set(r["closed_loop"]) == {"2"}
     and set(r["closed_loop"]["2"]["policies"]) == {"none", "fixed2", "dspark", "production",
                                                    "production+cal"}
     and r["overlap"]["concurrency"] == 2 and r["overlap"]["policy"] == "dspark"),
    # the loop's time split by source line: shares of the traced loop program sum to 1, no op's
    # self time is negative, the target's and the drafter's code are among the lines
    ("benchmarks.loop_profile", [], lambda r: r["steps"] > 0 and 0 < r["loop_s"] <= r["wall_s"]
     and abs(sum(x["share"] for x in r["rows"]) - 1) < 1e-9
     and min(x["ms_per_step"] for x in r["rows"]) >= 0 and 0 < r["matmul_share"] < 1
     and r["loop_programs"] == 1
     and {"specjax/models/transformer.py", "specjax/drafters/mtp.py"}
     <= {x["source"].split(":")[0] for x in r["rows"]}),
    # the plain loop (policy none): one token per step, and the drafter's code never runs in it
    ("benchmarks.loop_profile", ["--policy", "none"], lambda r: r["tau"] == 1.0
     and r["steps"] > 0 and "specjax/models/transformer.py"
     in {x["source"].split(":")[0] for x in r["rows"]}
     and not any(x["source"].startswith("specjax/drafters/") for x in r["rows"])),
    # one request at a time, every step drafting: both temperatures, lags 1 and 2 with pairs,
    # correlations in [-1, 1] and non-negative errors
    ("benchmarks.confidence_staleness", [], lambda r: [c["temperature"] for c in r["cells"]]
     == [0.0, 1.0] and all(c["requests"] == 2 and c["steps"] > 2 for c in r["cells"])
     and [x["lag"] for x in r["cells"][0]["lags"]] == [1, 2]
     and all(-1 <= x["corr"] <= 1 and min(x["mse_stale"], x["mse_mean"], x["mse_shrunk"],
                                           x["mse_decay"]) >= 0
             for c in r["cells"] for x in c["lags"])
     # the fit's grid runs from the prior alone (0) to the stale vector as it is (1)
     and all(c["decay_fit"]["grid"][0] == 0 and c["decay_fit"]["grid"][-1] == 1
             and c["decay_fit"]["best"] in c["decay_fit"]["grid"] for c in r["cells"])
     and r["best_decay_pooled"] in r["cells"][0]["decay_fit"]["grid"]),
    # the MTP draft step now and as it was emit the same tokens; each cut counts fewer FLOPs
    ("benchmarks.mtp_window", [], lambda r: [d["window"] for d in r["drafters"].values()]
     == [4, 4, 6] and r["drafters"]["speculative"]["propose_flops"]
     < r["drafters"]["speculative_window_only"]["propose_flops"]
     < r["drafters"]["speculative_earlier"]["propose_flops"]
     and all(c["same_tokens"] and c["decoders"]["speculative"]["tokens"] > 0 for c in r["cells"])),
    # one engine with and without row buckets, one sized to the load, generate(): same greedy
    # tokens in every cell; the plot is written beside the JSON
    ("benchmarks.row_buckets", [], lambda r: [(c["policy"], c["load"]) for c in r["cells"]]
     == [("none", 1), ("none", 4), ("fixed", 1), ("fixed", 4)]
     and all(c["same_tokens"] and c["decoders"]["row_buckets"]["tokens"] == 8 * c["load"]
             for c in r["cells"])
     and set(r["warmup_s"]) == {"none/all_slots", "none/row_buckets", "fixed/all_slots",
                                "fixed/row_buckets"}),
    # production with a profile per row bucket and with the all-slot one, fixed K, the fastest
    # plain decoder: same greedy tokens; a profile timed for each row bucket of a 4-slot engine
    ("benchmarks.row_profiles", [], lambda r: [(c["temperature"], c["load"]) for c in r["cells"]]
     == [(0.0, 1), (0.0, 4), (1.0, 1), (1.0, 4)]
     and all(c["same_tokens"] for c in r["cells"] if c["temperature"] == 0)
     and all(c["decoders"][n]["tokens"] == 8 * c["load"] for c in r["cells"]
             for n in ("row_profiles", "slot_profile", "row_profiles_cal", "fixed", "plain"))
     and all(len(c["calibration_rho"]) == 3 for c in r["cells"])
     and r["row_buckets"] == [1, 2] and set(r["profile_s"]) == {"all", "rows1", "rows2"}
     and set(r["profiles"]) == {"all", "rows1", "rows2"}
     and all(p["plain_sps"] > 0 for p in r["profiles"].values())),
])
def test_benchmark_quick(module, extra, check, tmp_path, tmp_path_factory):
    out = tmp_path / "out.json"
    args = ["--quick", "--out", out] + extra
    if module == "benchmarks.serving":
        args += ["--md", tmp_path / "serving.md"]
    # JAX's persistent compilation cache: a benchmark builds fresh engines whose programs repeat
    # (prefill, the host loop's steps for overlap on and off), which then load instead of compile
    run_module(hermetic_env(tmp_path, compile_cache(tmp_path_factory)), module, *args)
    assert check(json.load(open(out)))
    if module in ("benchmarks.row_buckets", "benchmarks.row_profiles",
                  "benchmarks.confidence_staleness"):
        assert (tmp_path / "out.png").stat().st_size > 0
    if module == "benchmarks.confidence_staleness":  # its steps, request by request
        from specjax.sched_sim import Traces
        traces = Traces.load(str(tmp_path / "out_traces.npz"))
        assert traces.gamma == json.load(open(out))["gamma"]
        assert len(traces.request_spans()[0]) >= 2  # both temperatures' requests
