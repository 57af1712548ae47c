"""Compiled memory of TV / e2e-TV training losses: custom VJP (Bebop eq. 11, chunked) vs autodiff.

For each loss and token count this lowers and compiles ``jax.jit(jax.value_and_grad(sum ∘ loss))``
with respect to the draft logits (nothing is executed, so no buffer is allocated) and reads XLA's
buffer assignment from ``compiled.memory_analysis()``:

* ``argument``: the inputs (draft logits and target probabilities);
* ``output``: the loss value and the gradient (one logits-sized buffer, unavoidable);
* ``temp``: the peak of everything else live at once: the loss's own intermediates;
* ``peak`` = argument + output + temp − alias (an upper bound on what the call holds at once).

Sizes are reported in MiB and as multiples of ``U`` = one float32 ``[tokens, V]`` buffer. The TV
loss takes logits ``[tokens, V]`` (1 U); e2e-TV takes MTP-layout logits ``[tokens, γ, V]`` (γ U:
γ draft positions per token). Variants:

* ``custom``: ``specjax.losses`` as shipped (custom VJP, row-chunked ``fori_loop``);
* ``custom_unchunked``: the same custom VJP with ``chunk_size=0`` (one fused pass, fusion left to
  the compiler);
* ``autodiff``: ``1 − Σ min(p, softmax(z))`` differentiated by JAX (the reference formula).

Run:
    .venv/bin/python -m benchmarks.loss_memory                      # tokens 256 512 1024, γ=3
    .venv/bin/python -m benchmarks.loss_memory --tokens 256 --vocab 32000
    .venv/bin/python -m benchmarks.loss_memory --quick     # smallest shapes: a smoke run
Writes ``benchmarks/results/loss_memory.json`` (``--quick``: a file in the temp directory) and
prints a markdown table.
Numbers are backend-specific (XLA's fusion and buffer assignment differ between CPU, GPU, TPU).
"""
from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

import jax
import jax.numpy as jnp

from specjax import losses as L
from specjax.paths import dump_json

MIB = 2**20


def _losses(gamma: int):
    """name -> (loss fn of (z, p) returning per-row losses, logits shape fn of (tokens, V))."""
    rows = lambda t, v: (t, v)  # noqa: E731
    mtp = lambda t, v: (t, gamma, v)  # noqa: E731

    def e2e_autodiff(z, p):
        return L.e2e_tv_from_tv(L.tv_loss_autodiff(z, p))

    return {
        ("tv", "custom"): (L.tv_loss, rows),
        ("tv", "custom_unchunked"): (lambda z, p: L.tv_loss(z, p, chunk_size=0), rows),
        ("tv", "autodiff"): (L.tv_loss_autodiff, rows),
        ("e2e_tv", "custom"): (L.e2e_tv_loss, mtp),
        ("e2e_tv", "custom_unchunked"): (lambda z, p: L.e2e_tv_loss(z, p, chunk_size=0), mtp),
        ("e2e_tv", "autodiff"): (e2e_autodiff, mtp),
        # Context: forward KL (= CE up to a constant) by plain autodiff, and the full DSpark
        # objective (CE fused into the custom-VJP TV kernel + confidence BCE) on MTP-layout blocks.
        ("kl", "autodiff"): (L.kl_loss, rows),
        ("dspark", "custom"): (None, mtp),
    }


def measure(loss_name: str, variant: str, fn, shape_fn, tokens: int, vocab: int) -> dict:
    shape = shape_fn(tokens, vocab)
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    if loss_name == "dspark":
        lab = jax.ShapeDtypeStruct(shape[:-1], jnp.int32)
        conf = jax.ShapeDtypeStruct(shape[:-1], jnp.float32)

        def total(z, p, labels, c):
            return jnp.sum(L.dspark_loss(z, p, labels, c))

        args = (spec, spec, lab, conf)
    else:
        def total(z, p):
            return jnp.sum(fn(z, p))

        args = (spec, spec)
    t0 = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(total)).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    m = compiled.memory_analysis()
    unit = tokens * vocab * 4  # one f32 [tokens, V] buffer
    arg, out, tmp, alias = (m.argument_size_in_bytes, m.output_size_in_bytes,
                            m.temp_size_in_bytes, m.alias_size_in_bytes)
    peak = arg + out + tmp - alias
    return {
        "loss": loss_name, "variant": variant, "tokens": tokens, "vocab": vocab,
        "logits_shape": list(shape), "unit_bytes": unit,
        "argument_bytes": arg, "output_bytes": out, "temp_bytes": tmp, "alias_bytes": alias,
        "generated_code_bytes": m.generated_code_size_in_bytes, "peak_bytes": peak,
        "argument_units": arg / unit, "output_units": out / unit, "temp_units": tmp / unit,
        "peak_units": peak / unit, "compile_seconds": round(compile_s, 2),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 8 tokens, V = 512, γ = 2, output in the temp directory")
    ap.add_argument("--out", default=None, help="default benchmarks/results/loss_memory.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.vocab, args.gamma = [8], 512, 2
    if args.out is None:
        args.out = (os.path.join(tempfile.gettempdir(), "specjax_quick", "loss_memory.json")
                    if args.quick else
                    os.path.join(os.path.dirname(__file__), "results", "loss_memory.json"))

    rows = []
    for (loss_name, variant), (fn, shape_fn) in _losses(args.gamma).items():
        for t in args.tokens:
            r = measure(loss_name, variant, fn, shape_fn, t, args.vocab)
            rows.append(r)
            print(f"{loss_name:7s} {variant:17s} tokens={t:5d} temp={r['temp_units']:.3f} U "
                  f"peak={r['peak_units']:.3f} U ({r['compile_seconds']}s compile)", flush=True)

    result = {
        "benchmark": "loss_memory",
        "description": "XLA compiled memory of jit(value_and_grad(sum(loss))) w.r.t. draft logits; "
                       "U = one float32 [tokens, vocab] buffer",
        "gamma": args.gamma,
        "vocab": args.vocab,
        "default_chunk_elements": L.DEFAULT_CHUNK_ELEMENTS,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "jax_version": jax.__version__,
        "platform": platform.platform(),
        "rows": rows,
    }
    dump_json(args.out, result)

    print()
    print(f"V = {args.vocab}, γ = {args.gamma}, backend = {result['backend']}; "
          "U = f32 [tokens, V]; logits are 1 U (tv, kl) or γ U (e2e_tv, dspark)")
    print()
    print("| loss | variant | tokens | U (MiB) | argument (U) | output (U) | temp (U) "
          "| temp (MiB) | peak (U) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['loss']} | {r['variant']} | {r['tokens']} | {r['unit_bytes'] / MIB:.0f} | "
              f"{r['argument_units']:.2f} | {r['output_units']:.2f} | {r['temp_units']:.3f} | "
              f"{r['temp_bytes'] / MIB:.0f} | {r['peak_units']:.2f} |")
    return result


if __name__ == "__main__":
    main()
