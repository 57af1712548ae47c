"""Code versions for cache keys: a hash of the source that produces a cached artefact.

A cached artefact (the prepared corpus + tokenizer, a pretrained target checkpoint) is reused only
when it was produced by the same configuration *and* the same code: a config hash alone would hand
back a stale checkpoint after a change to, say, the model's attention or the tokenizer's
pre-splitting. :func:`source_hash` hashes the listed modules' syntax trees without docstrings, so
editing comments, docstrings or formatting keeps caches valid while any change to what the code
does invalidates them.

The lists name the modules whose code decides the artefact's bytes (paths relative to the
``specjax`` package). They err on the side of invalidating: a module that only might matter is in.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
from typing import Any, Iterable

_PACKAGE = os.path.dirname(os.path.abspath(__file__))

#: Corpus extraction, the math generator, the BPE tokenizer and the TFDS writer.
DATA_SOURCES = ("data/corpus.py", "data/math_problems.py", "data/tokenizer.py",
                "data/tfds_builder.py")

#: A pretrained target: its data (above, plus the input pipeline), the model, and the training
#: stack that turns both into parameters.
TARGET_SOURCES = DATA_SOURCES + (
    "compiler_options.py", "data/pipeline.py",
    "models/attention.py", "models/config.py", "models/kv_cache.py", "models/layers.py",
    "models/transformer.py",
    "training/checkpoint.py", "training/config.py", "training/distributed.py",
    "training/errors.py", "training/inputs.py", "training/lm_task.py", "training/memory.py",
    "training/optimizer.py",
    "training/registry.py", "training/run.py", "training/sharding.py", "training/tasks.py",
    "training/train_loop.py", "training/trainer.py",
)

#: A trained drafter (the quickstart's MTP head): its target's code (above), the drafters, the
#: losses and the drafter task that trains them.
DRAFTER_SOURCES = TARGET_SOURCES + (
    "losses/__init__.py", "losses/_common.py", "losses/divergences.py", "losses/dspark.py",
    "losses/e2e_tv.py", "losses/tv.py", "sampling.py",
    "drafters/__init__.py", "drafters/base.py", "drafters/blocks.py",
    "drafters/draft_lm.py", "drafters/dspark.py", "drafters/mtp.py", "drafters/ngram.py",
    "models/flops.py",
    "training/drafter_build.py", "training/drafter_data.py", "training/drafter_run.py",
    "training/drafter_task.py",
)


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return tree


def normalized_source(path: str) -> str:
    """The module's syntax tree without docstrings, as text (comments and layout do not appear)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    return ast.dump(_strip_docstrings(tree), include_attributes=False)


def source_hash(sources: Iterable[str], root: str = _PACKAGE) -> str:
    """12 hex digits of SHA-256 over ``(path, normalized source)`` of each listed module.

    Args:
      sources: module paths relative to ``root`` (default: the ``specjax`` package directory).
      root: where the paths are resolved.
    Raises:
      FileNotFoundError naming the module when one is missing (a list left behind by a rename).
    """
    h = hashlib.sha256()
    for rel in sorted(set(sources)):
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"code_version: {rel} not found under {root} (renamed? update "
                                    f"the source lists in specjax/code_version.py)")
        h.update(rel.encode() + b"\0" + normalized_source(path).encode() + b"\0")
    return h.hexdigest()[:12]


def artefact_key(config: Any, sources: Iterable[str]) -> str:
    """10 hex digits identifying an artefact: its JSON-able ``config`` and its code version."""
    payload = json.dumps({"config": config, "code": source_hash(sources)}, sort_keys=True,
                         default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:10]
