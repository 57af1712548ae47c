"""Device mesh and the one table of logical-axis rules.

Every parameter carries ``logical_axes`` metadata (one name per dimension, see
:mod:`specjax.models.layers`). :data:`LOGICAL_AXIS_RULES` maps each name to mesh axes (MaxText
style); :func:`logical_to_spec` turns one parameter's names into a ``PartitionSpec`` and
:func:`tree_shardings` does it for a whole state pytree.

Mesh axes (all ``AxisType.Auto``: the compiler propagates shardings; ``jax.make_mesh`` would default
to ``Explicit`` axes, which change jit semantics and which we do not want):

* ``data``   — pure data parallelism: parameters replicated, batch split.
* ``fsdp``   — batch split *and* parameters sharded along their ``embed`` dimension (ZeRO-3 style;
  XLA all-gathers a weight just before it is used).
* ``tensor`` — Megatron-style model parallelism over vocab / heads / mlp.

Divisibility: a dimension of size ``n`` mapped to mesh axes of total size ``m`` must satisfy
``n % m == 0``. With ``on_indivisible="error"`` (the default) a violation raises a
:class:`ShardingError` naming the parameter, its dimension and the mesh axes; with
``"replicate"`` that one dimension silently falls back to replication (e.g. 2 kv heads on a
4-way tensor axis), which is always correct, only less memory-efficient.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence, Union

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from specjax.models.partitioning import BATCH_MESH_AXES

MESH_AXES = ("data", "fsdp", "tensor")

# THE table. Each logical name maps to one mesh axis, a tuple of mesh axes (sharded over their
# product, major to minor), or None (replicated). Names absent from the table are replicated.
LOGICAL_AXIS_RULES: dict[str, Union[None, str, tuple[str, ...]]] = {
    # activations / data
    "batch": BATCH_MESH_AXES,  # ("data", "fsdp"); the models pin activations to it
    "length": None,
    # parameters
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "norm": None,
}

ON_INDIVISIBLE = ("error", "replicate")


class ShardingError(ValueError):
    """A mesh that does not fit the devices, or a dimension not divisible by its mesh axes."""


def resolve_mesh_shape(mesh_shape: Mapping[str, int], num_devices: int) -> tuple[int, int, int]:
    """Resolves a ``{data, fsdp, tensor}`` mapping (one entry may be -1 = "the rest").

    Raises:
      ShardingError naming the field (``mesh.<axis>``) when an entry is invalid or the product
      does not equal ``num_devices``.
    """
    sizes = []
    for axis in MESH_AXES:
        size = mesh_shape.get(axis, 1)
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ShardingError(f"config.mesh.{axis} must be a positive int or -1, got {size!r}")
        sizes.append(size)
    unknown = set(mesh_shape) - set(MESH_AXES)
    if unknown:
        raise ShardingError(f"config.mesh has unknown axes {sorted(unknown)}; known: {MESH_AXES}")
    fill = [a for a, s in zip(MESH_AXES, sizes) if s == -1]
    if len(fill) > 1:
        raise ShardingError(f"config.mesh: at most one axis may be -1, got {fill}")
    fixed = math.prod(s for s in sizes if s != -1)
    if fill:
        if num_devices % fixed:
            raise ShardingError(
                f"config.mesh: the fixed axes multiply to {fixed}, which does not divide the "
                f"{num_devices} devices, so config.mesh.{fill[0]}=-1 cannot be filled")
        sizes[MESH_AXES.index(fill[0])] = num_devices // fixed
    elif fixed != num_devices:
        desc = " x ".join(f"{a}={s}" for a, s in zip(MESH_AXES, sizes))
        raise ShardingError(
            f"config.mesh: {desc} = {fixed} devices, but {num_devices} are available "
            f"({'does not divide' if num_devices % fixed else 'uses only part of'} them); "
            f"set one axis to -1 to fill the rest")
    return tuple(sizes)


def make_mesh(mesh_shape: Mapping[str, int], devices: Optional[Sequence[Any]] = None) -> Mesh:
    """Builds the ``(data, fsdp, tensor)`` mesh over all (global) devices, all axes ``Auto``.

    Args:
      mesh_shape: ``{"data": d, "fsdp": f, "tensor": t}``; one entry may be -1.
      devices: defaults to ``jax.devices()`` (all processes' devices in a multi-host run).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(mesh_shape, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


def _mesh_axes_of(name: Optional[str], rules: Mapping[str, Any]) -> tuple[str, ...]:
    if name is None:
        return ()
    target = rules.get(name)
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def logical_to_spec(logical_axes: Sequence[Optional[str]], shape: Sequence[int], mesh: Mesh, *,
                    rules: Mapping[str, Any] = LOGICAL_AXIS_RULES,
                    on_indivisible: str = "error", name: str = "<array>") -> PartitionSpec:
    """One array's logical names -> ``PartitionSpec`` under ``rules`` on ``mesh``.

    Mesh axes of size 1 are dropped (they shard nothing). A mesh axis already used by an earlier
    dimension is not reused (a spec may name each mesh axis once); that dimension is replicated.

    Raises:
      ShardingError when ``len(logical_axes) != len(shape)``, or (``on_indivisible="error"``) a
      dimension is not divisible by the product of its mesh axes; the message names ``name``.
    """
    if on_indivisible not in ON_INDIVISIBLE:
        raise ShardingError(f"on_indivisible must be one of {ON_INDIVISIBLE}, got {on_indivisible!r}")
    if len(logical_axes) != len(shape):
        raise ShardingError(f"{name}: logical axes {tuple(logical_axes)} do not match its shape "
                            f"{tuple(shape)}")
    used: set[str] = set()
    spec = []
    for dim, (logical, size) in enumerate(zip(logical_axes, shape)):
        axes = tuple(a for a in _mesh_axes_of(logical, rules)
                     if mesh.shape[a] > 1 and a not in used)
        total = math.prod(mesh.shape[a] for a in axes)
        if axes and size % total:
            if on_indivisible == "error":
                raise ShardingError(
                    f"{name}: dimension {dim} ({logical!r}, size {size}) is not divisible by mesh "
                    f"axes {axes} of total size {total}; change config.mesh, or set "
                    f"config.sharding.on_indivisible='replicate'")
            axes = ()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while spec and spec[-1] is None:  # canonical form: P('fsdp') rather than P('fsdp', None)
        spec.pop()
    return PartitionSpec(*spec)


def _is_axes_leaf(x: Any) -> bool:
    return x is None or (isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x))


def tree_shardings(abstract_tree: Any, axes_tree: Any, mesh: Mesh, *,
                   rules: Mapping[str, Any] = LOGICAL_AXIS_RULES,
                   on_indivisible: str = "error") -> Any:
    """``NamedSharding`` for every array leaf of a state pytree.

    Args:
      abstract_tree: pytree of arrays or ``jax.ShapeDtypeStruct`` (e.g. from ``jax.eval_shape``).
      axes_tree: same structure, each leaf a tuple of logical names (one per dimension) or
        ``None`` (fully replicated: scalars, RNG keys, step counters).
      mesh: the device mesh.
    Returns:
      Pytree of ``NamedSharding`` with the structure of ``abstract_tree``.
    """
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_tree)
    # Tuples of names are leaves here, not pytree nodes.
    axes_leaves, axes_def = jax.tree_util.tree_flatten(axes_tree, is_leaf=_is_axes_leaf)
    if axes_def != treedef:
        raise ShardingError(f"the logical-axes tree does not match the state's structure:\n"
                            f"  axes:  {axes_def}\n  state: {treedef}")
    out = []
    for (path, leaf), axes in zip(paths_and_leaves, axes_leaves):
        name = jax.tree_util.keystr(path)
        shape = getattr(leaf, "shape", ())
        spec = PartitionSpec() if axes is None else logical_to_spec(
            axes, shape, mesh, rules=rules, on_indivisible=on_indivisible, name=name)
        out.append(NamedSharding(mesh, spec))
    return treedef.unflatten(out)


def batch_sharding(mesh: Mesh, ndim: int = 2,
                   rules: Mapping[str, Any] = LOGICAL_AXIS_RULES) -> NamedSharding:
    """Sharding of a ``[batch, ...]`` input array: rows split over the ``batch`` rule's axes."""
    axes = tuple(a for a in _mesh_axes_of("batch", rules) if mesh.shape[a] > 1)
    first = None if not axes else axes[0] if len(axes) == 1 else axes
    return NamedSharding(mesh, PartitionSpec(first, *([None] * (ndim - 1))))


def batch_shards(mesh: Mesh, rules: Mapping[str, Any] = LOGICAL_AXIS_RULES) -> int:
    """Number of ways the batch dimension is split (global batch must be a multiple of it)."""
    return math.prod(mesh.shape[a] for a in _mesh_axes_of("batch", rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
