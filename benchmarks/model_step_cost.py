"""Decode throughput and the cost of a verify step relative to a decode step.

Speculation pays when verifying K drafts (a forward over K + 1 tokens) costs little more than
decoding one token. This measures, on the current backend, for each model preset:

* decode: a cached forward of 1 token per row (tokens/s = batch / step time);
* verify(K): a cached forward of K + 1 tokens per row, for K = 1..16, as a ratio to decode
  (decode and verify steps alternate in one loop, so the ratio is robust to machine noise).

Both run at the same context length (the cache is rolled back after every step). Two loops:

* ``host``: one jitted, cache-donating ``cached_forward`` call per step, as a Python decode loop
  runs it; each step pays the dispatch and read-back.
* ``device``: ``--steps`` forwards back to back inside one ``lax.fori_loop`` (the way the device
  loops of ``specjax.models.generate`` and the engine run them), so the per-step figure is the
  model's own work without per-step host overhead. The fed tokens change every iteration and the
  logits are reduced into the carry, so XLA can neither hoist nor drop any of the forward.

A verify / decode ratio near 1 means a step's cost is fixed (weights read once, overheads), which
is where speculation pays; a ratio near K + 1 means the arithmetic grows with the rows. On an
accelerator of the chip tables (``specjax.aot.chips``: TPUs and common NVIDIA GPUs) each decode
figure comes with its memory-read bound (``decode_read_bound_ms``: every matmul weight and the
cached keys / values of the context read once, at the chip's peak bandwidth) and the share of it
reached (``decode_bandwidth_utilisation``, bound / measured): near 1, decoding is limited by
reading the weights, the regime speculation is for. Each figure
is the median over ``--reps`` timed steps (device: timed loops) after warm-up; ratios are taken
within one run.

Run:
    .venv/bin/python -m benchmarks.model_step_cost                   # tiny + base50m presets
    .venv/bin/python -m benchmarks.model_step_cost --presets tiny --reps 20
    .venv/bin/python -m benchmarks.model_step_cost --presets small,base50m --loops device
    .venv/bin/python -m benchmarks.model_step_cost --quick   # smallest shapes: a smoke run
Writes ``benchmarks/results/model_step_cost.json`` (``--quick``: a file in the temp directory)
and prints a markdown table.
"""
from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import apply, cached_forward, get_preset, init_cache, init_model
from specjax.models.config import ModelConfig
from specjax.models.flops import matmul_params
from specjax.paths import dump_json


def decode_read_bytes(config: ModelConfig, batch: int, context: int) -> int:
    """The least a decode step of ``batch`` rows at ``context`` cached positions reads: every
    matmul weight once (:func:`~specjax.models.flops.matmul_params`, in the weight dtype; the
    embedding lookup reads ``batch`` rows, not counted) and each row's cached keys and values
    (in the compute dtype, the cache's)."""
    weights = matmul_params(config) * np.dtype(config.weight_dtype).itemsize
    kv = (2 * config.num_layers * batch * context * config.num_kv_heads * config.head_dim
          * np.dtype(config.compute_dtype).itemsize)
    return int(weights + kv)


def device_bandwidth() -> float | None:
    """Peak memory bandwidth (bytes/s) of the default device when it is in the chip tables of
    :mod:`specjax.aot.chips`, else None (a CPU, an unlisted card)."""
    from specjax.aot.chips import chip_of_device_kind
    chip = chip_of_device_kind(jax.devices()[0].device_kind)
    return None if chip is None else chip.hbm_bandwidth


def _timed(graphdef, state, cache, tokens, lengths):
    t0 = time.perf_counter()
    out = cached_forward(graphdef, state, tokens, cache)
    jax.block_until_ready(out.logits)
    return time.perf_counter() - t0, out.cache.rollback(lengths)


@functools.partial(jax.jit, static_argnames=("graphdef", "vocab", "steps"),
                   donate_argnames=("cache",))
def _forward_loop(graphdef, state, tokens, cache, *, vocab: int, steps: int):
    """``steps`` cached forwards of ``tokens`` [B, T] inside one ``fori_loop``, each at the same
    context (the cache's lengths are restored after every step).

    Iteration i feeds ``(tokens + i) % vocab`` and folds the max logit of every row and position
    into the carry, so loop-invariant code motion cannot hoist the embedding and the first
    projections, and dead-code elimination cannot drop the LM head. Returns (cache, checksum [])."""
    lengths = cache.lengths

    def body(i, carry):
        cache, acc = carry
        out = apply(graphdef, state, (tokens + i) % vocab, cache=cache)
        return out.cache.rollback(lengths), acc + jnp.max(out.logits, axis=-1).sum()

    return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros((), jnp.float32)))


def _timed_loop(graphdef, state, cache, tokens, *, vocab: int, steps: int):
    t0 = time.perf_counter()
    cache, acc = _forward_loop(graphdef, state, tokens, cache, vocab=vocab, steps=steps)
    jax.block_until_ready(acc)
    return (time.perf_counter() - t0) / steps, cache


def _interleaved_rows(timed_step, cache, prompt, *, max_k: int, reps: int):
    """Decode and verify(K) per-step times for K = 1..max_k, decode and verify interleaved so
    machine noise hits both alike. ``timed_step(cache, tokens) -> (seconds per step, cache)`` is
    one loop's timer (host: one dispatch; device: one ``fori_loop``). Returns (rows, decode step
    times, cache)."""
    decode_tok = prompt[:, :1]
    _, cache = timed_step(cache, decode_tok)  # compile decode
    rows, decode_all = [], []
    for k in range(1, max_k + 1):
        verify_tok = prompt[:, :k + 1]
        _, cache = timed_step(cache, verify_tok)  # compile verify(K)
        dec, ver = [], []
        for _ in range(reps):
            t, cache = timed_step(cache, decode_tok)
            dec.append(t)
            t, cache = timed_step(cache, verify_tok)
            ver.append(t)
        decode_all += dec
        rows.append({"K": k, "verify_ms": statistics.median(ver) * 1e3,
                     "decode_ms_same_loop": statistics.median(dec) * 1e3,
                     "ratio_to_decode": statistics.median(ver) / statistics.median(dec)})
    return rows, decode_all, cache


def bench_preset(name: str, *, batch: int, context: int, max_k: int, reps: int,
                 loops: tuple[str, ...] = ("host", "device"), steps: int = 32,
                 bandwidth: float | None = None) -> dict:
    """Decode and verify(K) steps *interleaved* (decode, verify, decode, verify, ...) so machine
    noise hits both alike; the ratio is median(verify) / median(decode) of the same loop.

    Returns the preset's row. ``decode_ms`` / ``verify`` are the host loop's figures, ``device``
    holds the device loop's (``steps`` forwards per timed loop); each key is present only when
    its loop ran. ``bandwidth`` (bytes/s; :func:`device_bandwidth`) adds each loop's
    ``decode_read_bound_ms`` and ``decode_bandwidth_utilisation``."""
    if not set(loops) <= {"host", "device"} or not loops:
        raise ValueError(f"loops must be a non-empty subset of ('host', 'device'), got {loops}")
    config = get_preset(name)
    model = init_model(config, seed=0)
    graphdef, state = nnx.split(model)
    max_len = context + max_k + 1
    cache = init_cache(config, batch, max_len)
    prompt = jax.random.randint(jax.random.key(0), (batch, context), 0, config.vocab_size)
    cache = cached_forward(graphdef, state, prompt, cache).cache
    read = decode_read_bytes(config, batch, context)
    row = {"preset": name, "params": config.num_params(), "batch": batch, "context": context,
           "decode_read_bytes": read}

    def bound(decode_s):
        if bandwidth is None:
            return {}
        return {"decode_read_bound_ms": read / bandwidth * 1e3,
                "decode_bandwidth_utilisation": read / bandwidth / decode_s}
    if "host" in loops:
        # A host array: each rollback makes a fresh device buffer (the cache, lengths included, is
        # donated to the next step).
        lengths = np.full((batch,), context, np.int32)
        rows, decode_all, cache = _interleaved_rows(
            lambda c, tokens: _timed(graphdef, state, c, tokens, lengths), cache, prompt,
            max_k=max_k, reps=reps)
        decode_s = statistics.median(decode_all)
        row.update(decode_ms=decode_s * 1e3, decode_tokens_per_s=batch / decode_s, verify=rows,
                   **bound(decode_s))
    if "device" in loops:
        rows, decode_all, cache = _interleaved_rows(
            functools.partial(_timed_loop, graphdef, state, vocab=config.vocab_size,
                              steps=steps), cache, prompt, max_k=max_k, reps=reps)
        decode_s = statistics.median(decode_all)
        row["device"] = {"steps_per_loop": steps, "decode_ms": decode_s * 1e3,
                         "decode_tokens_per_s": batch / decode_s, "verify": rows,
                         **bound(decode_s)}
    return row


def _print_table(name: str, loop: str, params: int, batch: int, context: int, r: dict) -> None:
    print(f"\n### {name} ({params / 1e6:.1f}M params, batch {batch}, context {context}), "
          f"{loop} loop: decode {r['decode_ms']:.3f} ms/step = "
          f"{r['decode_tokens_per_s']:.0f} tokens/s"
          + (f" ({r['decode_bandwidth_utilisation']:.0%} of the memory-read bound, "
             f"{r['decode_read_bound_ms']:.3f} ms)" if "decode_read_bound_ms" in r else ""))
    print("| K | verify ms | decode ms (same loop) | verify / decode |\n|---|---|---|---|")
    for v in r["verify"]:
        print(f"| {v['K']} | {v['verify_ms']:.3f} | {v['decode_ms_same_loop']:.3f} "
              f"| {v['ratio_to_decode']:.2f} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="tiny,base50m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--max-k", type=int, default=16)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--loops", default="host,device",
                        help="comma-separated: host (one dispatch per step), device (fori_loop)")
    parser.add_argument("--steps", type=int, default=32,
                        help="forwards per timed device loop")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny preset, context 8, K ≤ 2, 1 rep, output in the temp "
                             "directory")
    parser.add_argument("--out", default=None,
                        help="default benchmarks/results/model_step_cost.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.presets, args.batch, args.context, args.max_k, args.reps = "tiny", 1, 8, 2, 1
        args.steps = 2
    if args.out is None:
        args.out = (os.path.join(tempfile.gettempdir(), "specjax_quick", "model_step_cost.json")
                    if args.quick else "benchmarks/results/model_step_cost.json")
    bandwidth = device_bandwidth()
    results = {"backend": jax.default_backend(), "devices": str(jax.devices()[0]),
               "device_kind": jax.devices()[0].device_kind, "peak_bandwidth": bandwidth,
               "load_average_at_start": os.getloadavg(),
               "machine": f"{platform.machine()} {os.cpu_count()} cpus",
               "reps": args.reps, "loops": args.loops.split(","), "presets": []}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for name in args.presets.split(","):
        r = bench_preset(name, batch=args.batch, context=args.context, max_k=args.max_k,
                         reps=args.reps, loops=tuple(args.loops.split(",")), steps=args.steps,
                         bandwidth=bandwidth)
        results["presets"].append(r)
        for loop, figures in (("host", r if "verify" in r else None), ("device", r.get("device"))):
            if figures is not None:
                _print_table(name, loop, r["params"], r["batch"], r["context"], figures)
        # after each preset, marked partial: a run stopped by a time limit (device_check.sh's
        # steps have one) keeps the presets it measured
        dump_json(args.out, {**results, "partial": True})
    dump_json(args.out, results)
    print(f"\nwrote {args.out}")
    return results


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
