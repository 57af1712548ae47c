"""pallas_kernels.rejection_sampling: the kernels (run by the Pallas interpreter on CPU) return the same
tokens as the jnp verifier for the same random inputs, and they lower for TPU (Mosaic), GPU (Triton)
and GPU (Mosaic GPU) without the hardware.

What "lowers" checks: Pallas -> Mosaic TPU MLIR / Triton IR / Mosaic GPU MLIR with each backend's own
lowering rules (block-shape rules, supported primitives, TMA constraints), embedded in the
``tpu_custom_call`` / ``__gpu$xla.gpu.triton`` / ``mosaic_gpu`` custom call. Compiling that to device
code needs libtpu or CUDA and is not exercised here.
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:
    from pallas_kernels import rejection_sampling as RS
except ImportError:  # plain `pytest` without the repository root on sys.path (an older editable install)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pallas_kernels import rejection_sampling as RS
from specjax import verify as V


def softmax(z):
    z = np.exp(z - z.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def make_inputs(seed, b, k, vocab):
    """Inputs that exercise every branch: rejections at each position, p == q rows (all accepted,
    zero residual), rows whose residual is exactly zero although they reject (fallback to p), q(x) = 0
    drafts, mixed num_draft including 0 and K, and mass in the vocab tail."""
    rng = np.random.default_rng(seed)

    p = softmax(3 * rng.normal(size=(b, k + 1, vocab))).astype(np.float32)
    q = softmax(3 * rng.normal(size=(b, k, vocab))).astype(np.float32)
    q = (0.6 * p[:, :k] + 0.4 * q).astype(np.float32)
    x = np.argmax(q + rng.gumbel(size=q.shape) * 0.05, -1).astype(np.int32)
    if b > 1 and k:
        q[1] = p[1, :k]  # p == q
    if b > 2 and k:
        p[2, :k] = q[2] * np.float32(0.9)  # rejects, residual exactly 0 -> fallback to p
    if b > 3 and k:
        x[3, 0] = vocab - 1
        q[3, 0, vocab - 1] = 0.0  # q(x) = 0 -> reject
        p[3, 0, vocab - 1] = 0.5  # a residual entry in the last, partial tile
    u = rng.random((b, k), dtype=np.float32)
    if b > 2 and k:
        u[2, 0] = 0.95  # u * q >= 0.9 q: row 2 rejects at 0 with an all-zero residual
    e = np.maximum(rng.exponential(size=(b, vocab)), 1e-30).astype(np.float32)
    nd = rng.integers(0, k + 1, b).astype(np.int32)
    nd[0] = 0
    if b > 1:
        nd[1:4] = k
    return tuple(jnp.asarray(a) for a in (x, q, p, u, e, nd))


def assert_same(a, b, msg=""):
    np.testing.assert_array_equal(np.asarray(a.num_accepted), np.asarray(b.num_accepted), err_msg=msg)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens), err_msg=msg)


SHAPES = [(6, 3, 130), (5, 2, 8193), (2, 0, 300)]


@pytest.mark.parametrize("b,k,vocab", SHAPES + [(2, 2, 151936)])
def test_reference_matches_verify(b, k, vocab):
    args = make_inputs(b * 1000 + vocab, b, k, vocab)
    ref = RS.rejection_sample_reference(*args)
    assert_same(ref, V.rejection_sample_with_noise(*args))
    if k:
        assert (np.asarray(ref.num_accepted) <= np.asarray(args[-1])).all()
        assert int(ref.num_accepted[1]) == k  # p == q row accepts everything
        if b > 3:
            assert int(ref.num_accepted[2]) == 0 and float(args[2][2, 0, int(ref.tokens[2, 0])]) > 0  # fallback to p
            assert int(ref.num_accepted[3]) == 0  # q(x) = 0 rejects
    assert_same(RS.rejection_sample_pallas(*args, backend="auto"), ref)  # CPU -> the jnp verifier
    assert_same(RS.rejection_sample_pallas(*args, backend="reference"), ref)


@pytest.mark.parametrize("backend", ["mosaic_tpu", "triton", "mosaic_gpu"])
@pytest.mark.parametrize("b,k,vocab", SHAPES)
def test_kernel_interpret_matches_jnp(backend, b, k, vocab):
    args = make_inputs(b * 1000 + vocab, b, k, vocab)
    got = RS.rejection_sample_pallas(*args, backend=backend, interpret=True)
    assert_same(got, V.rejection_sample_with_noise(*args), msg=backend)


@pytest.mark.parametrize("backend", ["mosaic_tpu", "triton"])
def test_kernel_interpret_large_vocab(backend):
    b, k, vocab = 2, 2, 151936
    args = make_inputs(7, b, k, vocab)
    tiles = RS.RejectionTiles(block_v=8192, triton_block_v=8192)
    got = RS.rejection_sample_pallas(*args, backend=backend, interpret=True, tiles=tiles)
    assert_same(got, V.rejection_sample_with_noise(*args), msg=backend)


@pytest.mark.parametrize("b,k,vocab,block_v", [
    (6, 3, 256, 128),     # B % 8 != 0: one block of all rows; two vocabulary tiles
    (16, 7, 1280, 512),   # two row blocks; three tiles, the last one 256 lanes
    (5, 2, 8192, 2048),
    (2, 0, 384, 2048),    # no drafts: the bonus race alone
])
def test_two_phase_interpret_matches_jnp(b, k, vocab, block_v):
    from pallas_kernels.rejection_two_phase import rejection_sample_two_phase
    args = make_inputs(b * 1000 + vocab, b, k, vocab)
    want = V.rejection_sample_with_noise(*args)
    assert_same(rejection_sample_two_phase(*args, block_v=block_v, interpret=True), want)
    if k:  # through the dispatcher, with the default tile
        got = RS.rejection_sample_pallas(*args, backend="mosaic_tpu_two_phase", interpret=True)
        assert_same(got, want)



def test_two_phase_first_token_is_distributed_as_the_target():
    """Lossless, by chi-square at the 1e-6 level: 4,096 rows of drafts x ~ q through the two-phase
    kernel (interpret mode); the first emitted token must follow p_0 whatever q is. Every token
    also equals the jnp verifier's for the same random inputs."""
    from stats import chisquare_gof, counts_of

    from pallas_kernels.rejection_two_phase import rejection_sample_two_phase
    b, k, vocab = 4096, 2, 256
    rng = np.random.default_rng(20_261_206)

    p0 = softmax(2.0 * rng.normal(size=(k + 1, vocab))).astype(np.float32)
    q0 = softmax(2.0 * rng.normal(size=(k, vocab))).astype(np.float32)
    p = jnp.asarray(np.broadcast_to(p0, (b, k + 1, vocab)))
    q = jnp.asarray(np.broadcast_to(q0, (b, k, vocab)))
    kx, ku, ke = jax.random.split(jax.random.key(20_261_206), 3)
    x = jax.random.categorical(kx, jnp.log(q), axis=-1).astype(jnp.int32)
    u = jax.random.uniform(ku, (b, k))
    e = jnp.maximum(jax.random.exponential(ke, (b, vocab)), 1e-30)
    out = rejection_sample_two_phase(x, q, p, u, e, None, block_v=128, interpret=True)
    assert_same(out, V.rejection_sample_with_noise(x, q, p, u, e))
    chisquare_gof(counts_of(np.asarray(out.tokens)[:, 0], vocab), p0[0].astype(np.float64),
                  label="two-phase first token vs p_0")

def test_two_phase_refuses_a_vocabulary_it_cannot_tile():
    from pallas_kernels.rejection_two_phase import rejection_sample_two_phase
    args = make_inputs(3, 2, 2, 130)
    with pytest.raises(ValueError, match="multiple of 128"):
        rejection_sample_two_phase(*args, interpret=True)


ACCELERATOR_BACKENDS = RS.compiled_backends(jax.default_backend())


@pytest.mark.skipif(not ACCELERATOR_BACKENDS, reason="compiled Pallas kernels need a GPU or TPU "
                    "(benchmarks/device_check.sh runs this test there)")
@pytest.mark.parametrize("backend", ACCELERATOR_BACKENDS or ["none"])
def test_kernel_on_accelerator_matches_jnp(backend):
    """The compiled kernel (not interpret mode) picks the jnp verifier's tokens, bit for bit."""
    for b, k, vocab in SHAPES + [(8, 4, 151936), (64, 8, 32000)]:
        if backend not in RS.compiled_backends(jax.default_backend(), vocab):
            continue  # the two-phase kernel refuses such vocabularies (test above)
        args = make_inputs(b * 1000 + vocab + 1, b, k, vocab)
        got = RS.rejection_sample_pallas(*args, backend=backend)
        assert_same(got, V.rejection_sample_with_noise(*args), msg=f"{backend} {b, k, vocab}")


def test_kernel_stats_match_reference_and_tiles():
    b, k, vocab = 3, 2, 1000
    x, q, p, u, e, nd = make_inputs(11, b, k, vocab)
    ref = RS.position_stats_reference(x, q, p, e)
    for tiles in (RS.RejectionTiles(block_v=384),):  # 1000 = 2 * 384 + a 232-wide masked tail
        got = RS.position_stats_pallas(x, q, p, e, backend="mosaic_tpu", tiles=tiles, interpret=True)
        for g, r in zip(got, ref):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
    with pytest.raises(ValueError):
        RS.RejectionTiles(block_v=100)
    with pytest.raises(ValueError):
        RS.RejectionTiles(triton_block_v=1000)
    assert RS.default_backend() == "reference"


def _abstract(b, k, vocab, dtype=jnp.float32):
    s = jax.ShapeDtypeStruct
    return (s((b, k), jnp.int32), s((b, k, vocab), dtype), s((b, k + 1, vocab), dtype), s((b, k), jnp.float32),
            s((b, vocab), jnp.float32), s((b,), jnp.int32))


LOWERINGS = {
    "mosaic_tpu": ("tpu", "tpu_custom_call"),
    "triton": ("cuda", "__gpu$xla.gpu.triton"),
    "mosaic_gpu": ("cuda", "mosaic_gpu"),
}


def _lowered_text(backend, args):
    """The kernel lowered for its platform. GPU lowerings name their target, an H100, through an
    abstract mesh: from jax 0.11 the Triton lowering asks the default device (a CPU here) for its
    compute capability unless one is given."""
    platform, _ = LOWERINGS[backend]
    lower = lambda: RS.rejection_sample_pallas.trace(*args, backend=backend).lower(  # noqa: E731
        lowering_platforms=(platform,)).as_text()
    if platform != "cuda":
        return lower()
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)):
        return lower()


# The Mosaic GPU ``pl.pallas_call`` deprecation is an error here: jax 0.10 warns when it lowers one,
# and jax 0.11 no longer lowers it. (jax 0.11 also deprecates the Triton
# backend, which still lowers.)
NO_MGPU_PALLAS_CALL = pytest.mark.filterwarnings("error:Using ``pl.pallas_call`` for Mosaic GPU:DeprecationWarning")


@NO_MGPU_PALLAS_CALL
@pytest.mark.parametrize("backend", list(LOWERINGS))
@pytest.mark.parametrize("b,k,vocab", [(8, 4, 151936), (4, 0, 8193), (3, 7, 8193)])
def test_lowering(backend, b, k, vocab):
    marker = LOWERINGS[backend][1]
    text = _lowered_text(backend, _abstract(b, k, vocab))
    assert marker in text, f"{backend}: no {marker} custom call in the lowered module"


@NO_MGPU_PALLAS_CALL
@pytest.mark.parametrize("backend", list(LOWERINGS))
def test_lowering_bf16_inputs(backend):
    assert LOWERINGS[backend][1] in _lowered_text(backend, _abstract(2, 3, 32000, jnp.bfloat16))
