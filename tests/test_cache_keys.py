"""Caches are hermetic under test and keyed on the code that produced them.

* Every cache location (prepared data, pretrained targets, the quickstart's target, notebook
  work) resolves under this test session's temporary directory (set in ``conftest.py``), never
  under ``~/.cache``.
* A cached artefact's key changes when the code that produces it changes, and only then: not on
  comment / docstring edits, and not on code that does not produce it.
"""
import os
import shutil

import conftest
import pytest

from specjax import code_version as cv


def test_every_cache_location_is_under_the_test_temp_dir():
    from experiments import quickstart, reproduce_steps
    from experiments.configs import pretrain_target
    from specjax.training import default_config
    from specjax.training.run import data_dir_of

    home_cache = os.path.join(os.path.expanduser("~"), ".cache")
    paths = [data_dir_of(default_config(), 2048), quickstart._workdir(True),
             quickstart._workdir(False),
             reproduce_steps.target_cache_dir(reproduce_steps.MODES["tiny"],
                                              pretrain_target.get_config("tiny")),
             os.environ["SPECJAX_NOTEBOOK_WORKDIR"]]
    for p in paths:
        assert os.path.abspath(p).startswith(conftest.CACHE_ROOT + os.sep), p
        assert not os.path.abspath(p).startswith(home_cache), p


def _copy_sources(root):
    """The package's sources named in TARGET_SOURCES, copied under ``root``."""
    for rel in cv.TARGET_SOURCES:
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        shutil.copy(os.path.join(os.path.dirname(cv.__file__), rel), os.path.join(root, rel))


def _edit(path, old, new):
    with open(path) as f:
        text = f.read()
    assert old in text, f"{old!r} not in {path}"
    with open(path, "w") as f:
        f.write(text.replace(old, new, 1))


def test_source_hash_follows_code_not_comments_or_docstrings(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text('"""Doc."""\n\n\ndef f(x):\n    """Doc."""\n    return x + 1  # one\n')
    base = cv.source_hash(["m.py"], root=str(tmp_path))
    mod.write_text('"""Other doc."""\n# a comment\n\ndef f(x):\n    return (x\n            + 1)\n')
    assert cv.source_hash(["m.py"], root=str(tmp_path)) == base
    mod.write_text('"""Doc."""\n\n\ndef f(x):\n    """Doc."""\n    return x + 2  # one\n')
    assert cv.source_hash(["m.py"], root=str(tmp_path)) != base


def test_keys_change_with_the_code_that_produces_the_artefact(tmp_path):
    root = str(tmp_path)
    _copy_sources(root)
    data0, target0 = cv.source_hash(cv.DATA_SOURCES, root), cv.source_hash(cv.TARGET_SOURCES, root)
    # The model's code makes the target but not the data.
    _edit(os.path.join(root, "models/transformer.py"), "import", "import os  # noqa\nimport")
    assert cv.source_hash(cv.DATA_SOURCES, root) == data0
    target1 = cv.source_hash(cv.TARGET_SOURCES, root)
    assert target1 != target0
    # The tokenizer's code makes both.
    _edit(os.path.join(root, "data/tokenizer.py"), "import", "import os  # noqa\nimport")
    assert cv.source_hash(cv.DATA_SOURCES, root) != data0
    assert cv.source_hash(cv.TARGET_SOURCES, root) != target1


def test_artefact_key_covers_config_and_code(monkeypatch):
    config = {"model": {"preset": "tiny"}, "train": {"num_steps": 10}}
    key = cv.artefact_key(config, cv.TARGET_SOURCES)
    assert key == cv.artefact_key(dict(config), cv.TARGET_SOURCES)
    assert key != cv.artefact_key({**config, "train": {"num_steps": 11}}, cv.TARGET_SOURCES)
    monkeypatch.setattr(cv, "source_hash", lambda sources, root=None: "edited-code")
    assert cv.artefact_key(config, cv.TARGET_SOURCES) != key


def test_target_cache_dir_changes_with_code(monkeypatch):
    from experiments import quickstart, reproduce_steps
    from experiments.configs import pretrain_target
    mode, config = reproduce_steps.MODES["tiny"], pretrain_target.get_config("tiny")
    before = reproduce_steps.target_cache_dir(mode, config), quickstart._workdir(True)
    monkeypatch.setattr(cv, "source_hash", lambda sources, root=None: "edited-code")
    after = reproduce_steps.target_cache_dir(mode, config), quickstart._workdir(True)
    assert before[0] != after[0] and before[1] != after[1]


def test_missing_listed_source_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="models/gone.py"):
        cv.source_hash(["models/gone.py"], root=str(tmp_path))


# Package files the training entry points import that do not change what they produce.
_NOT_PRODUCING = {
    "__init__.py": "re-exports", "data/__init__.py": "re-exports",
    "models/__init__.py": "re-exports", "training/__init__.py": "re-exports",
    "code_version.py": "computes the keys themselves",
    "models/partitioning.py": "pins where activations live on a mesh, not their values",
    "models/graphdef.py": "keeps a graphdef's hash, not what it builds",
    "training/metrics.py": "writes metrics files",
}


def _package_files_imported_by(*modules):
    """Package-relative paths of the specjax files a fresh interpreter loads to import ``modules``."""
    import subprocess
    import sys
    code = ("import os, sys\n" + "".join(f"import {m}\n" for m in modules)
            + "import specjax\nroot = os.path.dirname(specjax.__file__)\n"
            + "for n, m in sorted(sys.modules.items()):\n"
            + "    f = getattr(m, '__file__', None)\n"
            + "    if n.split('.')[0] == 'specjax' and f:\n"
            + "        print(os.path.relpath(f, root))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_cache_keys_list_every_module_that_trains_the_artefact():
    """A module split off a listed file (or any new import of the training path) must join the
    key, or an edit to it would reuse a stale cached target / drafter."""
    drafter = _package_files_imported_by("specjax.training.drafter_run")
    assert "training/drafter_task.py" in drafter  # the probe sees the package
    assert drafter - set(cv.DRAFTER_SOURCES) - set(_NOT_PRODUCING) == set()
    # The target path's imports, less the drafter-only files the task registry loads with it.
    target = _package_files_imported_by("specjax.training.run", "specjax.training.lm_task",
                                        "specjax.data.tfds_builder", "specjax.data.pipeline")
    drafter_only = set(cv.DRAFTER_SOURCES) - set(cv.TARGET_SOURCES)
    assert target - drafter_only - set(cv.TARGET_SOURCES) - set(_NOT_PRODUCING) == set()
