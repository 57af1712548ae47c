"""Loaded at start-up by a Python process that has this directory first on its ``PYTHONPATH``
(the notebook kernels of ``tests/test_notebooks.py``, the subprocesses of ``tests/test_extras.py``):
makes the top-level modules named in ``$SPECJAX_NOTEBOOK_BLOCK`` (comma-separated) impossible to
import, as if their packages were not installed.

The notebook tests block the packages of the extras a notebook's setup cell does not install, so
a notebook that needs an extra it does not ask for fails there as it would on a fresh Colab
runtime.
"""
import os
import sys

_BLOCKED = frozenset(m for m in os.environ.get("SPECJAX_NOTEBOOK_BLOCK", "").split(",") if m)


class _BlockExtras:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(
                f"No module named {name!r} (hidden by the test: the extra that provides it counts "
                "as not installed)", name=name)
        return None


if _BLOCKED:
    sys.meta_path.insert(0, _BlockExtras())
