"""Two-phase rejection sampling on TPU: whole-vocabulary reads only for the one row each draft needs.

The single-pass kernel (``rejection_sampling.py``, backend ``"mosaic_tpu"``) races every draft
position because the first rejection ``n`` is not known before the acceptance tests are read, so it
reads all of ``p`` ``[B, K+1, V]`` and ``q`` ``[B, K, V]`` once. But only two kinds of values are
needed:

1. **Acceptance** (phase 1): ``p_k(x_k)`` and ``q_k(x_k)`` for ``k < K``, ``B x K`` scalars. Each is
   fetched by a DMA of the 128-lane chunk of row ``k`` that holds ``x_k`` (a TPU DMA's lane offset
   must be a multiple of 128), which is ``128 / V`` of the row. The acceptance chain then gives
   ``n`` per batch row (``[B]``-sized jnp, as in the single-pass kernel's epilogue).
2. **The race** (phase 2) over one row per batch row: ``max(0, p_n − q_n) / E`` and ``p_n / E``
   (the residual after a rejection, and the bonus / underflow fallback), with ``n`` read from SMEM
   (scalar prefetch) to address the DMAs of ``p_n`` and ``q_min(n, K−1)`` tile by tile.

So each batch row reads about ``3V`` values (``p_n``, ``q_n``, the noise) instead of ``(2K + 2)V``:
``3 / (2K + 1)`` of one read of ``p`` and ``q`` (0.43 at K = 3, 0.20 at K = 7). The race and the
choice of token are those of the single-pass kernel and of :func:`specjax.verify.rejection_sample`
(``argmax_v w_v · (1/E_v)``, first index on ties, ``-1`` when no score is positive), so all three
return the same tokens bit for bit for the same random inputs.

Constraints: ``V`` a multiple of 128 (the acceptance chunks and the race tiles are whole 128-lane
DMAs; 32,000, 128,256 and 151,936 are); ``backend="mosaic_tpu"`` serves any ``V``. Rows are
processed in blocks of 8 (all ``B`` rows when ``B % 8 != 0``), as in the single-pass kernel.
The DMAs of a step are started together and awaited before the arithmetic (no overlap across
steps): the kernel's traffic, not its latency, is what this version settles. The kernel states its
traffic to XLA (``pl.CostEstimate``), since XLA cannot see inside a Mosaic kernel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.rejection_common import (_accepted, _balanced_tile, _choose, _emit, _nd,
                                             _race_update, _rows_per_block)
from specjax.verify_types import VerifyOutput

__all__ = ["rejection_sample_two_phase"]

_CHUNK = 128  # lanes per acceptance DMA: a TPU DMA's lane offset is a multiple of 128


def _tpu():
    from jax.experimental.pallas import tpu  # imported when used: CPU-only installs never need it
    return tpu


def _accept_kernel(x_smem, x_ref, p_hbm, q_hbm, pa_ref, qa_ref, pbuf, qbuf, sem, *, k, rows, vocab):
    """Phase 1, one block of ``rows`` batch rows: ``pa``, ``qa`` ``[rows, K, 1]``."""
    b0 = pl.program_id(0) * rows
    copies = []
    for i in range(rows):
        for j in range(k):
            xs = jnp.clip(x_smem[(b0 + i) * k + j], 0, vocab - 1)
            c = pl.multiple_of((xs // _CHUNK) * _CHUNK, _CHUNK)
            for src, dst, s in ((p_hbm, pbuf, 0), (q_hbm, qbuf, 1)):
                cp = _tpu().make_async_copy(src.at[b0 + i, pl.ds(j, 1), pl.ds(c, _CHUNK)],
                                             dst.at[i, pl.ds(j, 1), :], sem.at[s])
                cp.start()
                copies.append(cp)
    for cp in copies:
        cp.wait()
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, _CHUNK), 1)
    for i in range(rows):
        xm = jnp.clip(x_ref[i], 0, vocab - 1) % _CHUNK  # (K, 1)
        pa_ref[i] = jnp.sum(jnp.where(lane == xm, pbuf[i].astype(jnp.float32), 0.0), axis=1,
                            keepdims=True)
        qa_ref[i] = jnp.sum(jnp.where(lane == xm, qbuf[i].astype(jnp.float32), 0.0), axis=1,
                            keepdims=True)


def _race_kernel(*refs, k, rows, vocab, block_v, tiles):
    if k:
        (n_smem, p_hbm, q_hbm, e_ref, pidx_ref, ridx_ref, pbuf, qbuf, pbest, rbest, sem) = refs
    else:
        (n_smem, p_hbm, e_ref, pidx_ref, pbuf, pbest, sem) = refs
    b0 = pl.program_id(0) * rows
    t = pl.program_id(1)
    tail = vocab - (tiles - 1) * block_v  # static: the last tile's width (a multiple of 128)

    @pl.when(t == 0)
    def _init():
        pidx_ref[...] = jnp.full(pidx_ref.shape, -1, jnp.int32)
        pbest[...] = jnp.zeros(pbest.shape, jnp.float32)
        if k:
            ridx_ref[...] = jnp.full(ridx_ref.shape, -1, jnp.int32)
            rbest[...] = jnp.zeros(rbest.shape, jnp.float32)

    def fetch(width):
        start = pl.multiple_of(t * block_v, _CHUNK)
        copies = []
        for i in range(rows):
            n = n_smem[b0 + i]
            srcs = [(p_hbm, pbuf, n)] + ([(q_hbm, qbuf, jnp.minimum(n, k - 1))] if k else [])
            for s, (src, dst, row) in enumerate(srcs):
                cp = _tpu().make_async_copy(src.at[b0 + i, pl.ds(row, 1), pl.ds(start, width)],
                                             dst.at[pl.ds(i, 1), pl.ds(0, width)], sem.at[s])
                cp.start()
                copies.append(cp)
        for cp in copies:
            cp.wait()

    if tiles > 1:
        pl.when(t < tiles - 1)(lambda: fetch(block_v))
    pl.when(t == tiles - 1)(lambda: fetch(tail))
    col = t * block_v + jax.lax.broadcasted_iota(jnp.int32, (1, block_v), 1)
    valid = col < vocab
    r = jnp.where(valid, 1.0 / e_ref[...].astype(jnp.float32), 0.0)  # (rows, T)
    p = jnp.where(valid, pbuf[...].astype(jnp.float32), 0.0)
    _race_update(p * r, col, pbest, pidx_ref)
    if k:
        q = jnp.where(valid, qbuf[...].astype(jnp.float32), 0.0)
        _race_update(jnp.maximum(p - q, 0.0) * r, col, rbest, ridx_ref)


def _cost(bsz, k, vocab, noise_lanes, p_item, q_item, e_item):
    """Each phase's :class:`pl.CostEstimate`, ``(accept, race)``. Phase 1 reads, per batch row,
    ``K`` 128-lane chunks of ``p`` and ``q``; phase 2 one row of each (``V`` values) and the noise
    row in whole tiles; both move the small inputs / outputs."""
    small = bsz * (k + 1) * 4 * 4
    accept = pl.CostEstimate(flops=int(bsz * k * _CHUNK * 4), transcendentals=0,
                             bytes_accessed=int(bsz * k * _CHUNK * (p_item + q_item) + small))
    race_bytes = bsz * vocab * (p_item + (q_item if k else 0)) + bsz * noise_lanes * e_item
    race = pl.CostEstimate(flops=int(bsz * noise_lanes * 12), transcendentals=0,
                           bytes_accessed=int(race_bytes + small))
    return accept, race


@functools.partial(jax.jit, static_argnames=("block_v", "interpret"))
def rejection_sample_two_phase(draft_tokens, draft_probs, target_probs, uniforms, exponentials,
                               num_draft=None, *, block_v: int = 2048,
                               interpret=False) -> VerifyOutput:
    """Batched rejection sampling in two phases (module docstring); the same inputs and result as
    :func:`specjax.verify.rejection_sample_with_noise`.

    Args:
      draft_tokens: int32 ``[B, K]``; draft_probs: ``[B, K, V]``; target_probs: ``[B, K+1, V]``
        (``V`` a multiple of 128); uniforms: float32 ``[B, K]``; exponentials: float32 ``[B, V]``;
        num_draft: int32 ``[B]`` (default ``K``).
      block_v: vocabulary tile of the race (a multiple of 128).
      interpret: run under the Pallas interpreter (``True`` or ``pltpu.InterpretParams()``).
    """
    bsz, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if vocab % _CHUNK:
        raise ValueError(f"the two-phase kernel needs a vocabulary that is a multiple of {_CHUNK}, "
                         f"got {vocab}; use backend='mosaic_tpu'")
    if block_v <= 0 or block_v % _CHUNK:
        raise ValueError(f"block_v must be a positive multiple of {_CHUNK}, got {block_v}")
    tpu = _tpu()
    nd = _nd(num_draft, bsz, k)
    x = draft_tokens.astype(jnp.int32)
    rows = _rows_per_block(bsz)
    bv = _balanced_tile(vocab, block_v)
    tiles = pl.cdiv(vocab, bv)
    p_item, e_item = target_probs.dtype.itemsize, exponentials.dtype.itemsize
    q_item = draft_probs.dtype.itemsize
    accept_cost, race_cost = _cost(bsz, k, vocab, tiles * bv, p_item, q_item, e_item)
    hbm = pl.BlockSpec(memory_space=pl.ANY)

    if k:
        col = pl.BlockSpec((rows, k, 1), lambda b, xs: (b, 0, 0))
        pa, qa = pl.pallas_call(
            functools.partial(_accept_kernel, k=k, rows=rows, vocab=vocab),
            grid_spec=tpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(bsz // rows,), in_specs=[col, hbm, hbm],
                out_specs=[col, col],
                scratch_shapes=[tpu.VMEM((rows, k, _CHUNK), target_probs.dtype),
                                tpu.VMEM((rows, k, _CHUNK), draft_probs.dtype),
                                tpu.SemaphoreType.DMA((2,))]),
            out_shape=[jax.ShapeDtypeStruct((bsz, k, 1), jnp.float32)] * 2,
            compiler_params=tpu.CompilerParams(dimension_semantics=("parallel",)),
            interpret=interpret, name="rejection_two_phase_accept",
            cost_estimate=accept_cost,
        )(x.reshape(-1), x[:, :, None], target_probs, draft_probs)
        n = _accepted(x, uniforms, nd, pa[..., 0], qa[..., 0])
    else:
        n = jnp.zeros((bsz,), jnp.int32)

    one = pl.BlockSpec((rows, 1), lambda b, t, ns: (b, 0))
    noise = pl.BlockSpec((rows, bv), lambda b, t, ns: (b, t))
    in_specs = [hbm] + ([hbm] if k else []) + [noise]
    scratch = [tpu.VMEM((rows, bv), target_probs.dtype)]
    if k:
        scratch.append(tpu.VMEM((rows, bv), draft_probs.dtype))
    scratch += [tpu.VMEM((rows, 1), jnp.float32)] * (2 if k else 1)
    scratch.append(tpu.SemaphoreType.DMA((2,)))
    outs = pl.pallas_call(
        functools.partial(_race_kernel, k=k, rows=rows, vocab=vocab, block_v=bv, tiles=tiles),
        grid_spec=tpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(bsz // rows, tiles), in_specs=in_specs,
            out_specs=[one] * (2 if k else 1), scratch_shapes=scratch),
        out_shape=[jax.ShapeDtypeStruct((bsz, 1), jnp.int32)] * (2 if k else 1),
        compiler_params=tpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret, name="rejection_two_phase_race",
        cost_estimate=race_cost,
    )(n, *([target_probs, draft_probs] if k else [target_probs]), exponentials)
    return _emit(x, n, _choose(n, nd, outs[1][:, 0] if k else None, outs[0][:, 0]))
