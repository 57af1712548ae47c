"""XLA / libtpu compiler options as text: ``"name=value,name=value"`` -> ``{name: value}``.

The same options reach a program three ways: ``config.train.tpu_compiler_options`` (the trainer's
jitted steps, whenever they are compiled for TPU: on a TPU VM, and by the pre-flight
``experiments.tpu_plan``), ``tpu_plan --xla_option NAME=VALUE`` and ``LIBTPU_INIT_ARGS`` on a TPU
VM (``--name=value``: process-wide, for every program). An unknown name is refused by the compiler
when the program is compiled.
"""
from __future__ import annotations

from typing import Iterable, Union


def parse_compiler_options(items: Union[str, Iterable[str]]) -> dict:
    """``["name=value", ...]`` (or one comma-separated string) -> ``{name: value}``.

    ``true`` / ``false`` become booleans and numbers ints or floats, as the flags of
    ``LIBTPU_INIT_ARGS`` read them; a leading ``--`` is dropped; empty items are skipped.

    Raises:
      ValueError: an item is not ``NAME=VALUE``.
    """
    if isinstance(items, str):
        items = items.split(",")
    out = {}
    for item in items:
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        name = name.strip().lstrip("-")
        if not sep or not name:
            raise ValueError(f"a compiler option is NAME=VALUE, got {item!r}")
        value = value.strip()
        if value.lower() in ("true", "false"):
            out[name] = value.lower() == "true"
            continue
        for kind in (int, float):
            try:
                out[name] = kind(value)
                break
            except ValueError:
                pass
        else:
            out[name] = value
    return out
