"""The import graph of favor has no circle: between modules, or between the folders and top-level
modules of favor/ (an import inside a function counts as much as one at the top)."""

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules():
    mods = {}
    for path in sorted((ROOT / "favor").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _graph(mods):
    """module -> the favor modules it imports (`from pkg import sub` counts as importing pkg.sub)."""
    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = collections.defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                target = resolve(target) if target.startswith("favor") else ""
                if target and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph):
    """The strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others():
    assert _cycles(_graph(_modules())) == []


def test_no_folder_imports_itself_through_others():
    """favor.bench.* -> favor.job -> favor.bench.* would be a circle between places."""
    unit = lambda name: ".".join(name.split(".")[:2])
    folders = collections.defaultdict(set)
    for name, targets in _graph(_modules()).items():
        folders[unit(name)] |= {unit(t) for t in targets if unit(t) != unit(name)}
    assert _cycles(folders) == []


def test_the_graph_sees_a_circle():
    """The check itself: a hand-made circle is found, a chain is not."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}}) == []


def test_every_command_entry_point_names_a_function(monkeypatch):
    """pyproject's [project.scripts]: each 'module:function' imports and is callable, and a command's
    main returns its exit status (the console script exits with it)."""
    import importlib
    import tomllib
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) >= {"favor-inspect", "favor-report", "favor-demo"}
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), name
    # a console script exits with main()'s return value: 0 (or None) on success
    demo = importlib.import_module("favor.tools.demo")
    monkeypatch.setattr(demo, "table", lambda *a: [])              # the table itself: seconds of draws
    monkeypatch.setattr(demo, "format_table", lambda *a: "")
    assert demo.main(["--dim", "4", "--features", "4", "--repeats", "2"]) == 0
