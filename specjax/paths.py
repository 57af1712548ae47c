"""Paths as written into committed reports: relative to the working directory (the repository
root when run as documented) or to ``~``, never an absolute path of the machine that ran them."""
from __future__ import annotations

import json
import os
from typing import Any, Sequence


def portable_path(path: str) -> str:
    """``path`` relative to the current directory when inside it, ``~/...`` when under the home
    directory, else unchanged (a location the user chose outside both)."""
    if not isinstance(path, str) or not path:
        return path
    full = os.path.abspath(os.path.expanduser(path))
    for base, prefix in ((os.getcwd(), ""), (os.path.expanduser("~"), "~/")):
        if full == base:
            return prefix.rstrip("/") or "."
        if full.startswith(base.rstrip(os.sep) + os.sep):
            return prefix + os.path.relpath(full, base)
    return path


def portable_argv(argv: Sequence[str]) -> list[str]:
    """Command-line arguments with every absolute or ``~`` path made portable (``--flag=/path``
    included)."""
    out = []
    for a in argv:
        flag, eq, value = a.partition("=") if a.startswith("-") else ("", "", a)
        if value.startswith(("/", "~")):
            value = portable_path(value)
        out.append(f"{flag}{eq}{value}")
    return out


def portable_values(d: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``d`` whose absolute / ``~`` string values are portable paths."""
    return {k: portable_path(v) if isinstance(v, str) and v.startswith(("/", "~")) else v
            for k, v in d.items()}


def dump_json(path: str, obj: Any, *, sort_keys: bool = False) -> str:
    """Writes ``obj`` to ``path`` as JSON indented by one space (the committed results' format),
    creating the directory first; returns ``path``. ``obj`` must already be JSON-serialisable."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=sort_keys)
    return path
