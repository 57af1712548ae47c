"""Matmul FLOPs of a compiled program with every loop's trips counted.

XLA's cost analysis (``compiled.cost_analysis()``) counts the body of a ``while`` loop once,
whatever its trip count. Training steps are full of such loops: gradient accumulation over
microbatches, the chunked vocabulary losses, and on TPU the *windowed einsums* the compiler turns
FSDP matmuls into (the weight shards pass from chip to chip in a loop). So the compiled FLOPs of a
step can fall below its model FLOPs, and say nothing of what remat recomputes.

This module reads the compiled module's HLO text (``compiled.as_text()``) and counts the FLOPs of
every ``convolution`` and ``dot`` (TPU compiles ``dot_general`` to ``convolution``), each times
the number of times its computation runs: 1 in the entry computation, times the trip count of
every enclosing loop. A loop's trip count is read as XLA reads it: from a
``known_trip_count`` annotation, else from the loop's shape ``i = c0; while i < C: i += s`` (the
counter an element of the loop's tuple, its start and step constants). A loop whose trip count
cannot be read this way (a ``lax.while_loop`` on data, such as the engine's device loop) is
counted once and listed in :attr:`LoopFlops.unknown_loops`. The count is also split by the
source line of the JAX code that made each matmul (:attr:`LoopFlops.by_source`, from the module's
stack frames): where a step's FLOPs go, and which a model-FLOPs formula leaves out.

Only matmul FLOPs are counted: elementwise work, reductions and Pallas kernels (custom calls) are
not. For a loop-free program :attr:`LoopFlops.once` is therefore at most the compiler's FLOPs (the
difference is the elementwise work), and :attr:`LoopFlops.extra` (what the loops' further trips
add) is what the compiler's count lacks. ``tests/test_aot_loops.py`` checks the counts against
hand-computed HLO, and ``tests/test_aot_tpu.py`` against TPU compilations.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

from specjax.aot.peak import op_source, split_instruction

__all__ = ["LoopFlops", "Instruction", "parse_hlo", "trip_count", "matmul_flops", "loop_flops"]

_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"\b(?:calls|body|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# Ops that only pass a counter through (the counter may be copied into the loop's tuple).
_PASS_THROUGH = ("copy", "convert", "bitcast", "reshape")


@dataclasses.dataclass
class Instruction:
    """One HLO instruction: its result type text, opcode, operand names and the text after the
    operand list (attributes); ``literal`` is a ``constant``'s value text."""

    name: str
    type: str
    op: str
    operands: list
    attrs: str
    literal: str = ""
    source: str = ""  # "file:line (function)" of the JAX code that made it, "" if unknown

    def shape(self) -> list:
        """Dimensions of the (first) array in the result type."""
        return [int(d) for d in _ARRAY.search(self.type).group(2).split(",") if d]


@dataclasses.dataclass
class LoopFlops:
    """Matmul FLOPs of one program (per device, as the HLO is the per-device program).

    ``total``: every convolution / dot times the runs of its computation. ``once``: the same with
    every loop body counted once (how the compiler's cost analysis counts). ``extra`` = ``total -
    once``. ``loops``: ``(source, trip count, matmul FLOPs of one trip)`` of each loop whose trip
    count was read, costliest (trips x FLOPs) first, where ``source`` is the JAX operation the
    loop came from (its HLO name if the HLO does not say); ``unknown_loops``: HLO names of the
    loops counted once. ``by_source``: ``(source, FLOPs)`` pairs summing to ``total``, largest
    first, where ``source`` is the ``"file:line (function)"`` of the JAX code that made each
    matmul (from the module's stack frames; ``""`` where the HLO has none)."""

    total: float
    once: float
    loops: list
    unknown_loops: list
    by_source: list = dataclasses.field(default_factory=list)

    @property
    def extra(self) -> float:
        return self.total - self.once


def _matching_paren(s: str, i: int) -> int:
    depth = 0
    for j in range(i, len(s)):
        if s[j] == "(":
            depth += 1
        elif s[j] == ")":
            depth -= 1
            if depth == 0:
                return j + 1
    raise ValueError(f"unbalanced parentheses in HLO line: {s[:200]}")


_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def _short_path(path: str) -> str:
    """A source path from its package directory on (``specjax/models/layers.py``), never the
    machine's own directories."""
    for root in ("/specjax/", "/experiments/", "/site-packages/"):
        if root in path:
            tail = path.rsplit(root, 1)[1]
            return tail if root == "/site-packages/" else root.strip("/") + "/" + tail
    return path.rsplit("/", 1)[-1]


def _sources(tables: dict) -> dict:
    """Stack frame id -> ``"file:line (function)"`` from the module's source tables (the
    ``FileNames`` ... ``StackFrames`` sections ``as_text()`` prints; each instruction's
    ``stack_frame_id`` is its innermost frame: the line of JAX code that made it)."""
    files, functions = tables.get("FileNames", {}), tables.get("FunctionNames", {})
    locations = {}
    for i, text in tables.get("FileLocations", {}).items():
        f = dict(kv.split("=", 1) for kv in text.split())
        locations[i] = (f"{_short_path(files.get(f.get('file_name_id'), '?'))}:"
                        f"{f.get('line', '?')} ({functions.get(f.get('function_name_id'), '?')})")
    out = {}
    for i, text in tables.get("StackFrames", {}).items():
        f = dict(kv.split("=", 1) for kv in text.split())
        out[i] = locations.get(f.get("file_location_id"), "")
    return out


def parse_hlo(text: str, *, all_sources: bool = False) -> tuple[dict, str]:
    """``({computation name: [Instruction, ...]}, entry computation name)`` of an HLO module's
    text (``compiled.as_text()``, or a dump's ``*.txt``). ``Instruction.source`` is filled for the
    matmuls (``convolution``, ``dot``), or for every instruction with ``all_sources``."""
    computations, current, entry = {}, None, None
    tables, table = {}, None
    frames = []  # (instruction, stack frame id), resolved once the tables are read
    for line in text.splitlines():
        if current is None and line.strip() in _TABLES:
            table = tables.setdefault(line.strip(), {})
            continue
        if table is not None:
            m = re.match(r"(\d+) (?:\"(.*)\"|\{(.*)\})\s*$", line)
            if m:
                table[m.group(1)] = m.group(2) if m.group(2) is not None else m.group(3)
                continue
            table = None
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = computations.setdefault(m.group(2), [])
                entry = m.group(2) if m.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        parts = split_instruction(line)
        if parts is None:
            continue
        name, type_text, rest = parts
        k = rest.index("(")
        end = _matching_paren(rest, k)
        inside = rest[k + 1:end - 1]
        op = rest[:k]
        current.append(Instruction(
            name=name, type=type_text, op=op,
            operands=re.findall(r"%([\w.\-]+)", inside), attrs=rest[end:],
            literal=inside if op == "constant" else ""))
        frame = re.search(r"\bstack_frame_id=(\d+)", rest[end:])
        if frame and (all_sources or op in ("convolution", "dot")):
            frames.append((current[-1], frame.group(1)))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    sources = _sources(tables)
    for ins, frame in frames:
        ins.source = sources.get(frame, "")
    return computations, entry


def _int_constant(ins: Optional[Instruction], by_name: dict) -> Optional[int]:
    while ins is not None and ins.op in _PASS_THROUGH and ins.operands:
        ins = by_name.get(ins.operands[0])
    if ins is None or ins.op != "constant":
        return None
    try:
        return int(ins.literal)
    except ValueError:
        return None


def _tuple_index(ins: Optional[Instruction], by_name: dict) -> Optional[int]:
    """``i`` when ``ins`` is (a pass-through of) ``get-tuple-element(param), index=i``."""
    while ins is not None and ins.op in _PASS_THROUGH and ins.operands:
        ins = by_name.get(ins.operands[0])
    if ins is None or ins.op != "get-tuple-element":
        return None
    m = re.search(r"\bindex=(\d+)", ins.attrs)
    return int(m.group(1)) if m else None


def trip_count(loop: Instruction, computations: dict, by_name: dict) -> Optional[int]:
    """The trip count of a ``while`` instruction, or ``None`` if it cannot be read."""
    m = _KNOWN_TRIPS.search(loop.attrs)
    if m:
        return int(m.group(1))
    cond = re.search(r"\bcondition=%([\w.\-]+)", loop.attrs)
    body = re.search(r"\bbody=%([\w.\-]+)", loop.attrs)
    if not (cond and body) or len(loop.operands) != 1:
        return None
    cond_ins, body_ins = computations.get(cond.group(1)), computations.get(body.group(1))
    if not cond_ins or not body_ins:
        return None
    compare = cond_ins[-1]
    direction = re.search(r"direction=(\w+)", compare.attrs)
    if compare.op != "compare" or not direction or len(compare.operands) != 2:
        return None
    a, b = (by_name.get(o) for o in compare.operands)
    direction = direction.group(1)
    index, bound = _tuple_index(a, by_name), _int_constant(b, by_name)
    if index is None:  # `C > i` is `i < C`
        index, bound = _tuple_index(b, by_name), _int_constant(a, by_name)
        direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction, direction)
    init_tuple = by_name.get(loop.operands[0])
    root = body_ins[-1]
    if index is None or bound is None or init_tuple is None or init_tuple.op != "tuple" \
            or root.op != "tuple" or index >= len(init_tuple.operands) \
            or index >= len(root.operands):
        return None
    start = _int_constant(by_name.get(init_tuple.operands[index]), by_name)
    update = by_name.get(root.operands[index])
    if start is None or update is None or update.op != "add" or len(update.operands) != 2:
        return None
    x, y = (by_name.get(o) for o in update.operands)
    step = _int_constant(y, by_name) if _tuple_index(x, by_name) == index else \
        _int_constant(x, by_name) if _tuple_index(y, by_name) == index else None
    if not step:
        return None
    span = {"LT": bound - start, "LE": bound - start + 1 if step > 0 else None,
            "GT": start - bound, "GE": start - bound + 1 if step < 0 else None,
            "NE": bound - start}.get(direction)
    if span is None:
        return None
    if direction in ("GT", "GE"):
        step = -step
    if step <= 0 or (direction == "NE" and span % step):
        return None
    return max(0, -(-span // step))


def _window(attrs: str, rank: int) -> dict:
    m = re.search(r"window=\{([^}]*)\}", attrs)
    fields = dict(kv.split("=", 1) for kv in m.group(1).split()) if m else {}

    def field(key, default):
        return fields[key].split("x") if key in fields else [default] * rank
    return {"size": [int(v) for v in field("size", 1)],
            "stride": [int(v) for v in field("stride", 1)],
            "lhs_dilate": [int(v) for v in field("lhs_dilate", 1)],
            "rhs_dilate": [int(v) for v in field("rhs_dilate", 1)],
            "pad": [tuple(int(p) for p in v.split("_")) for v in field("pad", "0_0")]}


def _valid_pairs(in_size, out_size, size, stride, lhs_dilate, rhs_dilate, pad_low) -> int:
    """(output position, kernel tap) pairs of one spatial dimension that read a real input element
    (not padding, not a hole of the input's dilation): the multiply-adds that dimension makes."""
    span = (in_size - 1) * lhs_dilate + 1 if in_size else 0
    count = 0
    for o in range(out_size):
        for k in range(size):
            p = o * stride + k * rhs_dilate - pad_low
            if 0 <= p < span and p % lhs_dilate == 0:
                count += 1
    return count


def matmul_flops(ins: Instruction, by_name: dict) -> float:
    """2 x multiply-adds of a ``dot`` or ``convolution`` (0 for any other instruction)."""
    out = ins.shape()
    if ins.op == "dot":
        lhs = by_name[ins.operands[0]].shape()
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        k = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m else 1
        return 2.0 * math.prod(out) * k
    if ins.op != "convolution":
        return 0.0
    lhs = by_name[ins.operands[0]].shape()
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if labels is None:
        raise ValueError(f"convolution without dim_labels: {ins.name}")
    lhs_labels, _, out_labels = labels.groups()
    groups = re.search(r"feature_group_count=(\d+)", ins.attrs)
    spatial = sorted(ch for ch in out_labels if ch.isdigit())
    w = _window(ins.attrs, len(spatial))
    taps = 1
    for i, ch in enumerate(spatial):
        taps *= _valid_pairs(lhs[lhs_labels.index(ch)], out[out_labels.index(ch)],
                             w["size"][i], w["stride"][i], w["lhs_dilate"][i],
                             w["rhs_dilate"][i], w["pad"][i][0])
    features = lhs[lhs_labels.index("f")] // (int(groups.group(1)) if groups else 1)
    return 2.0 * out[out_labels.index("b")] * out[out_labels.index("f")] * taps * features


def loop_flops(hlo_text: str) -> LoopFlops:
    """:class:`LoopFlops` of an HLO module's text."""
    computations, entry = parse_hlo(hlo_text)
    by_name = {i.name: i for instrs in computations.values() for i in instrs}
    # Call graph: caller -> [(callee, runs per run of the caller)]; a loop's body runs its trip
    # count (1 when unknown), every other callee (fusions, calls) once. A conditional runs one
    # of its branches: it counts as its costliest (`branches`).
    edges: dict[str, list] = {name: [] for name in computations}
    branches: dict[str, list] = {name: [] for name in computations}
    loops, unknown = [], []
    for name, instrs in computations.items():
        for ins in instrs:
            if ins.op == "while":
                trips = trip_count(ins, computations, by_name)
                body = re.search(r"\bbody=%([\w.\-]+)", ins.attrs).group(1)
                edges[name].append((body, trips if trips is not None else 1))
                if trips is None:
                    unknown.append((name, ins.name))
                else:
                    loops.append((op_source(ins.attrs) or ins.name, trips, body))
                continue
            if ins.op == "conditional":
                m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
                names = re.findall(r"%([\w.\-]+)", m.group(1)) if m else \
                    _CALLS.findall(ins.attrs)
                branches[name].append([c for c in names if c in computations])
                continue
            edges[name].extend((c, 1) for c in set(_CALLS.findall(ins.attrs))
                               if c in computations)
    for name in computations:  # branches are callees too, for the traversal (no runs here)
        edges[name].extend((c, None) for group in branches[name] for c in group)
    order, seen = [], set()  # post-order from the entry: callees before their callers
    stack = [(entry, iter(edges[entry]))]
    seen.add(entry)
    while stack:  # iterative: module call graphs can be deep
        node, children = stack[-1]
        for child, _ in children:
            if child not in seen:
                seen.add(child)
                stack.append((child, iter(edges[child])))
                break
        else:
            order.append(node)
            stack.pop()
    # One run of a computation: its own matmuls plus each callee's run times the trips (and the
    # same split by source line).
    full, once, by_source = {}, {}, {}
    for name in order:
        own, src = 0.0, {}
        for ins in computations[name]:
            f = matmul_flops(ins, by_name)
            if f:
                own += f
                src[ins.source] = src.get(ins.source, 0.0) + f
        calls = [(c, trips) for c, trips in edges[name] if trips is not None]
        taken = [max(group, key=full.__getitem__) for group in branches[name] if group]
        full[name] = own + sum(trips * full[c] for c, trips in calls) + sum(full[c] for c in taken)
        once[name] = own + sum(once[c] for c, _ in calls) \
            + sum(max(once[c] for c in group) for group in branches[name] if group)
        for c, trips in calls + [(c, 1) for c in taken]:
            for label, f in by_source[c].items():
                src[label] = src.get(label, 0.0) + trips * f
        by_source[name] = src
    rows = sorted(((n, t, full[b]) for n, t, b in loops if b in full), key=lambda r: -r[1] * r[2])
    sources = sorted(by_source[entry].items(), key=lambda kv: -kv[1])
    return LoopFlops(total=full[entry], once=once[entry], loops=rows,
                     unknown_loops=[loop for comp, loop in unknown if comp in full],
                     by_source=sources)
