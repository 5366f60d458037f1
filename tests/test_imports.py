"""The project's import graph, read from the source (ast): no module imports itself through others
(no circle), and imports flow one way, cli -> cache -> jaxsmol. Imports inside functions count: a
deferred import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxsmol", "cache", "cli")  # the repository's folders, installed as jaxsmol, jaxsmol.cache, jaxsmol.cli
ENGINE = tuple(f"jaxsmol.{p}" for p in ("errors", "system", "kernels", "model", "checkpoint", "runtime"))


def floor(module: str) -> int:
    """0 for the engine (jaxsmol, jaxsmol.runtime, ...), 1 for jaxsmol.cache, 2 for jaxsmol.cli."""
    homes = ((2, "jaxsmol.cli"), (1, "jaxsmol.cache"))
    return next((f for f, p in homes if module == p or module.startswith(p + ".")), 0)


def modules() -> dict[str, Path]:
    """Every module of the three packages: dotted name -> file."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            parts = parts if pkg == "jaxsmol" else ("jaxsmol", *parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports (anywhere in it), each resolved to a module in `known`:
    `from a.b import c` is a.b.c where that is a module, else a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a name inside a module: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_is_read():
    g = graph()
    assert "jaxsmol.cache.prefix_cache" in g["jaxsmol.cache.scheduler.many"]  # `from jaxsmol.cache.prefix_cache import`
    assert "jaxsmol.runtime.engine" in g["jaxsmol.cache.prefix_cache"]


def test_no_import_circles():
    found = circles(graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_imports_flow_from_cli_to_cache_to_jaxsmol():
    upward = [(a, b) for a, targets in graph().items() for b in targets
              if floor(b) > floor(a)]
    assert not upward, f"imports against the flow cli -> cache -> jaxsmol: {upward}"


def test_a_circle_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# What each subpackage may import besides itself (its package docstring says the same); a module not
# under one of these (jaxsmol/__init__, errors, cache's own modules, cli) is not held to a list here.
MAY_IMPORT = {
    "jaxsmol.system": {"jaxsmol.errors"},
    "jaxsmol.kernels": {"jaxsmol.errors", "jaxsmol.system"},
    "jaxsmol.model": {"jaxsmol.errors", "jaxsmol.system", "jaxsmol.kernels"},
    "jaxsmol.checkpoint": {"jaxsmol.errors", "jaxsmol.system", "jaxsmol.kernels", "jaxsmol.model"},
    "jaxsmol.runtime": {"jaxsmol.errors", "jaxsmol.system", "jaxsmol.kernels", "jaxsmol.model", "jaxsmol.checkpoint"},
    "jaxsmol.cache.store": {"jaxsmol", *ENGINE},
    "jaxsmol.cli.api": {"jaxsmol", *ENGINE, "jaxsmol.cache"},
}


def _home(module: str) -> str | None:
    return next((p for p in MAY_IMPORT if module == p or module.startswith(p + ".")), None)


def test_each_subpackage_imports_only_what_its_docstring_allows():
    bad = []
    for a, targets in graph().items():
        home = _home(a)
        if home is None:
            continue
        for b in targets:
            allowed = b == home or b.startswith(home + ".") or any(  # "jaxsmol" allows its __init__ alone
                b == p or (p != "jaxsmol" and b.startswith(p + ".")) for p in MAY_IMPORT[home])
            if not allowed:
                bad.append(f"{a} -> {b}")
    assert not bad, "imports across the subpackages' floors: " + ", ".join(bad)


def test_every_folder_says_what_lives_there():
    for pkg in PACKAGES:
        for init in (ROOT / pkg).rglob("__init__.py"):
            assert ast.get_docstring(ast.parse(init.read_text())), f"{init.relative_to(ROOT)} has no docstring"
