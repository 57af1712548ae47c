"""Per-block remat, the chunked vocabulary loss and query-chunked attention give the plain train
step's loss and gradients, and the drafter task's target distributions are the same whether the LM
head runs on every position or only on the gathered anchor rows.

Tolerances: the variants compute the same terms in a different order (chunked sums, recomputed
blocks), so each value may differ by the reordering error of its longest f32 reduction:
``n · eps32 · scale`` with ``n`` the number of summed terms and ``scale`` the largest magnitude
involved.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import get_preset
from specjax.training import LMTask, SyntheticLMIterator
from specjax.training.config import ConfigError, default_config, validate_config

EPS = float(jnp.finfo(jnp.float32).eps)
B, T = 2, 40  # T not a multiple of the chunk: the padded tail must not count


def _batch(vocab):
    it = SyntheticLMIterator(batch_size=B, seq_len=T, vocab_size=vocab, seed=3)
    return {k: jnp.asarray(v) for k, v in it.batch_at(0).items()}


def _loss_and_grads(task, params, batch):
    fn = jax.jit(jax.value_and_grad(lambda p: task.loss_fn(p, batch, None, {}), has_aux=True))
    (loss, metrics), grads = fn(params)
    return loss, metrics, grads


@pytest.mark.parametrize("remat,chunk", [("full", 16), ("dots", 0), ("none", 7)])
def test_remat_and_chunked_loss_match_plain_step(remat, chunk):
    cfg = get_preset("tiny")
    batch = _batch(cfg.vocab_size)
    plain = LMTask(cfg, z_loss=1e-3)
    params = jax.jit(plain.init_params)(jax.random.PRNGKey(0))
    loss0, m0, g0 = _loss_and_grads(plain, params, batch)
    loss1, m1, g1 = _loss_and_grads(LMTask(cfg, z_loss=1e-3, remat=remat, logits_chunk=chunk),
                                    params, batch)
    n = B * T + cfg.vocab_size + cfg.intermediate_size  # longest reduction of any value
    for k in ("ce", "z_loss", "accuracy", "loss_weight"):
        np.testing.assert_allclose(m1[k], m0[k], rtol=0, atol=n * EPS * max(abs(float(m0[k])), 1))
    np.testing.assert_allclose(loss1, loss0, rtol=0, atol=n * EPS * max(abs(float(loss0)), 1))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        scale = float(jnp.max(jnp.abs(b))) + 1e-30
        np.testing.assert_allclose(a, b, rtol=0, atol=n * EPS * scale)


def test_remat_policy_is_validated_by_the_config():
    c = default_config("lm").to_dict()
    c["train"]["remat"] = "everything"
    with pytest.raises(ConfigError, match="train.remat"):
        validate_config(c)
    c["train"]["remat"] = "full"
    c["train"]["logits_chunk"] = -1
    with pytest.raises(ConfigError, match="train.logits_chunk"):
        validate_config(c)


def test_drafter_target_head_on_gathered_rows_matches_full_logits():
    from experiments.configs.train_drafter import get_config
    from specjax.drafters import teacher_forced_targets
    from specjax.training.drafter_task import DrafterTask

    config = validate_config(get_config("mtp_e2e_tv,tiny"))
    task = DrafterTask(config)
    assert task.task_config.anchors_per_row > 0
    batch = _batch(task.target_config.vocab_size)
    frozen = jax.device_put(task.init_frozen())
    params = jax.jit(task.init_params)(jax.random.PRNGKey(0))
    rng = jax.random.PRNGKey(5)
    _, _, p, labels, mask = jax.jit(task.teacher_forced)(params, batch, rng, frozen)
    # reference: the target's logits at every position, then gathered at the same anchors
    seg = batch["segment_ids"].astype(jnp.int32)
    anchors = task.sample_anchors(rng, seg)
    logits, _ = task.target_forward(frozen, batch)
    ref_labels, tl, _ = teacher_forced_targets(batch["inputs"], logits, task.gamma, anchors)
    ref_p = jax.nn.softmax(tl / task.task_config.target_temperature, axis=-1)
    np.testing.assert_array_equal(labels, ref_labels)
    n = task.target_config.hidden_size + task.target_config.vocab_size
    np.testing.assert_allclose(p, ref_p, rtol=0, atol=n * EPS * float(jnp.max(ref_p)))
    assert bool(mask.any())


@pytest.mark.parametrize("chunk", [16, 7])  # 7: T = 40 padded to 42 with masked rows
def test_query_chunked_attention_matches_dense_attention(chunk):
    from specjax.models.attention import (attention_weights_mask, grouped_attention,
                                          query_chunks)
    rng = np.random.default_rng(0)
    h, kvh, dh = 4, 2, 8
    q = jnp.asarray(rng.normal(size=(B, T, h, dh)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, T, kvh, dh)), jnp.float32) for _ in range(2))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    seg = jnp.asarray(np.repeat([[1] * 25 + [2] * (T - 25)], B, 0))  # two packed documents
    mask = attention_weights_mask(pos, pos, seg, seg)

    def run(c):
        def loss(q, k, v):
            with query_chunks(c):
                out = grouped_attention(q, k, v, mask)
            return jnp.sum(out * jnp.sin(out)), out
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (loss0, out0), grads0 = run(0)
    (loss1, out1), grads1 = run(chunk)
    assert out1.shape == out0.shape
    n = T * h  # longest reduction: a key's gradient sums over every query of every head
    for a, b in zip((out1, loss1, *grads1), (out0, loss0, *grads0)):
        scale = float(jnp.max(jnp.abs(b))) + 1e-30
        np.testing.assert_allclose(a, b, rtol=0, atol=n * EPS * scale)
    with pytest.raises(ValueError, match="chunk"):
        with query_chunks(-1):
            pass


def test_lm_loss_under_query_chunks_matches_and_the_config_checks_it():
    from specjax.models.attention import query_chunks
    cfg = get_preset("tiny")
    batch = _batch(cfg.vocab_size)
    task = LMTask(cfg)
    params = jax.jit(task.init_params)(jax.random.PRNGKey(0))
    loss0, _, g0 = _loss_and_grads(task, params, batch)
    with query_chunks(8):  # what the trainer wraps its loss in (config.train.attention_chunk)
        loss1, _, g1 = _loss_and_grads(task, params, batch)
    n = B * T + cfg.vocab_size + cfg.intermediate_size
    np.testing.assert_allclose(loss1, loss0, rtol=0, atol=n * EPS * max(abs(float(loss0)), 1))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=0, atol=n * EPS * (float(jnp.max(jnp.abs(b))) + 1e-30))
    c = default_config("lm").to_dict()
    c["train"]["attention_chunk"] = -8
    with pytest.raises(ConfigError, match="train.attention_chunk"):
        validate_config(c)


def test_tpu_compiler_options_are_checked_and_kept_off_other_backends():
    """``config.train.tpu_compiler_options`` must parse as ``name=value`` items, and a trainer on
    CPU devices leaves them out of its jits: the CPU compiler refuses a TPU option by name
    (``tests/test_aot_tpu.py`` checks that a TPU compile does get them)."""
    from specjax.training import Trainer
    c = default_config("lm").to_dict()
    c["train"]["tpu_compiler_options"] = "xla_tpu_enable_windowed_einsum_for_all_gather"
    with pytest.raises(ConfigError, match="train.tpu_compiler_options.*NAME=VALUE"):
        validate_config(c)
    c = default_config("lm")
    c.model.preset = "tiny"
    c.data.seq_len, c.data.batch_size = 16, jax.device_count()
    c.checkpoint.every = -1
    c.output.progress_bar = False
    c.train.tpu_compiler_options = "xla_tpu_enable_windowed_einsum_for_all_gather=false"
    trainer = Trainer(c)
    assert trainer.compiler_options is None
    it = SyntheticLMIterator(batch_size=jax.device_count(), seq_len=16,
                             vocab_size=trainer.task.model_config.vocab_size)
    _, metrics = trainer.step(trainer.init_state(), next(it))
    assert np.isfinite(float(metrics["loss"]))
