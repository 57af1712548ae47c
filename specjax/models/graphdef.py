"""A graphdef that is hashed once: for graphdefs passed to ``jax.jit`` as static arguments.

``jax.jit`` hashes every static argument on every call to find its compiled program. An
``nnx.GraphDef`` hashes its whole node list each time: about 80 µs for a 2-layer model, growing
with the layers, paid by every jitted call that takes the target's graphdef (each step of the host
loop, each call of the device loop, ``generate()``'s host decoder) and again by every call that
takes a drafter, whose hash includes its graphdef. :func:`hash_once` returns an equal graphdef
whose hash is computed on first use and kept, so a call hashes it in nanoseconds.

A :class:`HashedGraphDef` equals, and hashes like, the plain graphdef it was made from. ``jax.jit``
keys its cache on the static argument's type as well, so a function called with both kinds traces
twice: wrap a graphdef once where it enters (the engine, ``generate()``, the drafters do) and pass
that one on.
"""
from __future__ import annotations

import jax
from flax import nnx


class HashedGraphDef(nnx.GraphDef):
    """An ``nnx.GraphDef`` (same fields, same meaning for ``nnx.merge``) that keeps its hash."""

    __slots__ = ("_hash",)

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            h = nnx.GraphDef.__hash__(self)
            object.__setattr__(self, "_hash", h)  # GraphDef is a frozen dataclass
            return h

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, nnx.GraphDef):
            return NotImplemented
        return (self.nodes, self.attributes, self.num_leaves) == (
            other.nodes, other.attributes, other.num_leaves)


# A static pytree node like GraphDef itself (a graphdef inside a pytree is structure, not data).
jax.tree_util.register_static(HashedGraphDef)


def hash_once(graphdef):
    """``graphdef`` as a :class:`HashedGraphDef` (itself if it is one already; anything that is not
    an ``nnx.GraphDef`` is returned unchanged)."""
    if isinstance(graphdef, HashedGraphDef) or not isinstance(graphdef, nnx.GraphDef):
        return graphdef
    return HashedGraphDef(graphdef.nodes, graphdef.attributes, graphdef.num_leaves)


class GraphDefHolder:
    """Base of the frozen dataclasses that hold a ``graphdef`` field and are themselves static
    ``jax.jit`` arguments (the drafters: a drafter's hash includes its graphdef's): wraps the
    field with :func:`hash_once` when the dataclass is built."""

    def __post_init__(self):
        object.__setattr__(self, "graphdef", hash_once(self.graphdef))  # frozen dataclass
