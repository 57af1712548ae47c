"""Plain autoregressive generation with the KV cache (greedy or temperature sampling).

The reference decoder that speculative decoding must reproduce (greedy: token for token) and the
plain-decoding baseline of every speed comparison. A batch of prompts of different lengths is one
ragged prefill (``num_valid`` per row) followed by the decode loop::

    prompts [B, ragged]  --prefill (one cached forward, [B, T_pad])-->  first token per row
    loop: step(last tokens [B, 1]) --> next token per row, cache written in place

``loop="device"`` (default) runs the whole decode loop as one jitted ``lax.while_loop`` (tokens
go to an on-device output buffer, the loop exits when every row is done): no host round trip per
token. ``loop="host"`` dispatches one jitted step per token from Python (the classic decoder; kept
as the reference the device loop is measured against).

Finished rows (EOS seen or ``max_new_tokens`` reached) keep stepping with the rest of the batch
(static shapes) but their outputs are discarded. Rows live in their own cache slot, so padding in
one row never affects another.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.graphdef import hash_once
from specjax.models.kv_cache import KVCache, init_cache
from specjax.models.transformer import Transformer, apply

__all__ = ["GenerateResult", "generate", "generate_timed"]

# Host checks for "every row finished" cost a device sync; doing it every few steps keeps the
# dispatch of consecutive steps asynchronous.
_DONE_CHECK_EVERY = 8


@dataclasses.dataclass
class GenerateResult:
    """Output of :func:`generate_timed`.

    Attributes:
      tokens: new tokens per prompt (EOS included when it stopped the row); prompts not included.
      prefill_s: wall time of the prefill call (includes compilation on a new shape).
      first_step_s: host loop: wall time of the first decode step (includes its compilation when
        new); device loop: 0 (the loop is one call, timed in ``decode_s``).
      decode_s: host loop: wall time of the remaining decode steps (steady state); device loop:
        the whole decode loop (includes its compilation on a new shape: warm up first to time it).
      decode_steps: decode steps timed in ``decode_s`` (each advances every row by 1).
      batch_size: rows.
    """

    tokens: list[list[int]]
    prefill_s: float
    first_step_s: float
    decode_s: float
    decode_steps: int
    batch_size: int

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        """Steady-state decode throughput: batch tokens per second of ``decode_s`` (0 if none)."""
        return self.batch_size * self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.first_step_s + self.decode_s


def _pick(logits: jax.Array, key: jax.Array, temperature: jax.Array, greedy: bool) -> jax.Array:
    """Next token ``int32 [B]`` from f32 ``logits [B, V]``."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy"), donate_argnames=("cache",))
def _prefill(graphdef: nnx.GraphDef, state: nnx.State, cache: KVCache, tokens: jax.Array,
             num_valid: jax.Array, key: jax.Array, temperature: jax.Array, greedy: bool):
    """Ragged prefill: ``tokens int32 [B, T]`` (row b real up to ``num_valid[b]``).

    Returns ``(cache, first_token int32 [B], key)``; the first token is sampled from the logits at
    each row's last real prompt position.
    """
    out = apply(graphdef, state, tokens, cache=cache, num_valid=num_valid,
                logits_at=num_valid - 1)
    last = out.logits[:, 0]
    key, sub = jax.random.split(key)
    return out.cache, _pick(last, sub, temperature, greedy), key


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy"), donate_argnames=("cache",))
def _decode_step(graphdef: nnx.GraphDef, state: nnx.State, cache: KVCache, last: jax.Array,
                 done: jax.Array, key: jax.Array, temperature: jax.Array, eos_id: jax.Array,
                 greedy: bool):
    """One token for every row: ``last int32 [B]`` -> ``(cache, next [B], done [B], key)``.

    ``done`` marks rows that had already emitted EOS before this step (their output is ignored);
    ``eos_id < 0`` disables EOS.
    """
    out = apply(graphdef, state, last[:, None], cache=cache)
    key, sub = jax.random.split(key)
    nxt = _pick(out.logits[:, -1], sub, temperature, greedy)
    return out.cache, nxt, done | (last == eos_id), key


class _LoopState(NamedTuple):
    """Carry of the device decode loop (B rows, N = max_new_tokens).

    cache: the rows' KV cache (written in place). last: int32 ``[B]`` last emitted token.
    done: bool ``[B]`` row emitted EOS (its later tokens are discarded). out: int32 ``[B, N]``
    emitted tokens (column i = token i). step: int32 scalar, tokens emitted per row so far.
    key: PRNG key.
    """

    cache: KVCache
    last: jax.Array
    done: jax.Array
    out: jax.Array
    step: jax.Array
    key: jax.Array


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy", "stop_on_eos"),
                   donate_argnames=("cache",))
def _decode_loop(graphdef: nnx.GraphDef, state: nnx.State, cache: KVCache, first: jax.Array,
                 out: jax.Array, key: jax.Array, temperature: jax.Array, eos_id: jax.Array,
                 greedy: bool, stop_on_eos: bool):
    """Decodes until ``out [B, N]`` is full or (``stop_on_eos``) every row emitted ``eos_id``.

    ``first int32 [B]`` is token 0 (from the prefill); returns ``(out, steps)`` with ``steps``
    the decode steps run and the final cache (returned so that the donated cache is reused as
    the loop's carry). One compiled program: the host waits once, not once per token.
    """
    n = out.shape[1]
    out = out.at[:, 0].set(first)

    def cond(s: _LoopState):
        going = s.step < n
        if stop_on_eos:
            going &= ~jnp.all(s.done | (s.last == eos_id))
        return going

    def body(s: _LoopState):
        res = apply(graphdef, state, s.last[:, None], cache=s.cache)
        key, sub = jax.random.split(s.key)
        nxt = _pick(res.logits[:, -1], sub, temperature, greedy)
        o = jax.lax.dynamic_update_slice_in_dim(s.out, nxt[:, None], s.step, axis=1)
        return _LoopState(res.cache, nxt, s.done | (s.last == eos_id), o, s.step + 1, key)

    init = _LoopState(cache, first, jnp.zeros(first.shape, bool), out, jnp.int32(1), key)
    final = jax.lax.while_loop(cond, body, init)
    return final.out, final.step - 1, final.cache


def generate_timed(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   temperature: float = 0.0, eos_id: Optional[int] = None, seed: int = 0,
                   max_len: Optional[int] = None, loop: str = "device") -> GenerateResult:
    """Generates up to ``max_new_tokens`` per prompt; returns tokens and timings.

    Args:
      model: the target :class:`Transformer`.
      prompts: B non-empty lists of token ids (different lengths allowed).
      max_new_tokens: new tokens per row (rows stop earlier at ``eos_id``).
      temperature: 0 is greedy (argmax); > 0 samples from ``softmax(logits / temperature)``.
      eos_id: stop a row after it emits this id (included in its output); None never stops.
      seed: PRNG seed for sampling.
      max_len: cache positions per row; default ``max prompt length + max_new_tokens``.
      loop: "device" (one jitted while-loop, default) or "host" (one dispatch per token).
    """
    if loop not in ("device", "host"):
        raise ValueError(f"loop must be 'device' or 'host', got {loop!r}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    b = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    need = int(lengths.max()) + max_new_tokens
    max_len = need if max_len is None else max_len
    if max_len < need:
        raise ValueError(f"max_len {max_len} < longest prompt + max_new_tokens = {need}")
    if max_new_tokens == 0:
        return GenerateResult([[] for _ in prompts], 0.0, 0.0, 0.0, 0, b)
    vocab = model.config.vocab_size
    if any(not 0 <= t < vocab for p in prompts for t in p):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")

    # Pad the prefill to a power of two (>= 8) so that nearby prompt lengths share one compile.
    # Pad positions past max_len are dropped by the cache; pad entries below it sit beyond
    # lengths and are overwritten by decode before anything reads them.
    t_pad = max(8, 1 << int(lengths.max() - 1).bit_length())
    tokens = np.zeros((b, t_pad), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p

    graphdef, state = nnx.split(model)
    graphdef = hash_once(graphdef)  # a static argument of every step
    greedy = temperature == 0.0
    temp = jnp.float32(temperature if not greedy else 1.0)
    eos = jnp.int32(-1 if eos_id is None else eos_id)
    key = jax.random.key(seed)
    cache = init_cache(model.config, b, max_len)

    t0 = time.perf_counter()
    cache, last, key = _prefill(graphdef, state, cache, jnp.asarray(tokens), jnp.asarray(lengths),
                                key, temp, greedy)
    last.block_until_ready()
    t1 = time.perf_counter()
    if loop == "device":
        buf = jnp.full((b, max_new_tokens), -1, jnp.int32)
        out, n_steps, _ = _decode_loop(graphdef, state, cache, last, buf, key, temp, eos,
                                    greedy, eos_id is not None)
        out = np.asarray(out)
        t3 = time.perf_counter()
        n_steps = int(n_steps)
        return GenerateResult(_trim(out[:, :n_steps + 1], eos_id), t1 - t0, 0.0, t3 - t1,
                              n_steps, b)
    steps = [last]
    done = jnp.zeros((b,), bool)
    t2 = t1
    for i in range(1, max_new_tokens):
        cache, last, done, key = _decode_step(graphdef, state, cache, last, done, key, temp, eos,
                                              greedy)
        steps.append(last)
        if i == 1:  # Time the first step apart: it carries the decode step's compilation.
            last.block_until_ready()
            t2 = time.perf_counter()
        if eos_id is not None and i % _DONE_CHECK_EVERY == 0 and bool((done | (last == eos)).all()):
            break
    jax.block_until_ready(steps[-1])
    t3 = time.perf_counter()
    decode_steps = max(len(steps) - 2, 0)
    out = np.stack([np.asarray(s) for s in steps], axis=1)  # [B, steps]
    return GenerateResult(_trim(out, eos_id), t1 - t0, t2 - t1, t3 - t2 if decode_steps else 0.0,
                          decode_steps, b)


def _trim(out: np.ndarray, eos_id: Optional[int]) -> list[list[int]]:
    """Rows of ``out [B, steps]`` as lists, each cut after its first ``eos_id``."""
    result = []
    for row in out.tolist():
        if eos_id is not None and eos_id in row:
            row = row[:row.index(eos_id) + 1]
        result.append(row)
    return result


def generate(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             temperature: float = 0.0, eos_id: Optional[int] = None, seed: int = 0,
             max_len: Optional[int] = None, loop: str = "device") -> list[list[int]]:
    """:func:`generate_timed` without the timings: the new tokens of each prompt."""
    return generate_timed(model, prompts, max_new_tokens, temperature=temperature, eos_id=eos_id,
                          seed=seed, max_len=max_len, loop=loop).tokens
