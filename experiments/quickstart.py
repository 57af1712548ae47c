"""`make quickstart`: the main job on the embedded default.

Builds the default target (preset "small"), prefills a batch of prompts of different lengths into
the KV cache, decodes greedily with the jitted, cache-donating step and prints tokens/s.

Run:
    make quickstart                      # or: .venv/bin/python -m experiments.quickstart
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import cached_forward, get_preset, init_cache, init_model


def decode_demo(preset: str = "small", *, batch: int = 4, new_tokens: int = 64, seed: int = 0):
    """Prefill + greedy decode with the KV cache; returns (tokens [B, new], tokens/s)."""
    config = get_preset(preset)
    model = init_model(config, seed=seed)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 33, size=batch)
    prompts = np.zeros((batch, lengths.max()), np.int32)
    for b, n in enumerate(lengths):
        prompts[b, :n] = rng.integers(0, config.vocab_size, size=n)
    cache = init_cache(config, batch, int(lengths.max()) + new_tokens + 1)
    out = cached_forward(graphdef, state, jnp.asarray(prompts), cache,
                         num_valid=jnp.asarray(lengths, jnp.int32))
    # Next token of each row is read at its own last prompt position.
    logits = out.logits[jnp.arange(batch), jnp.asarray(lengths) - 1]
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]
    cache = out.cache
    # Compile the decode step before timing.
    warm = cached_forward(graphdef, state, token, init_cache(config, batch, cache.max_len))
    jax.block_until_ready(warm.logits)
    generated = [token]
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        out = cached_forward(graphdef, state, token, cache)
        cache = out.cache
        token = jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
        generated.append(token)
    tokens = np.asarray(jnp.concatenate(generated, axis=1))
    dt = time.perf_counter() - t0
    return tokens, batch * (new_tokens - 1) / dt, config


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    print(f"JAX {jax.__version__} on {jax.default_backend()} ({len(jax.devices())} devices)")
    tokens, tps, config = decode_demo(args.preset, batch=args.batch, new_tokens=args.new_tokens)
    print(f"target preset {args.preset!r}: {config.num_params() / 1e6:.2f}M parameters, "
          f"{config.num_layers} layers, d={config.hidden_size}, vocab {config.vocab_size}")
    print(f"greedy decode with KV cache: batch {args.batch}, {args.new_tokens} new tokens/row, "
          f"{tps:.0f} tokens/s")
    print("first row:", tokens[0, :16].tolist(), "...")


if __name__ == "__main__":
    main()
