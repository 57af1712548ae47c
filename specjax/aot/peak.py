"""What is alive at a compiled program's memory peak, read from XLA's dump of the compilation.

``compiled.memory_analysis()`` gives a program's totals (arguments, temporaries) but not what they
are. XLA's dump of a compilation (``xla_dump_to``) holds the rest: its ``*live-range.txt`` lists
every value alive at the peak of the buffer assignment with its size (section ``Live ranges at N
(peak):``), and ``*after_optimizations.txt`` is the optimized HLO module in which those values are
defined, with their shapes and the JAX operation each came from (``metadata={op_name=...}``;
parameters carry their argument's pytree path there).

:func:`peak_breakdown` joins the two and groups the peak's values by where they come from, so
that a step that does not fit says what fills the chip: e.g. "72 x ``AllocateBuffer``
``bf16[1,4096,12288]`` (6.75 GiB)". ``compile_report(..., explain_memory=True)``
(:mod:`specjax.aot.compile`) dumps the compilation to a temporary directory and puts the result
in ``notes["peak_live"]``; ``python -m experiments.tpu_plan --explain_memory`` prints it.

Values that are tuple elements (``while.12{3}``) are attributed to the element's shape; values the
HLO text does not define (rare: a name only the buffer assignment knows) are grouped as
``"<unknown>"``, so the groups always sum to the peak the file states.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Optional

_PEAK_HEADER = re.compile(r"^\s*Live ranges at (\d+) \(peak\):\s*$")
_LENGTH = re.compile(r"^HloLiveRange \(max (\d+)\):")
_RANGE = re.compile(r"^\s+(\S+?\{[\d,]*\}):(\d+)-(\d+)\s*$")
_PEAK_VALUE = re.compile(r"^\s+(\S+?)\{([\d,]*)\}: (\d+) bytes \(cumulative: \d+ bytes\)\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)$")
_ARRAY_SHAPE = re.compile(r"\b(pred|[a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_LAYOUT = re.compile(r"\{[^{}]*\}")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OPCODE = re.compile(r"^\s*([a-z][\w-]*)\(")
# Scopes every op of a jitted step carries; they say nothing about which op it is.
_SCOPE = re.compile(r"^(?:jit\([^)]*\)/)?(?:while/body/)?(?:closed_call/)?")


def _split_type(rest: str) -> tuple[str, str]:
    """``(type, remainder)`` of an instruction's right-hand side (the type may be a tuple)."""
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[:i + 1], rest[i + 1:]
    return rest, ""


def _element_shape(type_text: str, index: str) -> str:
    """The array shape of tuple element ``index`` ("" for the value itself), as ``bf16[1,2]``."""
    shapes = [f"{d}[{s}]" for d, s in _ARRAY_SHAPE.findall(_LAYOUT.sub("", type_text))]
    if not shapes:
        return type_text
    if index == "" or not type_text.startswith("("):
        return shapes[0]
    i = int(index.split(",")[0])  # nested tuples are rare: their first level is enough here
    return shapes[i] if i < len(shapes) else type_text


def split_instruction(line: str) -> Optional[tuple[str, str, str]]:
    """``(name, type text, remainder)`` of an HLO instruction line (``%n = TYPE op(...), ...``;
    the remainder starts at the opcode), or ``None`` for any other line. Shared with
    :mod:`specjax.aot.hlo_loops`."""
    m = _INSTRUCTION.match(line)
    if not m:
        return None
    type_text, rest = _split_type(m.group(2))
    return m.group(1), type_text, rest.lstrip()


def _definitions(hlo_text: str) -> dict[str, tuple[str, str]]:
    """HLO instruction name -> ``(type text, label)`` for every instruction of a module's text."""
    out = {}
    for line in hlo_text.splitlines():
        parts = split_instruction(line)
        if parts is None:
            continue
        name, type_text, rest = parts
        target = _TARGET.search(rest)
        opcode = _OPCODE.match(rest)
        op = target.group(1) if target else (opcode.group(1) if opcode else "?")
        out[name] = (type_text, f"{op} {op_source(rest)}".strip())
    return out


def op_source(attrs: str) -> str:
    """The JAX operation an HLO instruction came from (its ``metadata={op_name=...}``, without the
    scopes every op of a jitted step carries), or ``""``."""
    name = _OP_NAME.search(attrs)
    return _SCOPE.sub("", name.group(1).replace("\\'", "'")) if name else ""


def parse_ranges(live_range_text: str) -> tuple[Optional[int], dict[str, tuple[int, int]]]:
    """``(program length, {"value{index}": (start, end)})``: each value's live range, in
    positions of the instruction sequence (the ``BufferLiveRange`` section)."""
    length, ranges = None, {}
    for line in live_range_text.splitlines():
        m = _LENGTH.match(line)
        if m:
            length = int(m.group(1))
            continue
        m = _RANGE.match(line)
        if m:
            ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return length, ranges


def parse_peak(live_range_text: str) -> tuple[Optional[int], list[tuple[str, str, int]]]:
    """``(peak position, [(value name, tuple index, bytes), ...])`` of a live-range dump."""
    position, values, inside = None, [], False
    for line in live_range_text.splitlines():
        header = _PEAK_HEADER.match(line)
        if header:
            position, inside = int(header.group(1)), True
            continue
        if inside:
            m = _PEAK_VALUE.match(line)
            if not m:
                break
            values.append((m.group(1), m.group(2), int(m.group(3))))
    return position, values


def _span(ranges: list) -> dict:
    """Earliest / latest start and end of ``[(start, end), ...]`` (``None`` when empty)."""
    if not ranges:
        return {"first_start": None, "last_start": None, "first_end": None, "last_end": None}
    starts, ends = [r[0] for r in ranges], [r[1] for r in ranges]
    return {"first_start": min(starts), "last_start": max(starts),
            "first_end": min(ends), "last_end": max(ends)}


def breakdown(live_range_text: str, hlo_text: str, *, top: int = 12) -> Optional[dict]:
    """Groups the values alive at the peak by ``(label, shape)``.

    Returns ``None`` when the live-range text has no peak section, else::

        {"peak_bytes": int, "values": int, "peak_position": int, "program_length": int | None,
         "groups": [{"label": str, "shape": str, "count": int, "bytes": int,
                     "first_start": int | None, "last_start": int | None,
                     "first_end": int | None, "last_end": int | None}, ...]}

    Positions count instructions of the scheduled program (``0 .. program_length``); a group's
    starts and ends are the earliest and latest of its values' live ranges: a group whose values
    all start long before ``peak_position`` and end long after it was allocated long before use.
    ``groups`` is sorted by bytes (largest first) and cut to ``top`` entries plus one ``"other"``
    entry for the rest, so ``sum(bytes) == peak_bytes``.
    """
    position, values = parse_peak(live_range_text)
    if position is None:
        return None
    length, ranges = parse_ranges(live_range_text)
    defs = _definitions(hlo_text)
    groups: dict[tuple[str, str], list] = {}
    for name, index, size in values:
        type_text, label = defs.get(name, ("", "<unknown>"))
        key = (label, _element_shape(type_text, index) if type_text else "")
        entry = groups.setdefault(key, [0, 0, []])
        entry[0] += 1
        entry[1] += size
        live_range = ranges.get(f"{name}{{{index}}}")
        if live_range is not None:
            entry[2].append(live_range)
    rows = sorted(({"label": k[0], "shape": k[1], "count": c, "bytes": b, **_span(r)}
                   for k, (c, b, r) in groups.items()),
                  key=lambda r: (-r["bytes"], r["label"], r["shape"]))
    if len(rows) > top:
        rest = rows[top:]
        rows = rows[:top] + [{"label": "other", "shape": "", "count": sum(r["count"] for r in rest),
                              "bytes": sum(r["bytes"] for r in rest),
                              **_span([(r["first_start"], r["first_end"]) for r in rest
                                       if r["first_start"] is not None] +
                                      [(r["last_start"], r["last_end"]) for r in rest
                                       if r["first_start"] is not None])}]
    return {"peak_bytes": sum(v[2] for v in values), "values": len(values),
            "peak_position": position, "program_length": length, "groups": rows}


def peak_breakdown(dump_dir: str, *, top: int = 12) -> Optional[dict]:
    """:func:`breakdown` of the module in ``dump_dir`` with the largest peak (``None`` if none).

    ``dump_dir`` is an ``xla_dump_to`` directory of one compilation; a module's live-range file
    ``<prefix>-live-range.txt`` is read with the HLO text ``<prefix>.txt`` beside it.
    """
    best = None
    for path in sorted(glob.glob(os.path.join(dump_dir, "*-live-range.txt"))):
        hlo_path = path[:-len("-live-range.txt")] + ".txt"
        if not os.path.exists(hlo_path):
            continue
        with open(path) as f:
            live = f.read()
        with open(hlo_path) as f:
            hlo = f.read()
        result = breakdown(live, hlo, top=top)
        if result is not None and (best is None or result["peak_bytes"] > best["peak_bytes"]):
            result["module"] = os.path.basename(hlo_path)
            best = result
    return best


def format_breakdown(result: dict, *, indent: str = "    ") -> str:
    """Printable lines of a :func:`breakdown` result (sizes in KiB / MiB / GiB)."""
    def size(n):
        if n >= 2**30:
            return f"{n / 2**30:.2f} GiB"
        return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
    where = f"position {result['peak_position']}"
    if result.get("program_length") is not None:
        where += f" of {result['program_length']}"
    lines = [f"{indent}alive at the peak ({where}): {size(result['peak_bytes'])} in "
             f"{result['values']} values (size, count, op and shape, where they start and end)"]
    for g in result["groups"]:
        what = f"{g['label']} {g['shape']}".strip()
        start = ("" if g.get("first_start") is None else
                 f"  [start {g['first_start']}-{g['last_start']}, "
                 f"end {g['first_end']}-{g['last_end']}]")
        lines.append(f"{indent}  {size(g['bytes']):>11}  {g['count']:>4} x  {what}{start}")
    return "\n".join(lines)
