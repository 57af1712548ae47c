"""``specjax serve`` / ``specjax eval`` through ``main()`` and their flags: a random tiny model
exported as an HF checkpoint with the n-gram drafter, and a tiny DSpark drafter trained by
``experiments.train_drafter`` on a tiny target (both made under a temporary directory, see
``_tiny_runs.py``)."""
import io
import json

import pytest
from _tiny_runs import tiny_runs  # noqa: F401  (session fixture)

from specjax import cli
from specjax.data.tokenizer import load_tokenizer
from specjax.models import get_preset, init_model
from specjax.models.generate import generate
from specjax.training.drafter_task import load_target
from specjax.training.lm_task import model_config_from

pytestmark = pytest.mark.xdist_group("tiny_runs")


def _main(argv, stdin=""):
    out = io.StringIO()
    rc = cli.main([str(a) for a in argv], io.StringIO(stdin), out)
    return rc, out.getvalue()


def test_serve_hf_checkpoint_ngram_jsonl_roundtrip(tmp_path):
    from specjax.models.hf_io import save_hf_checkpoint
    model = init_model(get_preset("tiny"), seed=0)
    save_hf_checkpoint(model, None, tmp_path / "hf")
    stdin = ('{"prompt_ids": [1, 2, 3], "temperature": 0, "id": "a"}\n'
             '\n{"prompt_ids": [7, 8], "max_new_tokens": 3, "seed": 4}\n'
             '{"nothing": true}\n')
    rc, out = _main(["serve", "--hf-dir", tmp_path / "hf", "--drafter", "ngram", "--slots", 2,
                     "--max-len", 48, "--gamma", 3, "--max-new-tokens", 5, "--method",
                     "target_only", "--prefill-buckets", 16, "--token-buckets", 8, "--loop",
                     "host"], stdin)
    assert rc == 1  # one bad line, the others served
    lines = [json.loads(l) for l in out.splitlines()]
    assert lines[0] == {"line": 4, "finish_reason": "error",
                        "error": "each request needs 'prompt' or 'prompt_ids'"}
    a, b = lines[1], lines[2]
    ref = generate(model, [[1, 2, 3]], 5, temperature=0.0)[0]
    assert a["id"] == "a" and a["tokens"] == ref and a["finish_reason"] == "length"
    assert len(b["tokens"]) == 3 and b["tau"] == (b["accepted"] + b["steps"]) / b["steps"]


@pytest.mark.parametrize("argv, message", [
    (["--policy", "dspark"], "has no confidence head"),
    (["--policy", "threshold"], "has no confidence head"),
    (["--policy", "fixed", "--gamma", 3, "--k", 4], "--k must be in [1, gamma=3]"),
    (["--gamma", 0], "--gamma must be >= 1"),
    (["--prefill-buckets", "0,16"], "token buckets must be positive ints"),
    (["--slots", 2, "--gamma", 3, "--token-buckets", "4"], "must hold num_slots * (gamma + 1)"),
    (["--drafter", "/no/such/dir"], "not 'ngram' and not a directory"),
    (["--policy", "fixed", "--online-calibration"], "does not read"),
    (["--slots", 2, "--row-buckets", "1,2"], "row_buckets must lie in [1, num_slots)"),
    (["--row-buckets", "half"], "row buckets must be 'auto', 'none' or comma-separated"),
    (["--stale-decay", 1.5], "--stale-decay must be in [0, 1], got 1.5"),
])
def test_bad_combinations_fail_clearly(argv, message, capsys):
    rc, _ = _main(["serve", "--preset", "tiny"] + argv)
    assert rc == 2
    assert message in capsys.readouterr().err


def test_stale_decay_reaches_the_engine_config():
    """``--stale-decay`` is production's ``SchedulerConfig.stale_decay``; left out, the default."""
    from specjax import cli_load
    from specjax.scheduling import SchedulerConfig
    assert cli.parser().parse_args(["serve", "--stale-decay", "0.5"]).stale_decay == 0.5
    loaded = cli_load.load(preset="tiny", drafter="ngram")
    cfg = cli_load.engine_config(loaded, policy="fixed", stale_decay=0.5)
    assert cfg.scheduler.stale_decay == 0.5
    default = cli_load.engine_config(loaded, policy="fixed").scheduler.stale_decay
    assert default == SchedulerConfig.stale_decay != 0.5


def test_version_names_the_stack_and_the_backend(capsys):
    import flax
    import jax

    import specjax
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"specjax {specjax.__version__} (jax {jax.__version__}, jaxlib ")
    assert f"flax {flax.__version__};" in out
    assert f"backend {jax.default_backend()}: {len(jax.devices())} x " in out
    assert out.rstrip().endswith("; no MFU: device not in specjax/aot/chips.py)")  # a CPU


def test_retrospective_policy_is_not_offered(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--policy", "retrospective"])
    assert "invalid choice" in capsys.readouterr().err


def _target(runs):
    with open(runs.target / "config.json") as f:
        from specjax.training.config import validate_config
        cfg = validate_config(json.load(f))
    from flax import nnx
    mcfg = model_config_from(cfg)
    return nnx.merge(*load_target(mcfg, str(runs.target))), mcfg


def test_serve_trained_dspark_drafter_with_dspark_policy(tiny_runs, tmp_path, monkeypatch,
                                                         capsys):
    # the tokenizer is found in the target's data dir: the same SPECJAX_DATA_DIR as its training
    monkeypatch.setenv("SPECJAX_DATA_DIR", tiny_runs.env["SPECJAX_DATA_DIR"])
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text('{"prompt": "The answer is", "temperature": 0, "id": "g"}\n'
                    '{"prompt": "def f(x):", "temperature": 1, "seed": 3, "id": "s"}\n')
    out = tmp_path / "out.jsonl"
    # the drafter's workdir alone: its config.json names the target it was trained against;
    # Algorithm 1 on online-calibrated confidences (greedy output is unchanged by any policy)
    rc, _ = _main(["serve", "--drafter", tiny_runs.dspark, "--policy", "dspark",
                   "--online-calibration", "--slots", 2,
                   "--max-len", 40, "--max-new-tokens", 8, "--profile-reps", 1,
                   "--prefill-buckets", 16, "--token-buckets", "4,8",
                   "--requests", reqs, "--out", out])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "warm-up" in err and "SPS profile on 1 row" in err  # the warm-up's progress bar
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == {"g", "s"}
    model, mcfg = _target(tiny_runs)
    tok = load_tokenizer(tiny_runs.base / "data" / "vocab2048_first30" / "tokenizer.json")
    prompt = [tok.eos_id] + tok.encode("The answer is")  # specjax targets: EOS-first documents
    assert recs["g"]["tokens"] == generate(model, [prompt], 8, temperature=0.0)[0]
    assert recs["g"]["text"] == tok.decode(recs["g"]["tokens"])
    for r in recs.values():
        assert r["finish_reason"] == "length" and len(r["tokens"]) == 8
        assert 0 <= r["accepted"] <= 3 * r["steps"]

    # a target given explicitly must match the drafter's; the drafter check runs before compiling
    rc, _ = _main(["serve", "--drafter", tiny_runs.target, "--target-workdir", tiny_runs.target])
    assert rc == 2 and "not a drafter run" in capsys.readouterr().err


def test_eval_trained_dspark_drafter_per_category(tiny_runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECJAX_DATA_DIR", tiny_runs.env["SPECJAX_DATA_DIR"])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"question_id": 1, "category": "math", "turns": ["What is 3 + 4?", "Times 2?"]}\n'
        '{"question_id": 2, "category": "math", "turns": ["Solve x + 2 = 5."]}\n'
        '{"question_id": 3, "category": "coding", "turns": ["def add(a, b):"]}\n'
        '{"prompt": "Once upon a time"}\n')
    report_path = tmp_path / "eval.json"
    new = 10
    rc, out = _main(["eval", "--target-workdir", tiny_runs.target, "--drafter", tiny_runs.dspark,
                     "--policy", "fixed", "--method", "rejection",
                     "--prompts", prompts, "--out", report_path, "--max-new-tokens", new,
                     "--max-len", 48, "--temperature", 0, "--prefill-buckets", 16,
                     "--token-buckets", 4])
    assert rc == 0, capsys.readouterr().err
    report = json.loads(report_path.read_text())
    cats = report["categories"]
    assert list(cats) == ["math", "coding", "default", "all"]
    assert report["config"]["gamma"] == 3 and report["config"]["turns_used"] == "first"
    n = {"math": 2, "coding": 1, "default": 1, "all": 4}
    for c, m in cats.items():
        assert m["prompts"] == n[c] and m["tokens"] == n[c] * new
        # greedy speculative decoding reproduces plain greedy decoding on the same weights
        assert m["greedy_agreement"] == 1.0
        assert m["tau"] == pytest.approx(1 + m["accepted_drafts"] / m["verify_steps"])
        # per-position counts (the engine's loop statistics) against the results' totals
        verified, accepted = m["verified_per_position"], m["accepted_per_position"]
        assert sum(accepted) == m["accepted_drafts"]
        assert verified[0] <= m["verify_steps"]
        for k, (a, v) in enumerate(zip(accepted, verified)):
            assert 0 <= a <= v
            assert m["acceptance_per_position"][k] == (a / v if v else None)
            assert k == 0 or a <= accepted[k - 1]  # draft k accepted => draft k - 1 accepted
        if m["reached_per_position"] is None:
            assert m["conditional_acceptance_per_position"] is None
        assert m["spec_tok_s"] > 0 and m["plain_tok_s"] > 0
        assert m["speedup"] == pytest.approx(m["spec_tok_s"] / m["plain_tok_s"])
    assert cats["all"]["verify_steps"] == sum(cats[c]["verify_steps"] for c in n if c != "all")
    # fixed K = γ = 3: a step verifies all three drafts unless capped by the tokens left (only
    # near a request's end; each starts with 10 tokens to go), so every position is measured
    verified = cats["all"]["verified_per_position"]
    assert verified[0] >= verified[1] >= verified[2] >= len(n) - 1 > 0
    lines = out.splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith("category"))
    assert lines[head].split() == ["category", "n", "tau", "acc1", "acc2", "acc3", "spec",
                                   "tok/s", "plain", "tok/s", "speedup"]
    assert [l.split()[0] for l in lines[head + 2:head + 6]] == list(cats)


def test_position_counts_from_host_and_device_loop_stats():
    from specjax.cli_eval import position_counts
    from specjax.engine import LoopStats, StepStats

    def step(active, ell, a):
        return StepStats(active=active, bucket=8, tokens=ell + 1, drafts_verified=ell, accepted=a,
                         schedule_s=0.0, step_s=0.0)

    # one request per step: (ℓ, a) = (3, 1), (2, 2), (3, 0), (1, 1) and an idle step
    steps = [step(1, 3, 1), step(1, 2, 2), step(0, 0, 0), step(1, 3, 0), step(1, 1, 1)]
    c = position_counts([], steps, 3)
    assert c["verified"].tolist() == [4, 3, 2]
    assert c["accepted"].tolist() == [3, 1, 0]
    # draft 2 reached in (3, 1) and (2, 2); draft 3 reached in none ((2, 2) verified only two)
    assert c["reached"].tolist() == [4, 2, 0]
    # a step with two active requests cannot be split between them
    assert position_counts([], steps + [step(2, 4, 1)], 3)["verified"] is None
    loops = [LoopStats(steps=2, draft_steps=2, tokens=5, active=2, drafted=[2, 2, 1],
                       accepted=[2, 1, 0], reached=[2, 2, 1], wall_s=0.0),
             LoopStats(steps=1, draft_steps=1, tokens=2, active=1, drafted=[1, 1, 1],
                       accepted=[1, 0, 0], reached=[1, 1, 0], wall_s=0.0)]
    c = position_counts(loops, [], 3)
    assert c["verified"].tolist() == [3, 3, 2] and c["accepted"].tolist() == [3, 1, 0]
    assert c["reached"].tolist() == [3, 3, 1]  # summed over the device loop's calls


def test_eval_bad_prompt_file_names_the_line(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n{"category": "x"}\n')
    rc, _ = _main(["eval", "--preset", "tiny", "--prompts", prompts])
    assert rc == 2
    assert f"{prompts}:2: each line needs 'turns', 'prompt' or 'prompt_ids'" in \
        capsys.readouterr().err
