"""Decode throughput and the cost of a verify step relative to a decode step.

Speculation pays when verifying K drafts (a forward over K + 1 tokens) costs little more than
decoding one token. This measures, on the current backend, for each model preset:

* decode: a cached forward of 1 token per row (tokens/s = batch / step time);
* verify(K): a cached forward of K + 1 tokens per row, for K = 1..16, as a ratio to decode
  (decode and verify steps alternate in one loop, so the ratio is robust to machine noise).

Both run at the same context length (the cache is rolled back after every step), through the
jitted, cache-donating ``cached_forward``. Each figure is the median over ``--reps`` timed steps
after warm-up; ratios are taken within one run.

Run:
    .venv/bin/python -m benchmarks.model_step_cost                   # tiny + base50m presets
    .venv/bin/python -m benchmarks.model_step_cost --presets tiny --reps 20
    .venv/bin/python -m benchmarks.model_step_cost --quick   # smallest shapes: a smoke run
Writes ``benchmarks/results/model_step_cost.json`` (``--quick``: a file in the temp directory)
and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import cached_forward, get_preset, init_cache, init_model


def _timed(graphdef, state, cache, tokens, lengths):
    t0 = time.perf_counter()
    out = cached_forward(graphdef, state, tokens, cache)
    jax.block_until_ready(out.logits)
    return time.perf_counter() - t0, out.cache.rollback(lengths)


def bench_preset(name: str, *, batch: int, context: int, max_k: int, reps: int) -> dict:
    """Decode and verify(K) steps *interleaved* (decode, verify, decode, verify, ...) so machine
    noise hits both alike; the ratio is median(verify) / median(decode) of the same loop."""
    config = get_preset(name)
    model = init_model(config, seed=0)
    graphdef, state = nnx.split(model)
    max_len = context + max_k + 1
    cache = init_cache(config, batch, max_len)
    prompt = jax.random.randint(jax.random.key(0), (batch, context), 0, config.vocab_size)
    cache = cached_forward(graphdef, state, prompt, cache).cache
    # A host array: each rollback makes a fresh device buffer (the cache, lengths included, is
    # donated to the next step).
    lengths = np.full((batch,), context, np.int32)
    decode_tok = prompt[:, :1]
    _, cache = _timed(graphdef, state, cache, decode_tok, lengths)  # compile decode
    rows, decode_all = [], []
    for k in range(1, max_k + 1):
        verify_tok = prompt[:, :k + 1]
        _, cache = _timed(graphdef, state, cache, verify_tok, lengths)  # compile verify(K)
        dec, ver = [], []
        for _ in range(reps):
            t, cache = _timed(graphdef, state, cache, decode_tok, lengths)
            dec.append(t)
            t, cache = _timed(graphdef, state, cache, verify_tok, lengths)
            ver.append(t)
        decode_all += dec
        rows.append({"K": k, "verify_ms": statistics.median(ver) * 1e3,
                     "decode_ms_same_loop": statistics.median(dec) * 1e3,
                     "ratio_to_decode": statistics.median(ver) / statistics.median(dec)})
    decode_s = statistics.median(decode_all)
    return {"preset": name, "params": config.num_params(), "batch": batch, "context": context,
            "decode_ms": decode_s * 1e3, "decode_tokens_per_s": batch / decode_s, "verify": rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="tiny,base50m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--max-k", type=int, default=16)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny preset, context 8, K ≤ 2, 1 rep, output in the temp "
                             "directory")
    parser.add_argument("--out", default=None,
                        help="default benchmarks/results/model_step_cost.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.presets, args.batch, args.context, args.max_k, args.reps = "tiny", 1, 8, 2, 1
    if args.out is None:
        args.out = (os.path.join(tempfile.gettempdir(), "specjax_quick", "model_step_cost.json")
                    if args.quick else "benchmarks/results/model_step_cost.json")
    results = {"backend": jax.default_backend(), "devices": str(jax.devices()[0]),
               "load_average_at_start": os.getloadavg(),
               "machine": f"{platform.machine()} {os.cpu_count()} cpus",
               "reps": args.reps, "presets": []}
    for name in args.presets.split(","):
        r = bench_preset(name, batch=args.batch, context=args.context, max_k=args.max_k,
                         reps=args.reps)
        results["presets"].append(r)
        print(f"\n### {name} ({r['params'] / 1e6:.1f}M params, batch {r['batch']}, "
              f"context {r['context']}): decode {r['decode_ms']:.2f} ms/step = "
              f"{r['decode_tokens_per_s']:.0f} tokens/s")
        print("| K | verify ms | verify / decode |\n|---|---|---|")
        for row in r["verify"]:
            print(f"| {row['K']} | {row['verify_ms']:.2f} | {row['ratio_to_decode']:.2f} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.out}")
    return results


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
