"""Batched rejection sampling as a Pallas kernel (TPU Mosaic, GPU Triton), with its jnp reference.

Algorithm: exactly :func:`specjax.verify.rejection_sample_with_noise` (Leviathan et al. 2023;
Chen et al. 2023; docs/DESIGN.md "The math"), over the same explicit random inputs

* ``uniforms`` float32 ``[B, K]`` (acceptance tests) and
* ``exponentials`` float32 ``[B, V]`` (one Exp(1) vector per row for the exponential race that draws
  the correction / bonus token),

so that for the same inputs the kernel, the reference below and the ``jnp`` verifier return the same
tokens bit for bit. The race (``argmax_v w_v / E_v``) is what makes that possible: it is elementwise
plus a max, so it does not depend on how the vocabulary is tiled, unlike an inverse CDF whose cumulative
sum rounds differently per tiling.

Structure. The kernel makes one pass over ``p`` ``[B, K+1, V]`` and ``q`` ``[B, K, V]`` and, for every
row ``b`` and position ``k``, produces four small statistics (``[B, K+1]`` / ``[B, K]``):

* ``pa[b, k] = p_k(x_k)`` and ``qa[b, k] = q_k(x_k)`` (a masked sum that hits one element: exact),
* ``r_idx[b, k]`` = first argmax of ``max(0, p_k - q_k) * (1/E)``, or ``-1`` if no score is positive,
* ``p_idx[b, k]`` = first argmax of ``p_k * (1/E)``, or ``-1`` if no score is positive.

A ``[B, K]``-sized epilogue in ``jnp`` then runs the acceptance chain (``u_k q_k(x_k) < p_k(x_k)``,
``q_k(x_k) > 0``, ``k < num_draft``), finds the first rejection ``n`` and emits ``r_idx[b, n]`` (falling
back to ``p_idx[b, n]`` when the residual underflowed) or the bonus ``p_idx[b, num_draft]``. Since the
row ``n`` is not known before the acceptance tests are read, the kernel races every position; that
is one streaming pass (all of ``p`` and ``q`` read once, the noise once per row on TPU) rather than a
gather of two rows, so on a CPU the gather-based ``jnp`` verifier is the faster path, and the kernel is
for accelerators where the probabilities are already in HBM and streamed at full bandwidth.

Backends (``rejection_sample_pallas(..., backend=...)``):

* ``"mosaic_tpu"``: grid ``(B / 8, cdiv(V, block_v))`` (one block of all rows when ``B % 8 != 0``),
  batch axis ``parallel``, vocab axis ``arbitrary``; blocks ``[8, K+1, block_v]`` of ``p``,
  ``[8, K, block_v]`` of ``q``, ``[8, block_v]`` of the noise; running statistics live in the resident
  output blocks and a VMEM scratch. The kernel declares its HBM traffic to XLA
  (``pl.CostEstimate``): XLA cannot see inside a Mosaic kernel. The vocab tail
  (``V % block_v != 0``, e.g. 8193 or 151936) is masked, never padded (padding would copy ``p`` and
  ``q``).
* ``"triton"`` (``rejection_gpu.py``): grid ``(B, K+1)``, one program per (row, position), looping
  over vocab tiles of ``block_v`` (a power of two, as Triton requires) with masked loads.
* ``"mosaic_gpu"`` (``rejection_gpu.py``): ``plgpu.kernel`` over ``(B, K+1)``; each program
  pipelines its 256-wide TMA tiles (a TMA box holds at most 256 elements per dimension; two tiles in
  flight) through ``plgpu.emit_pipeline``, running state in SMEM. TMA needs 16-byte aligned row
  strides, so a vocabulary with ``V % 4 != 0`` (f32) is padded first, which copies ``p`` and ``q``;
  prefer Triton there. (Not ``pl.pallas_call``: jax 0.11 no longer lowers a Mosaic GPU
  ``pallas_call``. The kernel names lane lowering semantics, which jax 0.11 no longer takes by
  default. jax 0.11 also deprecates Pallas' Triton backend in favour of Mosaic GPU.)
* ``"mosaic_tpu_two_phase"``: ``rejection_two_phase.py``. Acceptance from 128-lane chunks around
  the drafted tokens, then one race over the single row each batch row needs: about
  ``3 / (2K + 1)`` of the bytes of ``p`` and ``q`` (``V`` a multiple of 128).
* ``"reference"``: :func:`rejection_sample_reference`, the kernel's plain-jnp mirror (what
  ``"auto"`` picks off TPU / GPU). The gather-based verifier is not a backend here: kernels are
  leaves, and :func:`specjax.verify.rejection_sample` (``impl="jnp" | "pallas"``) dispatches to
  this module, never the other way round.
* ``interpret=True`` runs either kernel with the Pallas interpreter (CPU tests); random numbers are
  always inputs (the TPU in-kernel PRNG returns zeros under the interpreter).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.rejection_common import (_accepted, _balanced_tile, _choose, _emit, _nd,
                                             _race_update, _rows_per_block)
from pallas_kernels.rejection_gpu import stats_mosaic_gpu, stats_triton
from specjax.verify_types import VerifyOutput

__all__ = [
    "RejectionTiles",
    "rejection_sample_reference",
    "position_stats_reference",
    "position_stats_pallas",
    "rejection_sample_pallas",
    "default_backend",
    "compiled_backends",
]

@dataclasses.dataclass(frozen=True)
class RejectionTiles:
    """Tile sizes. ``block_v``: vocab tile of the TPU kernel (multiple of 128). ``triton_block_v``:
    vocab tile of the Triton kernel (power of two). ``triton_num_warps`` / ``triton_num_stages``:
    Triton compiler parameters."""

    block_v: int = 2048
    triton_block_v: int = 1024
    triton_num_warps: int = 4
    triton_num_stages: int = 1

    def __post_init__(self):
        if self.block_v <= 0 or self.block_v % 128:
            raise ValueError(f"block_v must be a positive multiple of 128, got {self.block_v}")
        t = self.triton_block_v
        if t <= 0 or t & (t - 1):
            raise ValueError(f"triton_block_v must be a power of two, got {t}")


# ----------------------------------------------------------------------------------------------
# jnp reference


def _race(score):
    """First argmax of ``score`` along the last axis, -1 where no entry is > 0."""
    idx = jnp.argmax(score, axis=-1).astype(jnp.int32)
    best = jnp.max(score, axis=-1)
    return jnp.where(best > 0.0, idx, -1)


def position_stats_reference(draft_tokens, draft_probs, target_probs, exponentials):
    """The kernel's per-position statistics in plain jnp (reads everything; a readable spec).

    Returns ``(pa [B, K+1], qa [B, K], r_idx [B, K], p_idx [B, K+1])`` (see the module docstring).
    """
    bsz, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    p = target_probs.astype(jnp.float32)
    q = draft_probs.astype(jnp.float32)
    r = (1.0 / exponentials.astype(jnp.float32))[:, None, :]
    x = jnp.concatenate([draft_tokens.astype(jnp.int32), jnp.full((bsz, 1), -1, jnp.int32)], axis=1)
    hit = jnp.arange(vocab, dtype=jnp.int32)[None, None, :] == x[:, :, None]
    pa = jnp.sum(jnp.where(hit, p, 0.0), axis=-1)
    qa = jnp.sum(jnp.where(hit[:, :k], q, 0.0), axis=-1)
    r_idx = _race(jnp.maximum(p[:, :k] - q, 0.0) * r)
    p_idx = _race(p * r)
    return pa, qa, r_idx, p_idx


def _epilogue(draft_tokens, uniforms, num_draft, pa, qa, r_idx, p_idx) -> VerifyOutput:
    """Acceptance chain and token choice from the per-position statistics (``[B, K+1]``-sized)."""
    k = draft_tokens.shape[1]
    n = _accepted(draft_tokens, uniforms, num_draft, pa, qa)
    p_pick = jnp.take_along_axis(p_idx, n[:, None], axis=1)[:, 0]
    r_pick = jnp.take_along_axis(r_idx, jnp.minimum(n, k - 1)[:, None], axis=1)[:, 0] if k else None
    return _emit(draft_tokens, n, _choose(n, num_draft, r_pick, p_pick))


@jax.jit
def rejection_sample_reference(
    draft_tokens, draft_probs, target_probs, uniforms, exponentials, num_draft=None
) -> VerifyOutput:
    """jnp reference of the kernel: statistics over all positions, then the epilogue.

    Shapes: ``draft_tokens`` int32 ``[B, K]``, ``draft_probs`` ``[B, K, V]``, ``target_probs``
    ``[B, K+1, V]``, ``uniforms`` ``[B, K]``, ``exponentials`` ``[B, V]``, ``num_draft`` ``[B]``.
    """
    bsz, k = draft_tokens.shape
    stats = position_stats_reference(draft_tokens, draft_probs, target_probs, exponentials)
    return _epilogue(draft_tokens, uniforms, _nd(num_draft, bsz, k), *stats)


# ----------------------------------------------------------------------------------------------
# TPU (Mosaic) kernel: grid (B, vocab tiles)


def _tpu_kernel(*refs, k, vocab, block_v, rows):
    if k:
        x_ref, p_ref, q_ref, e_ref, pa_ref, pidx_ref, qa_ref, ridx_ref, pbest_ref, rbest_ref = refs
    else:
        x_ref, p_ref, e_ref, pa_ref, pidx_ref, pbest_ref = refs
    t = pl.program_id(1)

    @pl.when(t == 0)
    def _init():
        pa_ref[...] = jnp.zeros(pa_ref.shape, jnp.float32)
        pidx_ref[...] = jnp.full(pidx_ref.shape, -1, jnp.int32)
        pbest_ref[...] = jnp.zeros(pbest_ref.shape, jnp.float32)
        if k:
            qa_ref[...] = jnp.zeros(qa_ref.shape, jnp.float32)
            ridx_ref[...] = jnp.full(ridx_ref.shape, -1, jnp.int32)
            rbest_ref[...] = jnp.zeros(rbest_ref.shape, jnp.float32)

    col = t * block_v + jax.lax.broadcasted_iota(jnp.int32, (1, block_v), 1)
    valid = col < vocab
    for i in range(rows):  # the block's batch rows (static: 8, or all B when B % 8 != 0)
        r = jnp.where(valid, 1.0 / e_ref[pl.ds(i, 1), :].astype(jnp.float32), 0.0)  # (1, T)
        p = jnp.where(valid, p_ref[i].astype(jnp.float32), 0.0)  # (K+1, T)
        x = x_ref[i]  # (K+1, 1)
        pa_ref[i] += jnp.sum(jnp.where(col == x, p, 0.0), axis=1, keepdims=True)
        _race_update(p * r, col, pbest_ref, pidx_ref, i)
        if k:
            pk = p[:k]  # (K, T)
            q = jnp.where(valid, q_ref[i].astype(jnp.float32), 0.0)  # (K, T)
            qa_ref[i] += jnp.sum(jnp.where(col == x[:k], q, 0.0), axis=1, keepdims=True)
            _race_update(jnp.maximum(pk - q, 0.0) * r, col, rbest_ref, ridx_ref, i)


def _tpu_cost(bsz, k, padded_vocab, p_dtype, q_dtype, e_dtype):
    """What the TPU kernel moves and computes, for XLA's cost model.

    XLA cannot see inside a Mosaic kernel (without this estimate a compiled program's cost analysis
    leaves the kernel's reads out), so the kernel states its own traffic. It is exact for this
    pipeline: over the grid ``(B, vocab tiles)`` every ``[K+1, block_v]`` block of ``p``,
    ``[K, block_v]`` block of ``q`` and ``[1, block_v]`` block of the noise is fetched once (the vocab
    tail tile is fetched whole, hence ``padded_vocab``), the drafted tokens once per row, and the
    four ``[B, K(+1)]`` statistics written once.
    """
    item = lambda dt: jnp.dtype(dt).itemsize
    reads = bsz * padded_vocab * ((k + 1) * item(p_dtype) + k * item(q_dtype) + item(e_dtype))
    small = bsz * (k + 1) * 4 * 5  # tokens in, four statistics out
    # per element of p: hit test, add, race (mul, compare, select, min); residual race on q the same
    flops = bsz * padded_vocab * (6 * (k + 1) + 7 * k + 1)
    return pl.CostEstimate(flops=int(flops), transcendentals=0, bytes_accessed=int(reads + small))


def _stats_tpu(xp, draft_probs, target_probs, exponentials, tiles: RejectionTiles, interpret):
    from jax.experimental.pallas import tpu as pltpu

    bsz, k1, vocab = target_probs.shape
    k = k1 - 1
    bv = _balanced_tile(vocab, tiles.block_v)
    # Blocks of `rows` batch rows: the noise [B, V] is then tiled (8, block_v), TPU's own tiling, so
    # it is read in place (a one-row block of it is not allowed, and a [B, 1, V] view would have
    # another layout: XLA would copy the whole array to make it).
    rows = _rows_per_block(bsz)
    grid = (bsz // rows, pl.cdiv(vocab, bv))
    col_spec = lambda n: pl.BlockSpec((rows, n, 1), lambda b, t: (b, 0, 0))
    in_specs = [col_spec(k1), pl.BlockSpec((rows, k1, bv), lambda b, t: (b, 0, t))]
    args = [xp[:, :, None], target_probs]
    if k:
        in_specs.append(pl.BlockSpec((rows, k, bv), lambda b, t: (b, 0, t)))
        args.append(draft_probs)
    in_specs.append(pl.BlockSpec((rows, bv), lambda b, t: (b, t)))
    args.append(exponentials)
    out_shape = [
        jax.ShapeDtypeStruct((bsz, k1, 1), jnp.float32),
        jax.ShapeDtypeStruct((bsz, k1, 1), jnp.int32),
    ]
    out_specs = [col_spec(k1), col_spec(k1)]
    scratch = [pltpu.VMEM((rows, k1, 1), jnp.float32)]
    if k:
        out_shape += [jax.ShapeDtypeStruct((bsz, k, 1), jnp.float32), jax.ShapeDtypeStruct((bsz, k, 1), jnp.int32)]
        out_specs += [col_spec(k), col_spec(k)]
        scratch.append(pltpu.VMEM((rows, k, 1), jnp.float32))
    outs = pl.pallas_call(
        functools.partial(_tpu_kernel, k=k, vocab=vocab, block_v=bv, rows=rows),
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="rejection_sampling_stats",
        cost_estimate=_tpu_cost(bsz, k, grid[1] * bv, target_probs.dtype, draft_probs.dtype,
                                exponentials.dtype),
    )(*args)
    outs = [o[..., 0] for o in outs]
    if k:
        pa, p_idx, qa, r_idx = outs
    else:
        (pa, p_idx), qa, r_idx = outs, jnp.zeros((bsz, 0), jnp.float32), jnp.zeros((bsz, 0), jnp.int32)
    return pa, qa, r_idx, p_idx


# ----------------------------------------------------------------------------------------------
# wrapper


def default_backend() -> str:
    """``"mosaic_tpu"`` on TPU, ``"triton"`` on GPU, ``"reference"`` (the kernel's jnp mirror)
    otherwise."""
    platform = jax.default_backend()
    return {"tpu": "mosaic_tpu", "gpu": "triton", "cuda": "triton",
            "rocm": "triton"}.get(platform, "reference")


def compiled_backends(platform: str, vocab: Optional[int] = None) -> list:
    """The Pallas backends that compile to device code on ``platform`` (``jax.default_backend()``
    names: "tpu", "gpu" / "cuda" / "rocm"; none on CPU, where only interpret mode runs). With
    ``vocab``, only those that take that vocabulary (the two-phase kernel needs V % 128 == 0)."""
    if platform == "tpu":
        two_phase = vocab is None or vocab % 128 == 0
        return ["mosaic_tpu"] + (["mosaic_tpu_two_phase"] if two_phase else [])
    if platform in ("gpu", "cuda", "rocm"):
        return ["triton", "mosaic_gpu"]
    return []


def position_stats_pallas(draft_tokens, draft_probs, target_probs, exponentials, *, backend, tiles=None, interpret=False):
    """Per-position statistics ``(pa, qa, r_idx, p_idx)`` from the Pallas kernel of ``backend``."""
    tiles = tiles or RejectionTiles()
    bsz, k = draft_tokens.shape
    xp = jnp.concatenate([draft_tokens.astype(jnp.int32), jnp.full((bsz, 1), -1, jnp.int32)], axis=1)
    if backend == "mosaic_tpu":
        return _stats_tpu(xp, draft_probs, target_probs, exponentials, tiles, interpret)
    if backend == "triton":
        return stats_triton(xp, draft_probs, target_probs, exponentials, tiles, interpret)
    if backend == "mosaic_gpu":
        return stats_mosaic_gpu(xp, draft_probs, target_probs, exponentials, tiles, interpret)
    raise ValueError(f"unknown Pallas backend {backend!r} (want 'mosaic_tpu', 'triton' or 'mosaic_gpu')")


@functools.partial(jax.jit, static_argnames=("backend", "tiles", "interpret"))
def rejection_sample_pallas(
    draft_tokens,
    draft_probs,
    target_probs,
    uniforms,
    exponentials,
    num_draft=None,
    *,
    backend: Optional[str] = "auto",
    tiles: Optional[RejectionTiles] = None,
    interpret: bool = False,
) -> VerifyOutput:
    """Batched rejection sampling; same inputs and result as
    :func:`specjax.verify.rejection_sample_with_noise`.

    Args:
      draft_tokens: int32 ``[B, K]``; draft_probs: ``[B, K, V]``; target_probs: ``[B, K+1, V]``;
      uniforms: float32 ``[B, K]``; exponentials: float32 ``[B, V]``; num_draft: int32 ``[B]``.
      backend: ``"auto"`` (:func:`default_backend`), ``"mosaic_tpu"``, ``"triton"``, ``"mosaic_gpu"``,
        ``"mosaic_tpu_two_phase"`` (``rejection_two_phase.py``: reads one row per batch row; ``V`` a
        multiple of 128) or ``"reference"`` (the kernel's jnp mirror).
      tiles: :class:`RejectionTiles`.
      interpret: run the kernel in the Pallas interpreter (any platform, e.g. CPU tests).
    """
    bsz, k = draft_tokens.shape
    if backend in (None, "auto"):
        backend = default_backend()
    if backend == "reference":
        return rejection_sample_reference(draft_tokens, draft_probs, target_probs, uniforms, exponentials, num_draft)
    if backend == "mosaic_tpu_two_phase":
        from pallas_kernels.rejection_two_phase import rejection_sample_two_phase
        return rejection_sample_two_phase(draft_tokens, draft_probs, target_probs, uniforms, exponentials,
                                          num_draft, block_v=(tiles or RejectionTiles()).block_v,
                                          interpret=interpret)
    stats = position_stats_pallas(
        draft_tokens, draft_probs, target_probs, exponentials, backend=backend, tiles=tiles, interpret=interpret
    )
    return _epilogue(draft_tokens, uniforms, _nd(num_draft, bsz, k), *stats)
