"""No import cycles inside ``specjax`` or ``pallas_kernels``.

The graph is read from the source with :mod:`ast` (nothing is imported). Every ``import`` counts,
including those inside functions: a lazy import that closes a loop hides the cycle from Python
but not from a reader, and it breaks as soon as someone moves it to the top of the file. An
import of a package's own ancestor package (``from specjax.training import x`` inside
``specjax/training/y.py``) counts only when it takes a name defined by the ancestor's
``__init__``; Python always runs a parent package before its submodules, so the parent edge by
itself is no cycle.
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def package_modules(root: str, package: str) -> dict[str, str]:
    """``{dotted module name: file path}`` for every ``.py`` file of ``package`` under ``root``."""
    out = {}
    for directory, _, files in os.walk(os.path.join(root, package)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[dotted.removesuffix(".__init__")] = path
    return out


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """``{module: modules of the same packages that it imports}``."""
    graph = {}
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[:len(package) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                for a in node.names:  # a submodule if one exists by that name, else a name
                    sub = f"{source}.{a.name}"
                    deps.add(sub if sub in modules else source)
        graph[module] = {d for d in deps
                         if d in modules and d != module and not module.startswith(d + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.mark.parametrize("package", ["specjax", "pallas_kernels"])
def test_no_import_cycles(package):
    graph = import_graph(package_modules(ROOT, package))
    assert len(graph) >= 2 and package in graph, f"found only {sorted(graph)} in {package}"
    found = cycles(graph)
    detail = "\n".join(" <-> ".join(c) + "\n  " + "\n  ".join(
        f"{m} imports {sorted(graph[m] & set(c))}" for m in c) for c in found)
    assert not found, f"import cycles in {package}:\n{detail}"


def test_checker_sees_lazy_and_relative_cycles(tmp_path):
    """The checker itself: a cycle closed by a function-level relative import is found, a
    submodule importing its own package's submodule is not a cycle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("from pkg import b\n\ndef f():\n    return b.g()\n")
    (pkg / "b.py").write_text("def g():\n    from .a import f\n    return f\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from pkg.sub import d\n")
    (pkg / "sub" / "d.py").write_text("import pkg.a\n")
    graph = import_graph(package_modules(str(tmp_path), "pkg"))
    assert graph["pkg.sub.c"] == {"pkg.sub.d"}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
