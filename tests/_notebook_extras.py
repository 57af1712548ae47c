"""What a notebook's setup cell installs, and which packages a kernel must then do without.

A notebook's first code cell installs the checkout (``%pip install -e '<ROOT>[extras]'``) when
the package or one of its extras is missing (Colab). :func:`setup_cell_pip` runs that cell with
a fake IPython and a fake ``importlib.metadata`` to see the pip command it issues;
:func:`blocked_modules` lists the top-level modules of the extras it does not install (minus
anything the base package or the installed extras pull in), for
``notebook_site/sitecustomize.py`` to hide from the kernel.
"""
import configparser
import contextlib
import importlib.metadata as md
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "notebook_site")
#: Extras no notebook kernel may lose: the kernel itself (ipykernel) comes from ``test``.
NEVER_BLOCKED = frozenset({"test"})


def setup_cfg_extras() -> dict:
    """``{extra: [distribution names]}`` from setup.cfg's ``[options.extras_require]``."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    return {extra: [_dist_name(r) for r in value.split("\n") if r.strip()]
            for extra, value in cfg["options.extras_require"].items()}


def _dist_name(requirement: str) -> str:
    return re.split(r"[\s;\[<>=!~]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def setup_cell(nb) -> str:
    """Source of the notebook's setup cell (the code cell that calls ``%pip``)."""
    for cell in nb.cells:
        if cell.cell_type == "code" and 'run_line_magic("pip"' in cell.source:
            return cell.source
    raise AssertionError("no setup cell (a code cell that installs the package with %pip)")


def declared_extras(source: str) -> set:
    """The extras a setup cell's ``%pip`` line names, read from its source (the test that runs the
    cell checks that it installs exactly these)."""
    m = re.search(r"install -q -e '?\{ROOT\}(\[(?P<extras>[\w,-]+)\])?", source)
    assert m, "the setup cell has no `install -q -e {ROOT}...` line"
    return set(m["extras"].split(",")) if m["extras"] else set()


def setup_cell_pip(source: str, missing, monkeypatch, workdir):
    """Runs a setup cell as if the distributions in ``missing`` were not installed; returns the
    argument of the ``%pip`` it issued, or None if it issued none."""
    calls = []

    class _IPython:
        def run_line_magic(self, magic, line):
            calls.append((magic, line))

    real_version = md.version

    def version(dist):
        if dist.lower() in missing:
            raise md.PackageNotFoundError(dist)
        return real_version(dist)

    monkeypatch.setattr(md, "version", version)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("SPECJAX_NOTEBOOK_WORKDIR", str(workdir))
    monkeypatch.chdir(NOTEBOOKS)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        exec(compile(source, "<setup cell>", "exec"), {"get_ipython": _IPython})
    assert all(magic == "pip" for magic, _ in calls) and len(calls) <= 1, calls
    return calls[0][1] if calls else None


def installed_extras(pip_line: str) -> set:
    """The extras of an ``install -e '<ROOT>[a,b]'`` line (empty set without brackets)."""
    m = re.fullmatch(r"install -q -e '?(?P<path>[^'\[]+)(\[(?P<extras>[\w,-]+)\])?'?", pip_line)
    assert m, f"unexpected pip line: {pip_line!r}"
    assert os.path.samefile(m["path"], ROOT), pip_line
    return set(m["extras"].split(",")) if m["extras"] else set()


def _closure(dists) -> set:
    """The distributions ``dists`` need, recursively (installed ones only; extras' own optional
    requirements left out)."""
    seen, todo = set(), list(dists)
    while todo:
        d = todo.pop()
        if d in seen:
            continue
        seen.add(d)
        try:
            reqs = md.requires(d) or []
        except md.PackageNotFoundError:
            continue
        todo += [_dist_name(r) for r in reqs if "extra ==" not in r]
    return seen


def blocked_modules(extras: set) -> list:
    """Top-level modules of the installed distributions that only undeclared extras provide."""
    all_extras = setup_cfg_extras()
    unknown = extras - set(all_extras)
    assert not unknown, f"the setup cell installs extras setup.cfg does not define: {unknown}"
    kept = _closure({"specjax"} | {d for e in extras | NEVER_BLOCKED for d in all_extras[e]})
    dropped = {d for e, ds in all_extras.items() if e not in extras | NEVER_BLOCKED
               for d in ds} - kept
    modules = {m for m, ds in md.packages_distributions().items()
               if all(_dist_name(d) in dropped for d in ds)}
    return sorted(m for m in modules if not m.startswith("_"))
