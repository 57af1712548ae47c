"""The GPU rejection-sampling kernels behind ``rejection_sample_pallas(backend="triton" |
"mosaic_gpu")`` (``rejection_sampling.py`` holds the algorithm, the jnp reference, the TPU kernel and
the dispatcher).

Both compute the per-position statistics ``(pa [B, K+1], qa [B, K], r_idx [B, K], p_idx [B, K+1])``
of ``rejection_sampling.position_stats_reference`` in one pass over ``p`` and ``q``; the shared jnp
epilogue turns them into tokens.

* Triton: grid ``(B, K+1)``, one program per (row, position), looping over vocabulary tiles of
  ``tiles.triton_block_v`` (a power of two) with masked loads.
* Mosaic GPU: grid ``(B, K+1, cdiv(V, 256))``, the tile axis sequential, 256-wide TMA tiles, running
  state in SMEM; vocabularies whose row stride is not a multiple of 16 bytes are padded (a copy).

``tiles`` is a ``rejection_sampling.RejectionTiles``; ``xp`` int32 ``[B, K+1]`` is the drafted
tokens with a ``-1`` column appended (position ``K`` has no draft).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

__all__ = ["stats_triton", "stats_mosaic_gpu"]

_BIG = 2**30  # index sentinel for first-argmax reductions (above any vocabulary id)


# ----------------------------------------------------------------------------------------------
# GPU (Triton) kernel: grid (B, K+1), loop over vocab tiles


def _triton_kernel(*refs, k, vocab, block_v):
    from jax.experimental.pallas import triton as plt

    if k:
        x_ref, p_ref, q_ref, e_ref, pa_ref, pidx_ref, qa_ref, ridx_ref = refs
    else:
        x_ref, p_ref, e_ref, pa_ref, pidx_ref = refs
    pos = pl.program_id(1)
    x = x_ref[...]  # (1,)
    n_tiles = pl.cdiv(vocab, block_v)

    def race(score, col, best, idx):
        m = jnp.max(score)
        i = jnp.min(jnp.where(score == m, col, _BIG))
        better = m > best
        return jnp.where(better, m, best), jnp.where(better, i, idx)

    def body(t, carry):
        pa, qa, pbest, pidx, rbest, ridx = carry
        start = pl.multiple_of(t * block_v, block_v)
        col = start + jnp.arange(block_v, dtype=jnp.int32)
        valid = col < vocab
        p = plt.load(p_ref.at[pl.ds(start, block_v)], mask=valid, other=0.0).astype(jnp.float32)
        e = plt.load(e_ref.at[pl.ds(start, block_v)], mask=valid, other=1.0).astype(jnp.float32)
        r = jnp.where(valid, 1.0 / e, 0.0)
        hit = col == x
        pa = pa + jnp.sum(jnp.where(hit, p, 0.0))
        pbest, pidx = race(p * r, col, pbest, pidx)
        if k:
            q = plt.load(q_ref.at[pl.ds(start, block_v)], mask=valid, other=0.0).astype(jnp.float32)
            qa = qa + jnp.sum(jnp.where(hit, q, 0.0))
            rbest, ridx = race(jnp.maximum(p - q, 0.0) * r, col, rbest, ridx)
        return pa, qa, pbest, pidx, rbest, ridx

    zero, minus1 = jnp.float32(0.0), jnp.int32(-1)
    pa, qa, _, pidx, _, ridx = jax.lax.fori_loop(0, n_tiles, body, (zero, zero, zero, minus1, zero, minus1))
    pa_ref[...] = jnp.full((1,), pa, jnp.float32)
    pidx_ref[...] = jnp.full((1,), pidx, jnp.int32)
    if k:
        qa_ref[...] = jnp.full((1,), qa, jnp.float32)
        ridx_ref[...] = jnp.full((1,), jnp.where(pos < k, ridx, -1), jnp.int32)


def stats_triton(xp, draft_probs, target_probs, exponentials, tiles, interpret):
    from jax.experimental.pallas import triton as plt

    bsz, k1, vocab = target_probs.shape
    k = k1 - 1
    bv = min(tiles.triton_block_v, pl.next_power_of_2(vocab))
    scalar = pl.BlockSpec((None, 1), lambda b, j: (b, j))
    in_specs = [scalar, pl.BlockSpec((None, None, vocab), lambda b, j: (b, j, 0))]
    args = [xp, target_probs]
    if k:
        in_specs.append(pl.BlockSpec((None, None, vocab), lambda b, j: (b, jnp.minimum(j, k - 1), 0)))
        args.append(draft_probs)
    in_specs.append(pl.BlockSpec((None, vocab), lambda b, j: (b, 0)))
    args.append(exponentials)
    n_out = 4 if k else 2
    out_shape = [
        jax.ShapeDtypeStruct((bsz, k1), jnp.float32 if i % 2 == 0 else jnp.int32) for i in range(n_out)
    ]
    outs = pl.pallas_call(
        functools.partial(_triton_kernel, k=k, vocab=vocab, block_v=bv),
        out_shape=out_shape,
        grid=(bsz, k1),
        in_specs=in_specs,
        out_specs=[scalar] * n_out,
        compiler_params=plt.CompilerParams(num_warps=tiles.triton_num_warps, num_stages=tiles.triton_num_stages),
        interpret=interpret,
        name="rejection_sampling_stats",
    )(*args)
    if k:
        pa, p_idx, qa, r_idx = outs
        return pa, qa[:, :k], r_idx[:, :k], p_idx
    pa, p_idx = outs
    return pa, jnp.zeros((bsz, 0), jnp.float32), jnp.zeros((bsz, 0), jnp.int32), p_idx


# ----------------------------------------------------------------------------------------------
# GPU (Mosaic GPU) kernel: grid (B, K+1, vocab tiles), the tile axis sequential

_MGPU_TILE = 256  # TMA boxes hold at most 256 elements per dimension
_MGPU_LANES = 128  # per-(row, position) outputs are stored as 128 equal lanes (TMA needs >= 16 bytes)


def _mgpu_kernel(*refs, k, vocab, block_v, iota):
    lanes = _MGPU_LANES
    if k:
        x_ref, p_ref, q_ref, e_ref, pa_ref, pidx_ref, qa_ref, ridx_ref, pbest_ref, rbest_ref = refs
    else:
        x_ref, p_ref, e_ref, pa_ref, pidx_ref, pbest_ref = refs
    t = pl.program_id(2)

    @pl.when(t == 0)
    def _init():
        pa_ref[...] = jnp.zeros((lanes,), jnp.float32)
        pidx_ref[...] = jnp.full((lanes,), -1, jnp.int32)
        pbest_ref[...] = jnp.zeros((lanes,), jnp.float32)
        if k:
            qa_ref[...] = jnp.zeros((lanes,), jnp.float32)
            ridx_ref[...] = jnp.full((lanes,), -1, jnp.int32)
            rbest_ref[...] = jnp.zeros((lanes,), jnp.float32)

    col = t * block_v + iota(block_v)
    valid = col < vocab
    x = jnp.max(x_ref[...])
    hit = col == x
    p = jnp.where(valid, p_ref[...].astype(jnp.float32), 0.0)
    r = jnp.where(valid, 1.0 / e_ref[...].astype(jnp.float32), 0.0)

    def race(score, best_ref, idx_ref):
        m = jnp.max(score)
        i = jnp.min(jnp.where(score == m, col, _BIG))
        best = best_ref[...]
        better = m > best
        best_ref[...] = jnp.where(better, m, best)
        idx_ref[...] = jnp.where(better, i, idx_ref[...])

    pa_ref[...] = pa_ref[...] + jnp.sum(jnp.where(hit, p, 0.0))
    race(p * r, pbest_ref, pidx_ref)
    if k:
        q = jnp.where(valid, q_ref[...].astype(jnp.float32), 0.0)
        qa_ref[...] = qa_ref[...] + jnp.sum(jnp.where(hit, q, 0.0))
        # position K has no draft: its residual race reads q_{K-1} and is discarded by the epilogue
        race(jnp.maximum(p - q, 0.0) * r, rbest_ref, ridx_ref)


def stats_mosaic_gpu(xp, draft_probs, target_probs, exponentials, tiles, interpret):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bsz, k1, vocab = target_probs.shape
    k = k1 - 1
    lanes, bv = _MGPU_LANES, _MGPU_TILE
    # TMA wants every row stride to be a multiple of 16 bytes; other vocab sizes are padded (a copy
    # of p and q -- use the Triton backend for those).
    itemsizes = [jnp.dtype(a.dtype).itemsize for a in (target_probs, exponentials) + ((draft_probs,) if k else ())]
    vpad = -vocab % max(16 // s for s in itemsizes)
    if vpad:
        target_probs = jnp.pad(target_probs, ((0, 0), (0, 0), (0, vpad)))
        exponentials = jnp.pad(exponentials, ((0, 0), (0, vpad)), constant_values=1.0)
        if k:
            draft_probs = jnp.pad(draft_probs, ((0, 0), (0, 0), (0, vpad)))
    if interpret:
        iota = lambda n: jax.lax.broadcasted_iota(jnp.int32, (n,), 0)
    else:
        iota = lambda n: plgpu.broadcasted_iota(
            jnp.int32, (n,), 0, layout=plgpu.Layout.WG_STRIDED((n,), vec_size=n // 128)
        )
    vec = pl.BlockSpec((None, None, lanes), lambda b, j, t: (b, j, 0))
    in_specs = [vec, pl.BlockSpec((None, None, bv), lambda b, j, t: (b, j, t))]
    args = [jnp.broadcast_to(xp[:, :, None], (bsz, k1, lanes)), target_probs]
    if k:
        in_specs.append(pl.BlockSpec((None, None, bv), lambda b, j, t: (b, jnp.minimum(j, k - 1), t)))
        args.append(draft_probs)
    in_specs.append(pl.BlockSpec((None, bv), lambda b, j, t: (b, t)))
    args.append(exponentials)
    n_out = 4 if k else 2
    out_shape = [
        jax.ShapeDtypeStruct((bsz, k1, lanes), jnp.float32 if i % 2 == 0 else jnp.int32) for i in range(n_out)
    ]
    outs = pl.pallas_call(
        functools.partial(_mgpu_kernel, k=k, vocab=vocab, block_v=bv, iota=iota),
        out_shape=out_shape,
        grid=(bsz, k1, pl.cdiv(vocab, bv)),
        in_specs=in_specs,
        out_specs=[vec] * n_out,
        scratch_shapes=[plgpu.SMEM((lanes,), jnp.float32)] * (n_out // 2),
        # Lane semantics named, not left to the default: the kernel is written per lane
        # (WG_STRIDED iotas), and jax 0.11 makes warpgroup lowering the default.
        compiler_params=None
        if interpret
        else plgpu.CompilerParams(dimension_semantics=("parallel", "parallel", "sequential"),
                                  lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
        name="rejection_sampling_stats",
    )(*args)
    outs = [o[..., 0] for o in outs]
    if k:
        pa, p_idx, qa, r_idx = outs
        return pa, qa[:, :k], r_idx[:, :k], p_idx
    pa, p_idx = outs
    return pa, jnp.zeros((bsz, 0), jnp.float32), jnp.zeros((bsz, 0), jnp.int32), p_idx
