"""Loaded at start-up by the notebook kernels of ``tests/test_notebooks.py`` (this directory is
first on their ``PYTHONPATH``): makes the top-level modules named in ``$SPECJAX_NOTEBOOK_BLOCK``
(comma-separated) impossible to import, as if their packages were not installed.

The test blocks the packages of the extras a notebook's setup cell does not install, so a notebook
that needs an extra it does not ask for fails here as it would on a fresh Colab runtime.
"""
import os
import sys

_BLOCKED = frozenset(m for m in os.environ.get("SPECJAX_NOTEBOOK_BLOCK", "").split(",") if m)


class _BlockExtras:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(
                f"No module named {name!r} (blocked: the notebook's setup cell does not install "
                "the extra that provides it)", name=name)
        return None


if _BLOCKED:
    sys.meta_path.insert(0, _BlockExtras())
