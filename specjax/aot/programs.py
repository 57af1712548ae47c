"""The programs specjax runs on a TPU, built from abstract sharded inputs for :func:`compile_report`.

* :func:`train_step` — the trainer's own jitted step (:class:`specjax.training.Trainer`, LM
  pretraining or drafter training with the frozen target sharded by the same logical rules),
  lowered from the trainer's abstract state: nothing is allocated, the target is never loaded.
* :func:`engine_steps` — the serving engine's device steps (draft, flattened verification per
  token bucket, prefill, and the device loop that runs many draft-verify steps in one
  ``lax.while_loop`` under a policy), tensor-parallel: target weights by the logical rules over
  the mesh's ``tensor`` axis, the KV cache ``[L, S, max_len, KVH, Dh]`` over its KV heads.
* :func:`rejection_kernel` — the Pallas rejection sampler (``backend="mosaic_tpu"``) under
  ``shard_map``, rows split over every device.

Each returns :class:`Program` objects; :func:`specjax.aot.compile_report` compiles them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax.aot.chips import fsdp_tile_warning
from specjax.aot.compile import abstract, replicated_like
from specjax.models import ModelConfig, Transformer
from specjax.models import partitioning
from specjax.models.flops import forward_flops_per_token, lm_head_flops_per_row
from specjax.training import sharding as sharding_lib


@dataclasses.dataclass
class Program:
    """One program to compile: ``lower() -> jax.stages.Lowered`` plus what to report with it."""

    name: str
    lower: Callable[[], Any]
    shapes: dict
    model_flops: Optional[float] = None
    notes: dict = dataclasses.field(default_factory=dict)
    loop_multiplier: int = 1
    # elements of an array (the engine's layered KV cache) whose whole copies the report counts
    copy_watch: Optional[int] = None


# ------------------------------------------------------------------------------------------------
# training steps
# ------------------------------------------------------------------------------------------------
def abstract_batch(config: ml_collections.ConfigDict) -> dict:
    """The trainer's batch ``{inputs, targets, loss_mask, positions, segment_ids}`` as structs."""
    b, t = config.data.batch_size, config.data.seq_len
    keys = ["inputs", "targets", "loss_mask", "positions", "segment_ids"]
    if config.task.name == "drafter" and config.task.warm_start_loss:
        keys.append("loss_phase")
    return {k: jax.ShapeDtypeStruct((b, t), jnp.int32) for k in keys}


def train_step(config: ml_collections.ConfigDict, mesh: Mesh) -> Program:
    """The trainer's donated train step for ``config`` on ``mesh`` (see the module docstring)."""
    from specjax.training.trainer import Trainer

    trainer = Trainer(config, mesh=mesh)
    cfg = trainer.config
    batch = abstract_batch(cfg)
    b, t = cfg.data.batch_size, cfg.data.seq_len
    target = trainer.task.target_config if cfg.task.name == "drafter" else \
        trainer.task.model_config
    shapes = {"batch": b, "seq": t, "model": cfg.model.preset, "remat": cfg.train.remat,
              "logits_chunk": cfg.train.logits_chunk, "grad_accum": cfg.train.grad_accum_steps,
              "attention_chunk": cfg.train.attention_chunk}
    name = "train_step"
    if cfg.task.name == "drafter":
        name = f"drafter_step[{cfg.task.drafter}:{cfg.task.loss}]"
        shapes.update(drafter=cfg.task.drafter, loss=cfg.task.loss, gamma=trainer.task.gamma,
                      anchors_per_row=cfg.task.anchors_per_row)
    warning = fsdp_tile_warning(target.hidden_size, mesh.shape.get("fsdp", 1))
    notes = {"warning": warning} if warning else {}
    if trainer.compiler_options:  # config.train.tpu_compiler_options, in the step's jit
        notes["compiler_options"] = dict(trainer.compiler_options)
    return Program(
        name=name, shapes=shapes, model_flops=trainer.model_flops_per_step,
        loop_multiplier=cfg.train.grad_accum_steps, notes=notes,
        lower=lambda: trainer._step.lower(trainer.abstract_state, batch, trainer.abstract_frozen))


# ------------------------------------------------------------------------------------------------
# engine device steps (an adapter over specjax.engine.steps: re-point here when they change)
# ------------------------------------------------------------------------------------------------
VERIFY_ORDERS = ("host", "loop")  # EngineShapes.verify_order


@dataclasses.dataclass(frozen=True)
class EngineShapes:
    """Static shapes of the engine's compiled steps.

    loop_steps: steps per call of the device loop (``EngineConfig.loop_steps``); 0 leaves the
    loop out. loop_policy: the policy compiled into it (any of
    :data:`specjax.scheduling.POLICIES` but "retrospective"; "production" is the largest).
    verify_order: how each ``engine.verify[N=…]`` program writes the new keys/values: "host"
    (the host loop's jitted step: inside the forward, layer by layer) or "loop" (the device
    loop's order: a read-only forward, then all the writes after it; the step without the loop's
    bucket switch around it). The two can compile very differently (docs/TPU.md, "The tenfold
    jump").
    flops_context: the cached positions each query attends to in the programs' model FLOPs
    (default ``max_len // 2``, a half-full cache; the compiled attention reads the window bucket
    that holds the context, so its FLOPs depend on the data).
    """

    num_slots: int = 8
    max_len: int = 512
    gamma: int = 4
    buckets: Sequence[int] = (8, 40)
    prefill_chunk: int = 64
    loop_steps: int = 16
    loop_policy: str = "production"
    verify_order: str = "host"
    flops_context: Optional[int] = None

    def __post_init__(self):
        if self.verify_order not in VERIFY_ORDERS:
            raise ValueError(f"verify_order must be one of {VERIFY_ORDERS}, got "
                             f"{self.verify_order!r}")
        if self.flops_context is not None and not 0 < self.flops_context <= self.max_len:
            raise ValueError(f"flops_context must be in 1..max_len={self.max_len}, got "
                             f"{self.flops_context}")


@dataclasses.dataclass(frozen=True)
class EngineFlops:
    """Model FLOPs of the engine's programs (all slots together), each query attending to
    ``EngineShapes.flops_context`` cached positions: the target's forward over the tokens a
    program feeds, its LM head only where the logits are used, plus the drafter's own counts
    (``propose_flops``, ``prefill_flops``, ``commit_flops`` of :mod:`specjax.drafters`).
    ``None`` where the drafter has no count."""

    draft: Optional[float]
    verify: dict  # bucket N -> FLOPs of verifying N flat tokens (the drafter commits as many)
    prefill: Optional[float]
    context: int  # cached positions each query attends to in these counts

    def loop_step(self, bucket: int) -> Optional[float]:
        """One draft-verify step of the device loop at token bucket ``bucket``."""
        if self.draft is None or self.verify.get(bucket) is None:
            return None
        return self.draft + self.verify[bucket]


def engine_flops(target_config: ModelConfig, drafter, shapes: EngineShapes) -> EngineFlops:
    """The engine programs' model FLOPs (:class:`EngineFlops`) for ``shapes``.

    Per slot, a draft step is the drafter's ``propose``; verifying N tokens runs the target over
    them (the LM head at each: every row's logits are verified) and the drafter's ``commit`` over
    them; a prefill chunk runs the target's blocks over the chunk, its LM head at one position
    (the first new token's) and the drafter's ``prefill``. Padding the programs compute past the
    real tokens (attention over the ``[slots, K+1]`` grid at a small bucket, the drafter's commit
    over every grid row) is not model work and is not counted."""
    s, c, gamma = shapes.num_slots, shapes.prefill_chunk, shapes.gamma
    ctx = shapes.max_len // 2 if shapes.flops_context is None else shapes.flops_context
    head = lm_head_flops_per_row(target_config)
    token = forward_flops_per_token(target_config, ctx)
    propose, prefill, commit = (getattr(drafter, f, None) for f in (
        "propose_flops", "prefill_flops", "commit_flops"))
    return EngineFlops(
        draft=None if propose is None else float(s * propose(ctx, gamma)),
        verify={n: None if commit is None else float(n * token + commit(n, ctx, gamma))
                for n in shapes.buckets},
        prefill=None if prefill is None else float(
            s * c * (token - head) + s * head + prefill(s, c, ctx, gamma)),
        context=ctx)


def _engine_device_fns():
    """The engine's jitted device steps (one place to change when the engine's steps move)."""
    from specjax.engine import steps
    return steps.draft_step, steps.verify_step, steps.prefill_step


def _engine_loop():
    """The engine's device loop: its jitted ``run_loop``, ``LoopSpec`` and state constructor."""
    from specjax.engine import device_loop
    return device_loop.run_loop, device_loop.LoopSpec, device_loop.init_loop_state


def engine_steps(target_config: ModelConfig, task_config: ml_collections.ConfigDict, mesh: Mesh,
                 shapes: EngineShapes = EngineShapes(), *,
                 on_indivisible: str = "replicate") -> list[Program]:
    """Draft, verification (one per bucket) and prefill steps, tensor-parallel over ``mesh``.

    Args:
      target_config: the target's architecture.
      task_config: a drafter task's ``config.task`` (which drafter, γ is taken from ``shapes``).
      mesh: typically ``{"tensor": -1}`` (serving shards weights, not the batch).
      on_indivisible: dimensions not divisible by their mesh axes (e.g. 2 KV heads on a 4-way
        tensor axis) are replicated by default.
    """
    from specjax.drafters import shared_head
    from specjax.drafters.base import Observation, Sampling  # noqa: F401  (pytree types)
    from specjax.engine.steps import DeviceState
    from specjax.models.kv_cache import init_cache
    from specjax.training.drafter_build import build_drafter, logical_axes_of

    draft_fn, verify_fn, prefill_fn = _engine_device_fns()
    s, max_len, gamma = shapes.num_slots, shapes.max_len, shapes.gamma
    rules = dict(on_indivisible=on_indivisible)
    spec = lambda names, shape: NamedSharding(mesh, sharding_lib.logical_to_spec(
        names, shape, mesh, **rules))

    # target: graphdef + abstract state sharded by the logical rules
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(target_config,
                                                                   rngs=nnx.Rngs(params=0))))
    t_axes = logical_axes_of(state)
    t_pure = nnx.to_pure_dict(state)
    t_abs = abstract(t_pure, sharding_lib.tree_shardings(t_pure, t_axes, mesh, **rules))
    # drafter: params by their logical axes; the shared head (frozen) by its own
    drafter, factory = build_drafter(task_config, target_config)
    d_state = nnx.state(nnx.eval_shape(lambda: factory(nnx.Rngs(params=0))))
    d_pure = nnx.to_pure_dict(d_state)
    d_abs = abstract(d_pure, sharding_lib.tree_shardings(d_pure, logical_axes_of(d_state), mesh,
                                                         **rules))
    frozen = None
    if task_config.drafter != "draft_lm":
        head = jax.eval_shape(lambda p: shared_head((graphdef, p)), t_pure)
        frozen = abstract(head, jax.tree.map(
            lambda x, names: spec(names, x.shape), head, head.logical_axes(),
            is_leaf=lambda x: isinstance(x, tuple)))
    # device state: KV cache over KV heads; drafter state and anchors replicated
    cache = jax.eval_shape(lambda: init_cache(target_config, s, max_len))
    kv = spec((None, None, None, "kv_heads", None), cache.k.shape)
    cache = abstract(cache, type(cache)(k=kv, v=kv, lengths=NamedSharding(mesh, PartitionSpec())))
    dstate = replicated_like(jax.eval_shape(lambda: drafter.init_state(s, max_len, gamma)), mesh)
    state_abs = DeviceState(cache=cache, drafter_state=dstate,
                            anchor=replicated_like(jax.ShapeDtypeStruct((s,), jnp.int32), mesh))
    rep = lambda shape, dtype: replicated_like(jax.ShapeDtypeStruct(shape, dtype), mesh)
    keys = replicated_like(jax.eval_shape(lambda: jax.random.split(jax.random.key(0), s)), mesh)
    key = replicated_like(jax.eval_shape(lambda: jax.random.key(0)), mesh)
    sampling = Sampling(temperature=rep((s,), jnp.float32))
    v = target_config.vocab_size

    flops = engine_flops(target_config, drafter, shapes)
    common = {"slots": s, "max_len": max_len, "gamma": gamma, "model": "target",
              "flops_context": flops.context}
    programs = [Program(
        name="engine.draft", shapes=dict(common), model_flops=flops.draft,
        lower=lambda: draft_fn.lower(drafter, d_abs, frozen, dstate, key, sampling, gamma=gamma,
                                     argmax=False))]
    during = shapes.verify_order == "host"
    for bucket in shapes.buckets:
        programs.append(Program(
            name=f"engine.verify[N={bucket}]" if during else f"engine.verify[N={bucket},loop]",
            shapes=dict(common, bucket=bucket, verify_order=shapes.verify_order),
            model_flops=flops.verify[bucket],
            lower=lambda bucket=bucket: verify_fn.lower(
                graphdef, t_abs, drafter, d_abs, frozen, state_abs,
                rep((s, gamma), jnp.int32), rep((s, gamma, v), jnp.float32),
                rep((s,), jnp.int32), keys, sampling, bucket=bucket, gamma=gamma,
                method="rejection", write_during=during)))
    c = shapes.prefill_chunk
    programs.append(Program(
        name=f"engine.prefill[C={c}]", shapes=dict(common, chunk=c),
        model_flops=flops.prefill,
        lower=lambda: prefill_fn.lower(
            graphdef, t_abs, drafter, d_abs, frozen, state_abs, rep((s, c), jnp.int32),
            rep((s,), jnp.int32), rep((s,), jnp.bool_), rep((s,), jnp.int32),
            rep((s,), jnp.bool_), keys, sampling, max_len=max_len, gamma=gamma)))
    if shapes.loop_steps:
        programs.append(_loop_program(shapes, graphdef, t_abs, drafter, d_abs, frozen, state_abs,
                                      sampling, key, rep, mesh, common,
                                      flops.loop_step(max(shapes.buckets))))
    # The slots are replicated over the mesh's data axis (independent engine replicas): no batch
    # constraint may split them (specjax.models.partitioning).
    tp = mesh.shape.get("tensor", 1)  # KV heads split over it, or replicated if indivisible
    kv_elems = math.prod(cache.k.shape) // (tp if target_config.num_kv_heads % tp == 0 else 1)
    for p in programs:
        p.lower = _unconstrained(p.lower)
        p.copy_watch = kv_elems  # one chip's share of the K (or V) cache
    return programs


def _unconstrained(lower: Callable[[], Any]) -> Callable[[], Any]:
    def run():
        with partitioning.unconstrained():
            return lower()
    return run


def _loop_program(shapes: EngineShapes, graphdef, t_abs, drafter, d_abs, frozen, state_abs,
                  sampling, key, rep, mesh, common, step_flops) -> Program:
    """The device loop (``loop_steps`` draft-verify steps per call under ``loop_policy``) on the
    same sharded state as the single steps; its small carry fields are replicated.

    XLA's cost analysis counts a loop body once, so the report's FLOPs and bytes are those of one
    step of the loop (``loop_multiplier`` stays 1: the trip count depends on the data), and its
    model FLOPs ``step_flops`` are one draft-verify step at the largest token bucket."""
    run_loop, loop_spec, init_state = _engine_loop()
    s, gamma = shapes.num_slots, shapes.gamma
    spec = loop_spec(policy=shapes.loop_policy, gamma=gamma, buckets=tuple(shapes.buckets),
                     method="rejection", max_steps=shapes.loop_steps)
    carry = jax.eval_shape(lambda dev: init_state(dev, s, gamma, spec.out_len), state_abs)
    loop_abs = carry._replace(dev=state_abs, **{
        f: replicated_like(getattr(carry, f), mesh) for f in carry._fields if f != "dev"})
    b_max = max(shapes.buckets)
    return Program(
        name=f"engine.loop[{shapes.loop_policy}, {shapes.loop_steps} steps]",
        model_flops=step_flops,
        shapes=dict(common, policy=shapes.loop_policy, loop_steps=shapes.loop_steps,
                    buckets=list(shapes.buckets)),
        lower=lambda: run_loop.lower(
            graphdef, t_abs, drafter, d_abs, frozen, loop_abs, sampling, rep((s,), jnp.uint32),
            rep((s, 2), jnp.int32), rep((b_max + 1,), jnp.float32),
            rep((b_max + 1,), jnp.float32), rep((), jnp.float32), key, rep((), jnp.bool_),
            spec=spec))


# ------------------------------------------------------------------------------------------------
# the Pallas rejection sampler
# ------------------------------------------------------------------------------------------------
def rejection_kernel(mesh: Mesh, *, batch: int, gamma: int, vocab: int,
                     backend: str = "mosaic_tpu", tiles=None, row_major: bool = True) -> Program:
    """``rejection_sample_pallas`` with rows split over every mesh device by ``shard_map``.

    ``notes["pq_bytes"]`` is one read of this device's ``p`` and ``q`` (what a verifier that looks
    at every probability must read), to compare with the compiled ``bytes_accessed``.

    ``row_major``: the inputs arrive in row-major layout, as the kernel reads them. Inside a
    program (the engine's verification step) the producers of ``p`` and ``q`` write whatever layout
    their consumer asks for; only a jit *parameter* has a fixed default layout, and TPU's default
    for ``[B, K+1, V]`` with ``K + 1`` not a multiple of 8 puts ``K + 1`` outermost, which would add
    a copy of ``p`` that the step itself does not have. ``False`` measures that default.
    """
    from pallas_kernels.rejection_sampling import rejection_sample_pallas

    axes = tuple(mesh.axis_names)
    n = mesh.devices.size
    if batch % n:
        raise ValueError(f"batch {batch} must be a multiple of the {n} devices")
    rows = NamedSharding(mesh, PartitionSpec(axes))
    st = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rows)
    args = (st((batch, gamma), jnp.int32), st((batch, gamma, vocab), jnp.float32),
            st((batch, gamma + 1, vocab), jnp.float32), st((batch, gamma), jnp.float32),
            st((batch, vocab), jnp.float32), st((batch,), jnp.int32))

    def per_shard(*a):
        out = rejection_sample_pallas(*a, backend=backend, tiles=tiles)
        return out.tokens, out.num_accepted

    in_shardings = None
    if row_major:
        from jax.experimental.layout import Format, Layout
        in_shardings = tuple(Format(Layout(major_to_minor=tuple(range(len(a.shape)))), rows)
                             for a in args)
    fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(PartitionSpec(axes),) * 6,
                               out_specs=(PartitionSpec(axes), PartitionSpec(axes)),
                               check_vma=False), in_shardings=in_shardings)
    pq = (batch // n) * (2 * gamma + 1) * vocab * 4
    return Program(name=f"rejection[{backend}]",
                   shapes={"batch": batch, "gamma": gamma, "vocab": vocab,
                           "row_major": row_major},
                   notes={"pq_bytes": pq}, lower=lambda: fn.lower(*args))
