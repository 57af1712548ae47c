"""The embedded default corpus: three offline domains (math / code / prose), fixed splits, no download.

The papers evaluate speculative decoding on math, code and chat; this corpus mirrors that split with
text every Python installation already has:

* ``math``  -- generated grade-school word problems with worked solutions and a ``#### n`` answer
  line (:mod:`specjax.data.math_problems`): a low-entropy, verifiable domain.
* ``code``  -- Python source of the running interpreter's standard library: a deterministic
  ~3 MB subset of the pure-Python modules, excluding tests, ``site-packages``, GUI/IDE packages
  (``tkinter``, ``idlelib``, ``turtledemo``), generated tables (``encodings``, ``html.entities``)
  and deprecated trees (``lib2to3``, ``distutils``).
* ``prose`` -- English prose from the standard library: the ``pydoc_data.topics`` help pages (the
  language reference as plain text) and the docstrings of the eligible stdlib modules, classes
  and functions, extracted with :mod:`ast` (nothing is imported, so no module side effects).

Determinism: files are found by a sorted walk that prunes excluded directories; the code subset is
chosen by the SHA-256 of each file's relative path (not by listing order) under a byte budget.
Documents longer than ``MAX_DOC_CHARS`` are cut at top-level blank lines (then paragraphs, then
lines), so a document is a few hundred tokens. Identical documents are kept once per domain.

Splits: ``train`` and ``heldout``. A document's split is decided by a salted SHA-256 of its *group*
key -- the stdlib file for code chunks and docstrings (so a file's code and its docstrings land on
the same side), the help topic for ``pydoc_data`` pages, the question text for math -- with
``HELDOUT_PER_MILLE / 1000`` of the groups held out. Splits therefore never share a document, and
no held-out code file leaks into training through its docstrings.

Sizes on CPython 3.11.7 (tokens: the default 2048-entry BPE of :mod:`specjax.data.tokenizer`,
without separators; regenerate with ``python -m specjax.data.stats``):

=======  =======  ==========  ======  ==========
domain   split    bytes       docs    tokens
=======  =======  ==========  ======  ==========
math     train    1,904,826   11,325  668,723
math     heldout  94,667      563     33,269
code     train    2,786,996   1,785   892,772
code     heldout  212,964     135     69,839
prose    train    1,770,729   1,140   609,088
prose    heldout  101,523     66      35,375
=======  =======  ==========  ======  ==========

The corpus depends on the interpreter's standard library, so other Python versions give somewhat
different code/prose sizes (math is the same everywhere); :func:`corpus_fingerprint` captures it.
Loading is a few seconds once per process (parsing the stdlib dominates) and cached after that.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import os
import re
import sys
import sysconfig
from typing import NamedTuple

from specjax.data.math_problems import math_problems

__all__ = [
    "DOMAINS",
    "SPLITS",
    "Document",
    "load_corpus",
    "load_documents",
    "split_text",
    "corpus_fingerprint",
]

DOMAINS = ("math", "code", "prose")
SPLITS = ("train", "heldout")

# Bump when any rule below changes what the corpus contains (it is part of the fingerprint).
CORPUS_VERSION = "1"
HELDOUT_PER_MILLE = 50  # 5% of groups are held out.
MAX_DOC_CHARS = 2048  # ~500-700 tokens: about one training row at the default context.
MIN_DOC_CHARS = 32  # Smaller fragments (empty __init__.py, stray lines) carry no signal.
CODE_BYTE_BUDGET = 3_000_000
MAX_FILE_BYTES = 150_000  # Skips the one giant outlier (_pydecimal.py) so no file dominates.
MIN_DOCSTRING_CHARS = 40
MATH_SEED = 20240917
MATH_POOL = 12_000  # Problems generated before de-duplication.

# Directory names pruned anywhere in the walk: tests, third-party code, GUI/IDE code, generated
# codec tables, deprecated trees, build configuration.
_EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idlelib", "tkinter", "turtledemo",
    "lib2to3", "distutils", "ensurepip", "encodings", "pydoc_data", "venv", "__pycache__",
})
# Single files that are data tables or jokes rather than code anyone writes.
_EXCLUDED_FILES = frozenset({"html/entities.py", "this.py", "antigravity.py", "__phello__"})


class Document(NamedTuple):
    """One corpus document: ``key`` is unique within its domain (stable across runs)."""

    key: str
    text: str


def load_corpus(domain: str, split: str = "train", max_docs: int | None = None) -> list[str]:
    """Texts of one domain's split, in a fixed order.

    Args:
      domain: one of :data:`DOMAINS`.
      split: ``"train"`` or ``"heldout"``.
      max_docs: if given, only the first ``max_docs`` documents (a deterministic prefix, for
        quick tests and smoke runs).
    Returns:
      list of document strings.
    """
    return [doc.text for doc in load_documents(domain, split, max_docs)]


def load_documents(domain: str, split: str = "train", max_docs: int | None = None) -> list[Document]:
    """Like :func:`load_corpus` but returns :class:`Document` records with their stable keys."""
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; expected one of {DOMAINS}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if max_docs is not None and (isinstance(max_docs, bool) or not isinstance(max_docs, int)
                                 or max_docs < 0):
        raise ValueError(f"max_docs must be None or a non-negative int, got {max_docs!r}")
    docs = _split_domain(domain)[split]
    return list(docs if max_docs is None else docs[:max_docs])


def corpus_fingerprint() -> str:
    """A short hash of everything that determines the corpus (rules + interpreter stdlib).

    Cheap (no parsing): it hashes the rules, the Python version and the eligible files' paths
    and sizes. Used to decide whether a prepared dataset on disk is still current.
    """
    h = hashlib.sha256()
    h.update(repr((CORPUS_VERSION, HELDOUT_PER_MILLE, MAX_DOC_CHARS, MIN_DOC_CHARS,
                   CODE_BYTE_BUDGET, MAX_FILE_BYTES, MIN_DOCSTRING_CHARS, MATH_SEED, MATH_POOL,
                   sys.version_info[:3])).encode())
    for rel, size in _eligible_files():
        h.update(f"{rel}\0{size}\n".encode())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# Splitting and chunking


def _is_heldout(group: str) -> bool:
    # Salted so the held-out set is unrelated to the code-subset selection hash below.
    digest = hashlib.sha256(f"specjax-split-v1\0{group}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < HELDOUT_PER_MILLE


@functools.lru_cache(maxsize=None)
def _split_domain(domain: str) -> dict[str, tuple[Document, ...]]:
    builders = {"math": _math_documents, "code": _code_documents, "prose": _prose_documents}
    out: dict[str, list[Document]] = {s: [] for s in SPLITS}
    seen: set[str] = set()
    for group, doc in builders[domain]():
        if doc.text in seen:  # Exact duplicates would otherwise be able to straddle the splits.
            continue
        seen.add(doc.text)
        out["heldout" if _is_heldout(group) else "train"].append(doc)
    return {s: tuple(docs) for s, docs in out.items()}


# Separator levels, coarsest first. Each is a zero-width split point *after* the separator, so
# the separator stays at the end of the left piece and "".join(pieces) == text.
_SPLIT_LEVELS = (
    re.compile(r"(?<=\n\n)(?=\S)"),  # blank line followed by an unindented line (code: top level)
    re.compile(r"(?<=\n\n)(?= {4}\S)"),  # ... by a once-indented line (code: class members)
    re.compile(r"(?<=\n\n)"),  # any blank line (paragraphs)
    re.compile(r"(?<=\n)"),  # any line
)


def split_text(text: str, max_chars: int = MAX_DOC_CHARS) -> list[str]:
    """Cut ``text`` into consecutive pieces of at most ``max_chars`` characters.

    Prefers top-level blank lines, then blank lines before class members, then any blank line, then line ends, then a hard cut; adjacent
    small pieces are merged greedily. Lossless: ``"".join(split_text(t, n)) == t``.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    return _split(text, max_chars, 0)


def _split(text: str, max_chars: int, level: int) -> list[str]:
    if len(text) <= max_chars:
        return [text] if text else []
    if level == len(_SPLIT_LEVELS):
        return [text[i:i + max_chars] for i in range(0, len(text), max_chars)]
    pieces: list[str] = []
    for part in _SPLIT_LEVELS[level].split(text):
        pieces.extend(_split(part, max_chars, level + 1) if len(part) > max_chars else [part])
    merged: list[str] = []
    for piece in pieces:
        if merged and len(merged[-1]) + len(piece) <= max_chars:
            merged[-1] += piece
        else:
            merged.append(piece)
    return merged


def _chunks(key: str, text: str) -> list[Document]:
    docs = []
    for i, chunk in enumerate(split_text(text)):
        if len(chunk.strip()) >= MIN_DOC_CHARS:
            docs.append(Document(f"{key}#{i}", chunk))
    return docs


# ----------------------------------------------------------------------------------------------
# Domains


def _math_documents():
    for i, problem in enumerate(math_problems(MATH_SEED, MATH_POOL)):
        yield problem.question, Document(f"math:{i}", problem.text)


def _stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


@functools.lru_cache(maxsize=None)
def _eligible_files() -> tuple[tuple[str, int], ...]:
    """Sorted (relative path, size) of the stdlib .py files the corpus may use."""
    root = _stdlib_dir()
    if not os.path.isdir(root):
        raise FileNotFoundError(f"standard library directory not found: {root}")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place (and sort) so excluded trees such as site-packages are never walked.
        dirnames[:] = sorted(d for d in dirnames
                             if d not in _EXCLUDED_DIRS and not d.startswith(("config-", ".")))
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith("test_"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if rel in _EXCLUDED_FILES or rel.split("/")[0] in _EXCLUDED_FILES:
                continue
            size = os.path.getsize(path)
            if 0 < size <= MAX_FILE_BYTES:
                out.append((rel, size))
    return tuple(sorted(out))


def _read(rel: str) -> str:
    with open(os.path.join(_stdlib_dir(), rel), encoding="utf-8", errors="replace") as f:
        return f.read()


def _code_subset() -> list[str]:
    """Relative paths of the code subset: hash order under the byte budget, returned sorted."""
    by_hash = sorted(_eligible_files(), key=lambda rs: hashlib.sha256(rs[0].encode()).hexdigest())
    chosen, total = [], 0
    for rel, size in by_hash:
        if total + size > CODE_BYTE_BUDGET:
            continue  # A smaller file further on may still fit; the order stays deterministic.
        chosen.append(rel)
        total += size
    return sorted(chosen)


def _code_documents():
    for rel in _code_subset():
        for doc in _chunks(f"code:{rel}", _read(rel)):
            yield rel, doc


def _prose_documents():
    import pydoc_data.topics  # Stdlib; holds the language reference as plain-text help topics.

    topics = pydoc_data.topics.topics
    for name in sorted(topics):
        for doc in _chunks(f"topic:{name}", topics[name]):
            yield f"topic:{name}", doc
    for rel, _ in _eligible_files():
        text = _docstrings_text(rel)
        for doc in _chunks(f"doc:{rel}", text):
            yield rel, doc  # Same group key as the file's code chunks: same split.


def _docstrings_text(rel: str) -> str:
    """The module's docstrings as paragraphs: module docstring, then ``Name.method`` + docstring."""
    try:
        tree = ast.parse(_read(rel))
    except (SyntaxError, ValueError):  # A stdlib file this interpreter cannot parse: skip it.
        return ""
    module = rel[:-3].replace("/", ".").removesuffix(".__init__")
    parts = []
    doc = ast.get_docstring(tree)
    if doc and len(doc) >= MIN_DOCSTRING_CHARS:
        parts.append(f"{module}\n{doc}")
    # Only module- and class-level definitions: walking every function body (ast.walk) costs
    # more than parsing and nested helpers rarely have docstrings.
    stack = [(node, "") for node in reversed(tree.body)]
    while stack:
        node, prefix = stack.pop()
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        name = f"{prefix}{node.name}"
        doc = ast.get_docstring(node)
        if doc and len(doc) >= MIN_DOCSTRING_CHARS:
            parts.append(f"{module}.{name}\n{doc}")
        if isinstance(node, ast.ClassDef):
            stack.extend((child, f"{name}.") for child in reversed(node.body))
    return "\n\n".join(parts) + "\n" if parts else ""
