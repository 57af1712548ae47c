"""The GPU rejection-sampling kernels behind ``rejection_sample_pallas(backend="triton" |
"mosaic_gpu")`` (``rejection_sampling.py`` holds the algorithm, the jnp reference, the TPU kernel and
the dispatcher).

Both compute the per-position statistics ``(pa [B, K+1], qa [B, K], r_idx [B, K], p_idx [B, K+1])``
of ``rejection_sampling.position_stats_reference`` in one pass over ``p`` and ``q``; the shared jnp
epilogue turns them into tokens.

* Triton: grid ``(B, K+1)``, one program per (row, position), looping over vocabulary tiles of
  ``tiles.triton_block_v`` (a power of two) with masked loads.
* Mosaic GPU: ``plgpu.kernel`` over ``(B, K+1)``; each program pipelines its 256-wide TMA tiles
  (``plgpu.emit_pipeline``, two in flight), running state in SMEM; vocabularies whose row stride is
  not a multiple of 16 bytes are padded (a copy).

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
# GPU (Mosaic GPU) kernel: plgpu.kernel over (B, K+1), each program pipelining its vocabulary tiles
#
# Written with ``plgpu.kernel`` + ``plgpu.emit_pipeline``, not ``pl.pallas_call``: jax 0.10 lowers a
# ``pallas_call`` with Mosaic GPU compiler params only with a deprecation warning, and jax 0.11 no
# longer registers that lowering at all (an AssertionError at lowering time, on a GPU too).

_MGPU_TILE = 256  # TMA boxes hold at most 256 elements per dimension
_MGPU_LANES = 128  # per-(row, position) outputs are stored as 128 equal lanes (TMA needs >= 16 bytes)
_MGPU_STAGES = 2  # tiles in flight: the next tile's TMA overlaps this tile's arithmetic


def _mgpu_tile(t, x_smem, p_smem, q_smem, e_smem, accs, *, k, vocab, block_v, iota):
    """Folds vocabulary tile ``t`` (SMEM blocks of ``block_v`` entries) into the running state."""
    pa_ref, pidx_ref, pbest_ref = accs[:3]
    col = t * block_v + iota(block_v)
    valid = col < vocab  # the last tile reads past the row; TMA fills that part, masked here
    x = jnp.max(x_smem[...])
    hit = col == x
    p = jnp.where(valid, p_smem[...].astype(jnp.float32), 0.0)
    r = jnp.where(valid, 1.0 / e_smem[...].astype(jnp.float32), 0.0)

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
        qa_ref, ridx_ref, rbest_ref = accs[3:]
        q = jnp.where(valid, q_smem[...].astype(jnp.float32), 0.0)
        qa_ref[...] = qa_ref[...] + jnp.sum(jnp.where(hit, q, 0.0))
        # position K has no draft: its residual race reads q_{K-1} and is discarded by the epilogue
        race(jnp.maximum(p - q, 0.0) * r, rbest_ref, ridx_ref)


def _mgpu_kernel(*refs, k, vocab, block_v, iota, plgpu):
    """One program per (row ``b``, position ``j``): GMEM refs in and out, the running state in SMEM
    scratch (``pa, p_idx, p_best`` and, with drafts, ``qa, r_idx, r_best``), copied out at the end."""
    lanes = _MGPU_LANES
    n_in, n_out = (4, 4) if k else (3, 2)
    ins, outs, accs = refs[:n_in], refs[n_in:n_in + n_out], refs[n_in + n_out:]
    b, j = jax.lax.axis_index("b"), jax.lax.axis_index("j")
    for ref, init in zip(accs, (0.0, -1, 0.0) * 2):
        ref[...] = jnp.full((lanes,), init, ref.dtype)

    def step(idx, *smem):
        x_s, p_s, *q_s, e_s = smem
        _mgpu_tile(idx[0], x_s, p_s, q_s[0] if k else None, e_s, accs, k=k, vocab=vocab,
                   block_v=block_v, iota=iota)

    tile = plgpu.BlockSpec((block_v,), lambda t: (t,))
    gmem = [ins[0].at[b, j], ins[1].at[b, j]] + ([ins[2].at[b, jnp.minimum(j, k - 1)]] if k else [])
    gmem.append(ins[-1].at[b])
    specs = [plgpu.BlockSpec((lanes,), lambda t: (0,))] + [tile] * (len(gmem) - 1)
    plgpu.emit_pipeline(step, grid=(pl.cdiv(vocab, block_v),), in_specs=specs,
                        max_concurrent_steps=_MGPU_STAGES)(*gmem)
    plgpu.commit_smem()
    for acc, out in zip((accs[0], accs[1]) + ((accs[3], accs[4]) if k else ()), outs):
        plgpu.copy_smem_to_gmem(acc, out.at[b, j])
    plgpu.wait_smem_to_gmem(0)


def _mgpu_interpret_params():
    """Mosaic GPU's interpreter (simulated SMEM, TMA and barriers). Reads past a row's end come back
    as NaN, as a check that the kernel masks them (the hardware's TMA fills zeros)."""
    try:
        from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
    except ImportError:  # jax 0.10 has it without exporting it
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="nan")


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
    args = [jnp.broadcast_to(xp[:, :, None], (bsz, k1, lanes)), target_probs]
    args += [draft_probs] if k else []
    args.append(exponentials)
    n_out = 4 if k else 2
    out_type = [
        jax.ShapeDtypeStruct((bsz, k1, lanes), jnp.float32 if i % 2 == 0 else jnp.int32) for i in range(n_out)
    ]
    acc_types = [plgpu.SMEM((lanes,), dt) for dt in (jnp.float32, jnp.int32, jnp.float32)] * (2 if k else 1)
    outs = plgpu.kernel(
        functools.partial(_mgpu_kernel, k=k, vocab=vocab, block_v=bv, iota=iota, plgpu=plgpu),
        out_type=out_type,
        scratch_types=acc_types,
        grid=(bsz, k1),
        grid_names=("b", "j"),
        kernel_name="rejection_sampling_stats",
        # Lane semantics named, not left to the default: the kernel is written per lane
        # (WG_STRIDED iotas), and jax 0.11 makes warpgroup lowering the default.
        compiler_params=None if interpret else plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=_mgpu_interpret_params() if interpret else None,
    )(*args)
    outs = [o[..., 0] for o in outs]
    if k:
        pa, p_idx, qa, r_idx = outs
        return pa, qa[:, :k], r_idx[:, :k], p_idx
    pa, p_idx = outs
    return pa, jnp.zeros((bsz, 0), jnp.float32), jnp.zeros((bsz, 0), jnp.int32), p_idx
