"""Forward modes of the target model agree: prefill-all == token-by-token decode == chunked verify.

Rows of different lengths share one batch (``num_valid``), and each row's result is independent of
what the other rows contain.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from specjax.models import ModelConfig, apply_flat_jit, apply_jit, init_cache, init_model

TOL = 1e-4

CONFIGS = {
    "qwen3_gqa2": ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True),
    "llama_mha_untied": ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64,
                                    num_layers=3, num_heads=4, num_kv_heads=4, head_dim=12,
                                    qk_norm=False, tie_embeddings=False, architecture="llama"),
}

LENGTHS = np.array([13, 5, 9])  # prompt length per row
MAX_LEN = 24


class Jitted:
    """Calls a model through the jitted functional API (eager nnx dispatch is slow on CPU)."""

    def __init__(self, model):
        self.model = model
        self.graphdef, self.state = nnx.split(model)

    def __call__(self, tokens, **kw):
        if "hidden_layers" in kw:
            kw["hidden_layers"] = tuple(kw["hidden_layers"])
        return apply_jit(self.graphdef, self.state, tokens, **kw)

    def forward_flat(self, tokens, segment_ids, cache, **kw):
        return apply_flat_jit(self.graphdef, self.state, tokens, segment_ids, cache, **kw)

    def __getattr__(self, name):
        return getattr(self.model, name)


def _model_and_tokens(name):
    config = CONFIGS[name]
    model = Jitted(init_model(config, seed=3))
    tokens = jax.random.randint(jax.random.key(7), (len(LENGTHS), LENGTHS.max()), 0,
                                config.vocab_size)
    return config, model, tokens


def _reference_logits(model, tokens, row):
    """Row alone, no cache, its own length: the ground truth."""
    n = LENGTHS[row]
    return np.asarray(model(tokens[row:row + 1, :n]).logits[0])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_all_matches_uncached(name):
    config, model, tokens = _model_and_tokens(name)
    cache = init_cache(config, len(LENGTHS), MAX_LEN)
    out = model(tokens, cache=cache, num_valid=jnp.asarray(LENGTHS))
    np.testing.assert_array_equal(np.asarray(out.cache.lengths), LENGTHS)
    for row in range(len(LENGTHS)):
        ref = _reference_logits(model, tokens, row)
        got = np.asarray(out.logits[row, :LENGTHS[row]])
        assert np.abs(got - ref).max() <= TOL


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_at_one_index_per_row_equal_the_full_logits_there(name):
    """``logits_at`` runs the LM head at one position per row (the engine's prompt chunks): the
    same numbers as the full ``[B, T, V]`` logits at those positions, cached and uncached, and
    the cache written the same."""
    config, model, tokens = _model_and_tokens(name)
    at = jnp.asarray(LENGTHS - 1)
    full = model(tokens, cache=init_cache(config, len(LENGTHS), MAX_LEN),
                 num_valid=jnp.asarray(LENGTHS))
    one = model(tokens, cache=init_cache(config, len(LENGTHS), MAX_LEN),
                num_valid=jnp.asarray(LENGTHS), logits_at=at)
    assert one.logits.shape == (len(LENGTHS), 1, config.vocab_size)
    want = np.asarray(full.logits)[np.arange(len(LENGTHS)), LENGTHS - 1]
    np.testing.assert_allclose(np.asarray(one.logits[:, 0]), want, rtol=0, atol=TOL)
    np.testing.assert_array_equal(np.asarray(one.cache.k), np.asarray(full.cache.k))
    np.testing.assert_array_equal(np.asarray(one.cache.lengths), LENGTHS)
    uncached = model(tokens, logits_at=jnp.asarray([0, 4, 2]))
    ref = np.asarray(model(tokens).logits)[np.arange(3), [0, 4, 2]]
    np.testing.assert_allclose(np.asarray(uncached.logits[:, 0]), ref, rtol=0, atol=TOL)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_token_by_token_decode_matches(name):
    config, model, tokens = _model_and_tokens(name)
    cache = init_cache(config, len(LENGTHS), MAX_LEN)
    step = lambda toks, cache, nv: model(toks, cache=cache, num_valid=nv)  # noqa: E731
    logits = []
    for t in range(LENGTHS.max()):
        nv = jnp.asarray((t < LENGTHS).astype(np.int32))  # finished rows feed padding
        out = step(tokens[:, t:t + 1], cache, nv)
        cache = out.cache
        logits.append(np.asarray(out.logits[:, 0]))
    logits = np.stack(logits, axis=1)
    np.testing.assert_array_equal(np.asarray(cache.lengths), LENGTHS)
    for row in range(len(LENGTHS)):
        ref = _reference_logits(model, tokens, row)
        assert np.abs(logits[row, :LENGTHS[row]] - ref).max() <= TOL


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_chunked_verify_with_rollback_matches(name):
    """Verify-style chunks of K+1 tokens at per-row offsets, with random "rejections".

    Each step feeds K+1 tokens per row; a random number of them is then committed (the rest rolled
    back by lengths alone) and the next chunk restarts right after the committed ones, so stale
    cache entries past the length are overwritten. The logits of committed positions must equal the
    uncached reference.
    """
    config, model, tokens = _model_and_tokens(name)
    k_plus_1 = 4
    rng = np.random.default_rng(0)
    cache = init_cache(config, len(LENGTHS), MAX_LEN)
    step = lambda toks, cache: model(toks, cache=cache)  # noqa: E731
    got = np.zeros((len(LENGTHS), LENGTHS.max(), config.vocab_size), np.float32)
    done = np.zeros(len(LENGTHS), np.int64)
    padded = np.pad(np.asarray(tokens), ((0, 0), (0, k_plus_1)))
    while (done < LENGTHS).any():
        chunk = np.stack([padded[r, done[r]:done[r] + k_plus_1] for r in range(len(LENGTHS))])
        out = step(jnp.asarray(chunk), cache)
        logits = np.asarray(out.logits)
        commit = rng.integers(1, k_plus_1 + 1, size=len(LENGTHS))
        commit = np.minimum(commit, LENGTHS - done)
        for r in range(len(LENGTHS)):
            got[r, done[r]:done[r] + commit[r]] = logits[r, :commit[r]]
        done = done + commit
        cache = out.cache.rollback(jnp.asarray(done, jnp.int32))
    for row in range(len(LENGTHS)):
        ref = _reference_logits(model, tokens, row)
        assert np.abs(got[row, :LENGTHS[row]] - ref).max() <= TOL


def test_rows_are_independent():
    """Changing one row's tokens (and its length) leaves the other rows' logits bit-identical."""
    config, model, tokens = _model_and_tokens("qwen3_gqa2")
    cache = init_cache(config, len(LENGTHS), MAX_LEN)
    base = model(tokens, cache=cache, num_valid=jnp.asarray(LENGTHS))
    other = tokens.at[1].set((tokens[1] * 7 + 3) % config.vocab_size)
    lengths2 = LENGTHS.copy()
    lengths2[1] = 12
    changed = model(other, cache=cache, num_valid=jnp.asarray(lengths2))
    for row in (0, 2):
        np.testing.assert_array_equal(np.asarray(base.logits[row, :LENGTHS[row]]),
                                      np.asarray(changed.logits[row, :LENGTHS[row]]))
        np.testing.assert_array_equal(np.asarray(base.cache.k[:, row, :LENGTHS[row]]),
                                      np.asarray(changed.cache.k[:, row, :LENGTHS[row]]))
    assert not np.allclose(np.asarray(base.logits[1]), np.asarray(changed.logits[1]))


def test_packed_segments_match_separate_documents():
    """Training mode with segment_ids: two packed documents == each document alone."""
    config, model, _ = _model_and_tokens("qwen3_gqa2")
    doc_a = jax.random.randint(jax.random.key(1), (1, 6), 0, config.vocab_size)
    doc_b = jax.random.randint(jax.random.key(2), (1, 5), 0, config.vocab_size)
    packed = jnp.concatenate([doc_a, doc_b], axis=1)
    seg = jnp.asarray([[0] * 6 + [1] * 5])
    pos = jnp.asarray([list(range(6)) + list(range(5))])
    out = model(packed, positions=pos, segment_ids=seg).logits
    np.testing.assert_allclose(out[:, :6], model(doc_a).logits, atol=TOL)
    np.testing.assert_allclose(out[:, 6:], model(doc_b).logits, atol=TOL)


def test_hidden_layers_returned_in_requested_order():
    config, model, tokens = _model_and_tokens("llama_mha_untied")
    out = model(tokens[:, :4], hidden_layers=(3, 0, 1))
    assert out.hidden.shape == (3, len(LENGTHS), 4, config.hidden_size)
    np.testing.assert_array_equal(np.asarray(out.hidden[1]),
                                  np.asarray(model.embed_tokens(tokens[:, :4])))
    # The last block's output through the final norm + head gives the logits.
    np.testing.assert_allclose(np.asarray(model.lm_logits(out.hidden[0])),
                               np.asarray(out.logits), atol=1e-5)


def test_bf16_compute_returns_f32_logits_close_to_f32():
    config = CONFIGS["qwen3_gqa2"]
    m32 = Jitted(init_model(config, seed=3))
    m16 = Jitted(init_model(config.replace(dtype="bfloat16"), seed=3))
    toks = jnp.arange(8)[None] % config.vocab_size
    l32, l16 = m32(toks).logits, m16(toks).logits
    assert l16.dtype == jnp.float32
    assert np.abs(np.asarray(l16) - np.asarray(l32)).max() < 0.05


def test_bad_inputs_raise_clear_errors():
    config, model, tokens = _model_and_tokens("qwen3_gqa2")
    with pytest.raises(ValueError, match="cache slots"):
        model(tokens, cache=init_cache(config, 2, MAX_LEN))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model(tokens[0])
    with pytest.raises(ValueError, match="hidden layer"):
        model(tokens, hidden_layers=(5,))
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(dtype="float8")


def test_flat_ragged_forward_matches_padded_verify():
    """Packed 1-D verification batch (segments out of slot order, padding) == padded [B, T] forward.

    Slot 1 gets 0 tokens, the others 3 and 2; the bucket is padded to 8 tokens.
    """
    config, model, tokens = _model_and_tokens("qwen3_gqa2")
    prefix = np.array([6, 4, 7])
    cache = init_cache(config, 3, MAX_LEN)
    cache = model(tokens[:, :7], cache=cache, num_valid=jnp.asarray(prefix)).cache
    new = {2: [5, 9, 11], 0: [1, 2]}  # slot -> verification tokens, packed in this order
    flat_tokens = [t for slot in new for t in new[slot]] + [0] * 3
    flat_seg = [slot for slot in new for _ in new[slot]] + [3] * 3
    out = model.forward_flat(jnp.asarray(flat_tokens), jnp.asarray(flat_seg), cache, grid_len=4)
    np.testing.assert_array_equal(np.asarray(out.cache.lengths), prefix)  # not advanced

    padded = np.zeros((3, 3), np.int32)
    nv = np.zeros(3, np.int32)
    for slot, toks in new.items():
        padded[slot, :len(toks)] = toks
        nv[slot] = len(toks)
    ref = model(jnp.asarray(padded), cache=cache, num_valid=jnp.asarray(nv))
    n = 0
    for slot, toks in new.items():
        for j in range(len(toks)):
            np.testing.assert_allclose(np.asarray(out.logits[n]), np.asarray(ref.logits[slot, j]),
                                       atol=TOL)
            n += 1
        # Keys written at (slot, position) match the padded path's.
        sl = slice(prefix[slot], prefix[slot] + len(toks))
        np.testing.assert_allclose(np.asarray(out.cache.k[:, slot, sl]),
                                   np.asarray(ref.cache.k[:, slot, sl]), atol=1e-5)
    assert np.all(np.asarray(out.logits[n:]) == np.asarray(out.logits[n:]))  # padding finite


def test_flat_forward_kv_reads_the_cache_and_writes_after():
    """``forward_flat_kv`` leaves the cache untouched and returns the new keys/values; writing them
    (padded to a larger bucket: the padding is dropped) gives forward_flat's cache."""
    from specjax.models.attention import block_cached_attention, kv_windows, windowed_attention
    config, model, tokens = _model_and_tokens("qwen3_gqa2")
    prefix = np.array([6, 4, 7])
    cache = init_cache(config, 3, MAX_LEN)
    cache = model(tokens[:, :7], cache=cache, num_valid=jnp.asarray(prefix)).cache
    flat_tokens = jnp.asarray([5, 9, 11, 1, 2, 0], jnp.int32)
    flat_seg = jnp.asarray([2, 2, 2, 0, 0, 3], jnp.int32)
    before = np.asarray(cache.k).copy()
    out, kv = model.forward_flat_kv(flat_tokens, flat_seg, cache, grid_len=4)
    np.testing.assert_array_equal(np.asarray(cache.k), before)
    assert out.cache is None and kv.k.shape == (config.num_layers, 6, config.num_kv_heads,
                                                config.head_dim)
    ref = model.forward_flat(flat_tokens, flat_seg, cache, grid_len=4)
    # (two eager runs of the same ops: equal up to the file's tolerance, not bit for bit)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=TOL)
    written = kv.pad(9, MAX_LEN).write(cache)
    np.testing.assert_allclose(np.asarray(written.k), np.asarray(ref.cache.k), atol=TOL)
    np.testing.assert_allclose(np.asarray(written.v), np.asarray(ref.cache.v), atol=TOL)
    # Slot 1 got no tokens: its rows are unchanged.
    np.testing.assert_array_equal(np.asarray(written.k[:, 1]), before[:, 1])

    # The block attention itself == writing the block first, then windowed causal attention.
    rng = np.random.default_rng(0)
    s, g, h, kvh, dh = 3, 4, 4, 2, 8
    lengths = jnp.asarray([5, 0, 9], jnp.int32)
    k_all = jnp.asarray(rng.normal(size=(1, s, 32, kvh, dh)), jnp.float32)
    v_all = jnp.asarray(rng.normal(size=(1, s, 32, kvh, dh)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(s, g, h, dh)), jnp.float32)
    k_new = jnp.asarray(rng.normal(size=(s, g, kvh, dh)), jnp.float32)
    v_new = jnp.asarray(rng.normal(size=(s, g, kvh, dh)), jnp.float32)
    n_new = np.array([3, 4, 1])
    valid = jnp.asarray(np.arange(g)[None, :] < n_new[:, None])
    q_pos = lengths[:, None] + jnp.arange(g)[None, :]
    got = block_cached_attention(q, q_pos, k_new, v_new, valid, k_all, v_all, 0, kv_windows(32),
                                 lengths)
    rows = jnp.broadcast_to(jnp.arange(s)[:, None], (s, g))
    wpos = jnp.where(valid, q_pos, 32)
    k_w = k_all.at[0, rows, wpos].set(k_new, mode="drop")
    v_w = v_all.at[0, rows, wpos].set(v_new, mode="drop")
    want = windowed_attention(q, q_pos, k_w, v_w, 0, kv_windows(32), jnp.int32(32))
    # Same keys, another summation order: a weighted mean of n = 32 + g values in f32 differs by
    # at most ~ 2 n eps max|v| (softmax normalisation and the weighted sum, each n eps).
    atol = 2 * (32 + g) * np.finfo(np.float32).eps * float(jnp.max(jnp.abs(v_w)))
    for i in range(s):  # only the real queries are defined
        np.testing.assert_allclose(np.asarray(got[i, :n_new[i]]), np.asarray(want[i, :n_new[i]]),
                                   atol=atol, rtol=0)
