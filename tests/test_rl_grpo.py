"""A tiny GRPO run through Tunix with SpeculativeRollout (``experiments/configs/rl_grpo.py:tiny``)
on the test session's 8 fake CPU devices, then a resume from its Orbax checkpoint."""
import json
import os

import numpy as np
import pytest

pytest.importorskip("tunix")

from experiments import rl  # noqa: E402
from experiments.configs import rl_grpo  # noqa: E402

pytestmark = pytest.mark.xdist_group("rl")


def _lines(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


def test_tiny_grpo_runs_resumes_and_serves_fresh_weights(tmp_path):
    import jax
    assert len(jax.devices()) == 8  # tests/conftest.py: the mesh spans 8 devices
    config = rl_grpo.get_config("tiny")
    res = rl.run(config, str(tmp_path))
    assert res["devices"] == 8 and res["start_step"] == 0 and res["end_step"] == 2
    lines = _lines(tmp_path / "rollout.jsonl")
    train = [m for m in lines if m["mode"] == "train"]
    assert len(train) == 2
    # every train rollout was served by weights no older than the previous update
    assert train[1]["weights_version"] > train[0]["weights_version"]
    assert all(m["drafted"] > 0 and 0 <= m["accepted"] <= m["drafted"] for m in train)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tensorboard"))
    assert os.path.isdir(tmp_path / "checkpoints" / "actor" / "2")
    # held-out evaluation before and after: greedy (8 problems), then 2 samples per problem
    assert [m["sequences"] for m in lines if m["mode"] == "eval"] == [8, 16, 8, 16]
    assert res["eval_samples"] == 2
    for metric in ("accuracy", "sampled_accuracy"):
        start, end = res[f"heldout_{metric}_start"], res[f"heldout_{metric}_end"]
        assert 0.0 <= start <= 1.0 and 0.0 <= end <= 1.0, metric
        gain = res["heldout_greedy_gain" if metric == "accuracy" else "heldout_sampled_gain"]
        assert gain[0] == pytest.approx(end - start, abs=1e-12), metric

    config.unlock()
    config.rl.steps = 3
    res2 = rl.run(config, str(tmp_path))
    assert res2["start_step"] == 2 and res2["end_step"] == 3
    assert len([m for m in _lines(tmp_path / "rollout.jsonl") if m["mode"] == "train"]) == 3
    # one line per reward function and training step, numbered across the resume
    rewards = _lines(tmp_path / "rewards.jsonl")
    for name in ("correct", "fmt"):
        lines = [x for x in rewards if x["reward"] == name]
        assert [x["step"] for x in lines] == [0, 1, 2], name
        assert all(x["n"] == 2 * 4 and 0 <= x["mean"] <= 1 for x in lines), name
    # results.json: the mean reward of the first and last quarter of the steps, per function
    trend = res2["reward_trend"]
    for name in ("correct", "fmt"):
        means = [x["mean"] for x in rewards if x["reward"] == name]
        assert trend[name] == {"steps": 3, "first_quarter": pytest.approx(means[0]),
                               "last_quarter": pytest.approx(means[-1])}, name
    # the training rollouts' exactness monitor, pooled over the three (too few for a verdict)
    gaps = [m["exactness_gap"] for m in _lines(tmp_path / "rollout.jsonl") if m["mode"] == "train"]
    ex = res2["exactness"]
    assert ex["steps"] == 3 and ex["holds"] is None
    assert ex["gap_nats"] == pytest.approx([np.mean(gaps), np.std(gaps, ddof=1) / np.sqrt(3)])


def test_digit_reward_and_unknown_reward_kind(tmp_path):
    """The sanity reward is the fraction of digit characters; a reward kind the entry point does
    not know is refused before anything is built."""
    from specjax.rl import task as T
    assert T.digit_reward(None, ["a1b2", "", "123", "xyz"]) == [0.5, 0.0, 1.0, 0.0]
    config = rl_grpo.get_config("tiny")
    config.unlock()
    config.task.reward = "length"
    with pytest.raises(ValueError, match="task.reward"):
        rl.run(config, str(tmp_path))
