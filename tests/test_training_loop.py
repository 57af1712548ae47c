"""The loop end to end through the command line (embedded corpus, tiny mode), and its parts:
synthetic iterator, metrics file, schedule logging, eval padding, params-only restore."""
import json
import os

import jax
import numpy as np
import pytest
from _train_common import train_cli

from specjax.training import (SyntheticLMIterator, Trainer, make_mesh, restore_params,
                              validate_config)
from specjax.training.checkpoint import abstract_with_shardings
from specjax.training.inputs import pad_rows
from specjax.training.metrics import MetricsWriter, plot_loss_curve, read_metrics
from specjax.training.optimizer import make_schedule


def _tiny_run(tmp):
    """``experiments.train`` on pretrain_target.py:tiny (30-document corpus subset, 4 steps),
    twice in the same workdir, with one layer instead of the preset's two: a model override
    given on the command line (a key the config file does not set)."""
    workdir, data_dir = str(tmp / "run"), str(tmp / "data")
    args = ["--config", "experiments/configs/pretrain_target.py:tiny",
            f"--config.data.data_dir={data_dir}", "--config.checkpoint.keep=1",
            "--config.model.overrides.num_layers=1", "--workdir", workdir]
    first = train_cli(*args)
    assert first.returncode == 0, first.stderr[-4000:]
    lines_after_first = len(read_metrics(os.path.join(workdir, "metrics.jsonl")))
    again = train_cli(*args)  # finished run in the same workdir: restores, re-evaluates, no training
    assert again.returncode == 0, again.stderr[-4000:]
    return workdir, first, again, lines_after_first


def test_cli_trains_logs_evaluates_checkpoints_and_reopens(tmp_path):
    # One test (not a shared fixture): the two CLI runs are the expensive part, and xdist's
    # loadgroup does not keep a module on one worker with pytest 9.2 + xdist 3.8.
    workdir, first, again, n_lines = _tiny_run(tmp_path)
    for domain in ("math", "code", "prose"):
        assert f"{domain}: held-out loss" in first.stdout
        assert f"{domain}: held-out loss" in again.stdout
    assert "trained 4 steps" in first.stdout and "trained 4 steps" in again.stdout

    config = validate_config(json.load(open(os.path.join(workdir, "config.json"))))
    assert config.model.preset == "tiny" and config.data.kind == "embedded"
    assert dict(config.model.overrides) == {"vocab_size": 2048, "num_layers": 1}
    records = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    assert len(records) == n_lines, "re-opening a finished run appends nothing"
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    # Model FLOPs of a step, by hand (PaLM appendix B): the tiny preset with one layer (D 64,
    # F 128, 4 heads and 2 KV heads of 16) and V 2048 has N = 64·16·(2·4 + 2·2) + 3·64·128 +
    # 2048·64 matmul weights; a row of T tokens costs 3 (2 N + 4·1·4·16·T) T. No MFU on a CPU.
    n, t = 64 * 16 * 12 + 3 * 64 * 128 + 2048 * 64, config.data.seq_len
    per_step = config.data.batch_size * 3 * (2 * n + 4 * 4 * 16 * t) * t
    for r in train:
        assert r["model_tflops_per_sec"] == pytest.approx(r["steps_per_sec"] * per_step / 1e12,
                                                          rel=1e-9)
        assert "mfu" not in r
    schedule = make_schedule(config.optimizer, config.train.num_steps)
    for r in train:  # the logged LR is the one the last update of the interval used
        assert r["lr"] == pytest.approx(float(schedule(r["step"] - 1)), rel=1e-6)
        assert r["tokens"] > 0 and np.isfinite(r["grad_norm"])
    assert train[-1]["loss"] < train[0]["loss"]
    evals = {r["split"]: r for r in records if r["split"].startswith("eval/")}
    assert set(evals) == {"eval/math", "eval/code", "eval/prose"}
    assert all(e["step"] == 4 and 0 < e["ce"] < 10 for e in evals.values())

    with open(os.path.join(workdir, "loss_curve.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4"]  # keep=1
    _check_params_only_restore(workdir)
    _check_continued_math_stage(workdir, tmp_path)


def _check_continued_math_stage(workdir, tmp):
    """``task.init_from`` starts a new LM run from another run's newest params (fresh optimizer
    at step 0), and ``data.train_domains`` trains on the listed domains only (pretrain_target.py's
    math stage); a domain the corpus does not have is refused."""
    from specjax.training.errors import ConfigError
    from specjax.training.run import make_inputs
    config = json.load(open(os.path.join(workdir, "config.json")))
    config["task"]["init_from"] = workdir
    config["data"]["train_domains"] = "math"
    config = validate_config(config)
    trainer = Trainer(config, workdir=str(tmp / "math_stage"),
                      mesh=make_mesh(config.mesh.to_dict(), jax.devices()[:1]))
    state = trainer.restore_or_init()
    assert int(state.step) == 0
    want = restore_params(os.path.join(workdir, "checkpoints"), abstract_with_shardings(
        trainer.abstract_state.params, trainer.state_shardings.params))
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    trainer.close()
    train, evals, _ = make_inputs(config, config.model.overrides.vocab_size)
    assert [name.split("_")[0] for name in train.spec["sources"]] == ["math"]
    assert set(evals) == {"math", "code", "prose"}  # held-out evaluation keeps every domain
    for bad in ("maths", "math,poetry"):
        config_bad = json.loads(json.dumps(config.to_dict()))
        config_bad["data"]["train_domains"] = bad
        with pytest.raises(ConfigError, match="train_domains"):
            validate_config(config_bad)


def _check_params_only_restore(workdir):
    """restore_params (what drafter tasks use for the frozen target) == the full restore."""
    config = json.load(open(os.path.join(workdir, "config.json")))
    config["mesh"] = {"data": 1, "fsdp": 2, "tensor": 1}  # restore into a different layout
    trainer = Trainer(config, workdir=workdir, mesh=make_mesh(config["mesh"], jax.devices()[:2]))
    full = trainer.restore_or_init()
    assert int(full.step) == 4
    abstract = abstract_with_shardings(trainer.abstract_state.params,
                                       trainer.state_shardings.params)
    params = restore_params(os.path.join(workdir, "checkpoints"), abstract)
    assert len(params["layers"]) == 1  # the command line's num_layers=1 built the model
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(full.params)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    trainer.close()


def test_synthetic_iterator_is_resumable_sharded_and_packed():
    kw = dict(batch_size=3, seq_len=16, vocab_size=50, seed=1)
    a, b = SyntheticLMIterator(**kw), SyntheticLMIterator(**kw)
    next(a), next(a)
    b.set_state(a.get_state())
    np.testing.assert_array_equal(next(a)["inputs"], next(b)["inputs"])
    s0 = SyntheticLMIterator(shard_index=0, num_shards=2, **kw).batch_at(0)
    s1 = SyntheticLMIterator(shard_index=1, num_shards=2, **kw).batch_at(0)
    assert not np.array_equal(s0["inputs"], s1["inputs"])
    with pytest.raises(ValueError, match="shard 0 restored into shard 1"):
        SyntheticLMIterator(shard_index=1, num_shards=2, **kw).set_state({"step": 0,
                                                                         "shard_index": 0})
    for row in range(3):  # targets are the next token inside each document, masked at its end
        seg, mask = s0["segment_ids"][row], s0["loss_mask"][row].astype(bool)
        same_doc = seg[1:] == seg[:-1]
        np.testing.assert_array_equal(mask[:-1], same_doc)
        np.testing.assert_array_equal(s0["targets"][row, :-1][same_doc],
                                      s0["inputs"][row, 1:][same_doc])
        assert s0["positions"][row, 0] == 0 and (s0["positions"][row][1:][~same_doc] == 0).all()


def test_eval_padding_rows_carry_no_loss():
    batch = SyntheticLMIterator(batch_size=3, seq_len=8, vocab_size=20).batch_at(0)
    padded = pad_rows(batch, 4)
    assert padded["inputs"].shape == (4, 8) and padded["loss_mask"][3].sum() == 0
    assert (padded["segment_ids"][3] > 0).all()
    with pytest.raises(ValueError, match="without a loss_mask"):
        pad_rows({"inputs": batch["inputs"], "targets": batch["targets"]}, 4)


def test_metrics_writer_resume_drops_lines_after_checkpoint(tmp_path):
    path = str(tmp_path / "m.jsonl")
    w = MetricsWriter(path)
    for step in range(1, 7):
        w.write(step, "train", {"loss": 5.0 - step * 0.1, "lr": 1e-3})
    w.write(6, "eval/math", {"ce": 1.0})
    with open(path, "a") as f:
        f.write('{"step": 7, "spl')  # torn line of a killed process
    MetricsWriter(path, resume_step=4).write(5, "train", {"loss": 4.5, "lr": 1e-3})
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    plot_loss_curve(path, str(tmp_path / "c.png"))
    assert os.path.getsize(tmp_path / "c.png") > 1000


class _FrozenTeacherTask:
    """A minimal task with a frozen pytree: fit a bias b so that x @ W_teacher + b matches y.
    Stands in for drafter training against a frozen target."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.teacher = {"w": rng.normal(size=(8, 16)).astype(np.float32)}

    def init_params(self, rng):
        return {"b": jax.numpy.zeros((16,), jax.numpy.float32)}

    def param_logical_axes(self):
        return {"b": ("vocab",)}

    def init_frozen(self):
        return self.teacher

    def frozen_logical_axes(self):
        return {"w": ("embed", "vocab")}

    def loss_fn(self, params, batch, rng, frozen):
        x = batch["inputs"].astype(np.float32)[:, :8]
        pred = x @ frozen["w"] + params["b"]
        loss = ((pred - 1.0) ** 2).mean()
        return loss, {"loss_weight": jax.numpy.float32(x.shape[0])}


def test_frozen_pytree_is_sharded_never_optimized_and_not_checkpointed(tmp_path):
    from jax.sharding import PartitionSpec as P

    from specjax.training import TrainTask

    task = _FrozenTeacherTask()
    assert isinstance(task, TrainTask)
    config = {"data": {"kind": "synthetic", "seq_len": 16, "batch_size": 4},
              "train": {"num_steps": 3, "log_every": 1}, "optimizer": {"warmup_steps": 1},
              "output": {"progress_bar": False, "plot": False},
              "checkpoint": {"every": 3}, "mesh": {"data": 1, "fsdp": 2, "tensor": 2}}
    mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 2}, devices=jax.devices()[:4])
    trainer = Trainer(config, workdir=str(tmp_path), task=task, mesh=mesh)
    assert trainer.frozen["w"].sharding.spec == P("fsdp", "tensor")
    it = SyntheticLMIterator(batch_size=4, seq_len=16, vocab_size=50)
    state = trainer.train(it)
    # Only the bias is trained: optimizer leaves are b-shaped or scalars, never W-shaped.
    shapes = {tuple(x.shape) for x in jax.tree.leaves(state.opt_state)}
    assert (8, 16) not in shapes and (16,) in shapes
    assert float(np.abs(np.asarray(state.params["b"])).sum()) > 0
    # The frozen teacher is untouched and still alive (not donated).
    np.testing.assert_array_equal(np.asarray(trainer.frozen["w"]), task.teacher["w"])
    ckpt = os.path.join(str(tmp_path), "checkpoints", "3", "state")
    assert os.path.isdir(ckpt)
    restored = trainer.restore_or_init()
    assert set(restored.params) == {"b"} and int(restored.step) == 3
    trainer.close()
