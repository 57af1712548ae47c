"""Cached generation (specjax.models.generate) vs a no-cache reference loop; no torch needed."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import get_preset, init_model
from specjax.models.generate import generate, generate_timed

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [7]]
# One cache length for the batch-of-3 calls, so they share the compiled prefill / decode step.
MAX_LEN = 32


@pytest.fixture(scope="module")
def model():
    """Tiny preset with weights scaled to std 0.5: logits spread over several nats, so argmax ties
    (which f32 rounding could break differently in the cached and uncached paths) do not occur."""
    m = init_model(get_preset("tiny"), seed=1)
    nnx.update(m, jax.tree.map(lambda x: x * 25 if x.ndim >= 2 else x, nnx.state(m)))
    return m


def reference_greedy(model, prompts, n):
    """Greedy decoding by full no-cache forwards and argmax, one token per forward.

    Each forward runs the whole sequence so far, right-padded to a fixed length (causal attention
    makes the padding invisible to earlier positions), so one compiled function serves all steps.
    """
    seqs = [list(p) for p in prompts]
    width = max(len(p) for p in prompts) + n
    forward = jax.jit(lambda tokens: model(tokens).logits)
    for _ in range(n):
        tokens = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            tokens[i, :len(s)] = s
        logits = np.asarray(forward(jnp.asarray(tokens)))
        for i, s in enumerate(seqs):
            row = logits[i, len(s) - 1]
            top2 = np.sort(row)[-2:]
            assert top2[1] - top2[0] > 1e-3, "near-tie in the reference; the test would be fragile"
            s.append(int(np.argmax(row)))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


@pytest.fixture(scope="module")
def reference(model):
    return reference_greedy(model, PROMPTS, 12)


def test_greedy_matches_uncached_loop(model, reference):
    assert generate(model, PROMPTS, 12, max_len=MAX_LEN) == reference


def test_prefill_padding_beyond_max_len(model):
    # 9-token prompt pads to 16 > max_len = 12: pad writes past the cache end must be dropped.
    prompt = list(range(20, 29))
    assert generate(model, [prompt], 3) == reference_greedy(model, [prompt], 3)


def test_eos_stops_each_row(model, reference):
    # EOS := the first token of row 0 not seen earlier in that row, from its third token on.
    first = next(i for i, t in enumerate(reference[0]) if i >= 2 and t not in reference[0][:i])
    eos = reference[0][first]
    expected = [r[:r.index(eos) + 1] if eos in r else r for r in reference]
    assert generate(model, PROMPTS, 12, eos_id=eos, max_len=MAX_LEN) == expected
    assert len(expected[0]) == first + 1 < 12


def test_early_exit_when_all_rows_end(model, reference):
    # Every row emits its first token as EOS: the loop stops early and each row holds just EOS.
    row = [reference[0][0]]
    res = generate_timed(model, [PROMPTS[0]] * 3, 24, eos_id=row[0], max_len=MAX_LEN)
    assert res.tokens == [row] * 3
    assert res.decode_steps < 22  # stopped at the first periodic check, not after 24 tokens


@pytest.mark.parametrize("loop", ["device", "host"])
def test_lengths_and_timings(model, loop):
    assert generate(model, PROMPTS, 0, max_len=MAX_LEN, loop=loop) == [[], [], []]
    assert [len(r) for r in generate(model, PROMPTS, 1, max_len=MAX_LEN, loop=loop)] == [1, 1, 1]
    res = generate_timed(model, PROMPTS, 6, max_len=MAX_LEN, loop=loop)
    assert [len(r) for r in res.tokens] == [6, 6, 6]
    assert res.batch_size == 3
    if loop == "host":  # the first decode step is timed apart (it carries the compilation)
        assert res.decode_steps == 4
        assert min(res.prefill_s, res.first_step_s, res.decode_s) > 0
    else:  # one loop call times all 5 decode steps
        assert res.decode_steps == 5 and res.first_step_s == 0.0
        assert min(res.prefill_s, res.decode_s) > 0
    assert res.decode_tokens_per_s > 0 and res.num_generated == 18


def test_sampling_deterministic_and_in_range(model):
    kw = dict(temperature=1.0, max_len=MAX_LEN)
    a = generate(model, PROMPTS, 8, seed=3, **kw)
    assert a == generate(model, PROMPTS, 8, seed=3, **kw)
    assert a != generate(model, PROMPTS, 8, seed=4, **kw)
    assert all(0 <= t < model.config.vocab_size for r in a for t in r)
    # Identical prompts in one batch are independent samples.
    rows = generate(model, [PROMPTS[1]] * 3, 8, seed=0, **kw)
    assert len({tuple(r) for r in rows}) > 1


def test_first_token_distribution(model):
    """Empirical first-token frequencies of 2048 rows follow softmax(logits / T)."""
    temperature, n = 2.0, 2048
    probs = np.asarray(jax.nn.softmax(model(jnp.asarray([PROMPTS[0]])).logits[0, -1] / temperature))
    rows = generate(model, [PROMPTS[0]] * n, 1, temperature=temperature, seed=0)
    counts = np.bincount([r[0] for r in rows], minlength=probs.size)
    top = np.argsort(probs)[-5:]
    sigma = np.sqrt(probs[top] * (1 - probs[top]) / n)
    np.testing.assert_array_less(np.abs(counts[top] / n - probs[top]), 5 * sigma)


def test_errors(model):
    with pytest.raises(ValueError, match="non-empty"):
        generate(model, [[1], []], 2)
    with pytest.raises(ValueError, match="max_len"):
        generate(model, PROMPTS, 4, max_len=8)
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        generate(model, [[1, 256]], 2)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, PROMPTS, 2, temperature=-1.0)
