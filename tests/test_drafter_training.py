"""Drafter training against a frozen target (specjax/training/drafter_task.py).

* every loss kind decreases over a few steps on a tiny sharp target (MTP for ce / kl / rkl / tv /
  e2e_tv, DSpark-Markov with its confidence head for the DSpark objective);
* the teacher is frozen: its params are bit-identical after training, nothing target-shaped is in
  the trained params or the optimizer state, and the shared embedding / LM head are not trainable;
* a CE-warm-start → TV run switches loss at the configured step, and a run killed after step 3
  and resumed from its step-2 checkpoint ends with exactly the params of an uninterrupted run
  (the loss phase and the anchor-sampling RNG are restored);
* anchor sampling, segment masking, config validation, the token-row data helpers.
"""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from specjax.training import ConfigError, default_config, make_mesh, validate_config
from specjax.training import drafter_data
from specjax.training.drafter_run import run_drafter
from specjax.training.drafter_task import DrafterTask, LossPhaseIterator

sys.path.insert(0, os.path.dirname(__file__))
import test_drafters_common as C  # noqa: E402  (the tiny sharp target of the drafter tests)
from _shared_once import in_process_compile_cache  # noqa: E402

CONFIG_OVERRIDES = dict(vocab_size=C.VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8)


def make_config(**task):
    c = default_config("drafter")
    c.model.preset = "tiny"
    for k, v in CONFIG_OVERRIDES.items():
        c.model.overrides[k] = v
    c.data.seq_len = 24
    c.data.batch_size = 4
    c.data.eval_batches = 0
    c.train.num_steps = 4
    c.train.log_every = 1
    c.optimizer.learning_rate = 3e-3
    c.optimizer.warmup_steps = 1
    c.checkpoint.every = 2
    c.checkpoint.keep = 5
    c.output.progress_bar = False
    c.output.plot = False
    c.task.gamma = 3
    c.task.mtp.intermediate_size = 32
    c.task.dspark.target_layers = "1,2"
    c.task.dspark.rank = 8
    for k, v in task.items():
        node = c.task
        *parents, leaf = k.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = v
    return validate_config(c)


def sharp_target_params():
    return nnx.to_pure_dict(C.target()[1])


def make_task(config):
    task = DrafterTask(config)
    task._frozen = sharp_target_params()  # the sharp teacher instead of a random init
    return task


def one_device_mesh():
    return make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])


def synthetic_batch(seed=0, b=4, t=24):
    from specjax.training.inputs import SyntheticLMIterator
    it = SyntheticLMIterator(batch_size=b, seq_len=t, vocab_size=C.VOCAB, seed=seed)
    return {k: jnp.asarray(v) for k, v in next(it).items()}


@pytest.mark.parametrize("loss,drafter", [("ce", "mtp"), ("kl", "mtp"), ("rkl", "mtp"),
                                          ("tv", "mtp"), ("e2e_tv", "mtp"),
                                          ("dspark", "dspark")])
def test_loss_decreases(loss, drafter):
    config = make_config(loss=loss, drafter=drafter,
                         anchors_per_row=8 if drafter == "dspark" else 0)
    task = make_task(config)
    frozen = task.init_frozen()
    params = jax.jit(task.init_params)(jax.random.PRNGKey(0))
    tx = optax.adam(1e-2)
    opt = tx.init(params)
    batch = synthetic_batch()
    rng = jax.random.PRNGKey(7)  # same anchors every step: a fixed objective

    @jax.jit
    def step(params, opt):
        (l, m), g = jax.value_and_grad(task.loss_fn, has_aux=True)(params, batch, rng, frozen)
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt, l, m

    losses = []
    for _ in range(8):
        params, opt, l, m = step(params, opt)
        losses.append(float(l))
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.85 * losses[0], (loss, losses)
    if drafter == "dspark":
        assert "conf_bce" in m
    assert 0.0 < float(m["accept_rate"]) <= 1.0


def test_anchor_sampling_and_segment_mask():
    config = make_config(anchors_per_row=5)
    task = make_task(config)
    seg = jnp.array([[1] * 10 + [2] * 6 + [0] * 8, [1] * 3 + [0] * 21], jnp.int32)
    anchors = np.asarray(task.sample_anchors(jax.random.PRNGKey(0), seg))
    assert anchors.shape == (2, 5)
    # row 0: valid anchors i have seg[i] == seg[i+2] > 0: 0..7 and 10..13
    assert set(anchors[0]) <= set(range(8)) | set(range(10, 14))
    assert len(set(anchors[0])) == 5
    assert sorted(anchors[1]) == [-1, -1, -1, -1, 0]  # only i = 0 has a label in its segment
    # labels never cross a segment boundary, padding never counts (every position an anchor)
    task = make_task(make_config(anchors_per_row=0))
    batch = synthetic_batch()
    _, _, _, labels, mask = task.teacher_forced(jax.jit(task.init_params)(jax.random.PRNGKey(0)),
                                               batch, jax.random.PRNGKey(1), task.init_frozen())
    seg = np.asarray(batch["segment_ids"])
    mask = np.asarray(mask)
    t = seg.shape[1]
    for b in range(seg.shape[0]):
        for i in range(t):
            for k in range(3):
                lab = i + 2 + k
                expect = lab < t and seg[b, lab] == seg[b, i] and seg[b, i] > 0
                assert mask[b, i, k] == expect


def _tree_equal(a, b):
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))


@pytest.fixture
def reuse_compiles(tmp_path):
    """The three runs below build the same programs: compiled once, loaded twice."""
    with in_process_compile_cache(tmp_path / "jax_cache"):
        yield


def test_frozen_teacher_switch_and_resume(tmp_path, reuse_compiles):
    config = make_config(loss="tv", warm_start_loss="ce", switch_step=2)
    mesh = one_device_mesh()

    # uninterrupted run
    task = make_task(config)
    target_before = jax.device_get(task.init_frozen())
    res = run_drafter(config, str(tmp_path / "a"), mesh=mesh, task=task)
    params_a = jax.device_get(res.state.params)

    # the teacher is frozen: unchanged, and nothing of it is trained or in the optimizer state
    assert _tree_equal(jax.device_get(res.trainer.frozen), target_before)
    v, d = C.VOCAB, CONFIG_OVERRIDES["hidden_size"]
    shapes = [np.shape(x) for x in jax.tree.leaves(params_a)]
    assert (v, d) not in shapes and (d, v) not in shapes  # no embedding / LM head copy
    flat_names = ["/".join(map(str, p)) for p, _ in
                  jax.tree_util.tree_flatten_with_path(params_a)[0]]
    assert not any("embed" in n or "lm_head" in n or "final_norm" in n for n in flat_names)
    n_params = sum(np.size(x) for x in jax.tree.leaves(params_a))
    n_opt = sum(np.size(x) for x in jax.tree.leaves(jax.device_get(res.state.opt_state)))
    assert n_opt < 2 * n_params + 100  # Adam's two moments of the drafter params, and counters
    assert (v, d) not in [np.shape(x) for x in jax.tree.leaves(res.state.opt_state)]

    # the loss switched from CE to TV after step 2
    lines = [json.loads(x) for x in open(tmp_path / "a" / "metrics.jsonl")]
    train = {r["step"]: r for r in lines if r["split"] == "train"}
    for s in (1, 2):
        assert train[s]["loss"] == pytest.approx(train[s]["ce"], rel=1e-5)
    for s in (3, 4):
        assert train[s]["loss"] == pytest.approx(train[s]["tv"], rel=1e-5)

    # task.init_from: a new run starts from this run's newest params (the warm-start path of
    # reproduce.py's fine-tuning stage); a workdir without checkpoints is refused, not created
    warm = make_task(make_config(loss="tv", init_from=str(tmp_path / "a")))
    for x, y in zip(jax.tree.leaves(warm.init_params(jax.random.key(1))),
                    jax.tree.leaves(params_a)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(FileNotFoundError, match="init_from"):
        make_task(make_config(loss="tv", init_from=str(tmp_path / "missing")))
    assert not os.path.exists(tmp_path / "missing")

    # killed after step 3 (last checkpoint: step 2), resumed: same final params
    run_drafter(config, str(tmp_path / "b"), mesh=mesh, task=make_task(config), stop_after=3)
    res_b = run_drafter(config, str(tmp_path / "b"), mesh=mesh, task=make_task(config))
    assert int(res_b.state.step) == 4
    params_b = jax.device_get(res_b.state.params)
    for x, y in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
        np.testing.assert_allclose(x, y, atol=1e-6)


def test_schedule_needs_phase_and_config_errors():
    config = make_config(loss="tv", warm_start_loss="ce", switch_step=2)
    task = make_task(config)
    batch = synthetic_batch()
    with pytest.raises(ValueError, match="loss_phase"):
        jax.eval_shape(task.loss_fn, jax.eval_shape(task.init_params, jax.random.PRNGKey(0)),
                       batch, jax.random.PRNGKey(0), task.init_frozen())
    for field, value, match in [("loss", "mse", "config.task.loss"),
                                ("drafter", "eagle", "config.task.drafter"),
                                ("warm_start_loss", "ce", "config.task.switch_step"),
                                ("dspark.target_layers", "a,b", "config.task.dspark.target_layers"),
                                ("position_weights", "linear", "config.task.position_weights")]:
        with pytest.raises(ConfigError, match=match.replace(".", r"\.")):
            make_config(**{field: value})


def test_loss_phase_iterator_state():
    from specjax.training.inputs import SyntheticLMIterator
    it = LossPhaseIterator(SyntheticLMIterator(batch_size=2, seq_len=8, vocab_size=16), 2)
    phases = [int(next(it)["loss_phase"][0, 0]) for _ in range(3)]
    assert phases == [0, 0, 1]
    state = json.loads(json.dumps(it.get_state()))
    it2 = LossPhaseIterator(SyntheticLMIterator(batch_size=2, seq_len=8, vocab_size=16), 2)
    it2.set_state(state)
    b1, b2 = next(it), next(it2)
    assert int(b2["loss_phase"][0, 0]) == 1
    np.testing.assert_array_equal(b1["inputs"], b2["inputs"])


def test_token_rows_iterator_and_eval_batches(tmp_path):
    rng = np.random.default_rng(0)
    rows = {"tokens": rng.integers(2, 16, (10, 8)).astype(np.int32),
            "lengths": np.array([8, 5, 8, 3, 8, 8, 6, 8, 8, 2], np.int32),
            "domain": np.array([0, 1] * 5, np.int32), "domains": np.array(["math", "code"])}
    path = drafter_data.save_rows(str(tmp_path / "rows.npz"), rows)
    rows = drafter_data.load_rows(path)
    it = drafter_data.TokenRowsIterator(rows, batch_size=4, seed=1)
    seen = [next(it) for _ in range(3)]  # crosses an epoch boundary (10 rows, batches of 4)
    b = seen[0]
    assert set(b) == {"inputs", "targets", "segment_ids", "positions", "loss_mask"}
    lens = b["segment_ids"].sum(1)
    np.testing.assert_array_equal(b["loss_mask"].sum(1), lens - 1)
    np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])
    state = json.loads(json.dumps(it.get_state()))
    nxt = next(it)
    it2 = drafter_data.TokenRowsIterator(rows, batch_size=4, seed=1)
    it2.set_state(state)
    np.testing.assert_array_equal(next(it2)["inputs"], nxt["inputs"])
    ev = drafter_data.eval_batches(rows, batch_size=4)
    assert set(ev) == {"math", "code"} and len(ev["math"]) == 2
    assert ev["math"][1]["segment_ids"][1:].sum() == 0  # padded rows are empty
    assert drafter_data.select_domain(rows, "code")["tokens"].shape == (5, 8)


def test_regenerate_rows_self_distillation():
    rng = np.random.default_rng(0)
    rows = {"tokens": rng.integers(2, C.VOCAB, (3, 12)).astype(np.int32),
            "lengths": np.array([12, 9, 4], np.int32), "domain": np.zeros(3, np.int32),
            "domains": np.array(["math"])}
    out = drafter_data.regenerate_rows(C.target(), rows, prompt_len=5, temperature=0.0,
                                       batch_size=4, pad_id=0)
    np.testing.assert_array_equal(out["tokens"][:2, :5], rows["tokens"][:2, :5])  # prompts kept
    np.testing.assert_array_equal(out["tokens"][2, :3], rows["tokens"][2, :3])  # short row: L - 1
    np.testing.assert_array_equal(out["lengths"], [12, 12, 12])
    # greedy: each new token is the target's argmax given the row so far
    from specjax.models.transformer import apply
    logits = apply(*C.target(), jnp.asarray(out["tokens"])).logits
    pred = np.asarray(jnp.argmax(logits, -1))
    np.testing.assert_array_equal(out["tokens"][0, 5:], pred[0, 4:-1])
