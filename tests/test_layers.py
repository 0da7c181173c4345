"""The package's shape: no import cycle between ``swarm`` packages, and layers that import
downwards only (a new upward import fails here, naming the module and the line)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "swarm"

#: Bottom first: a unit may import its own layer or any below it, never one above.
LAYERS: list[set[str]] = [
    {"__init__", "errors", "faults", "procs", "text", "secrets", "domain", "cache", "patches"},
    {"config", "telemetry"},
    {"store", "llm", "mcp_client"},
    {"agent"},
    {"workspace"},
    {"runtime", "broker"},
    {"coordinator", "workers"},
    {"report", "serve", "schedules", "testing"},
    {"cli", "__main__"},
]


def unit(module: str) -> str:
    """``swarm.store.ledger`` -> ``store``; ``swarm.errors`` -> ``errors``; ``swarm`` and
    ``swarm.__version__`` -> ``__init__``."""
    parts = module.split(".")
    top = PACKAGE / parts[1] if len(parts) > 1 else PACKAGE
    if top == PACKAGE or not (top.with_suffix(".py").exists() or top.is_dir()):
        return "__init__"
    return parts[1]


def module_level(tree: ast.Module) -> list[ast.stmt]:
    """The statements that run at import time (not in functions, not under TYPE_CHECKING)."""
    out: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.extend(node.orelse)
        elif isinstance(node, ast.Try):
            out.extend([*node.body, *node.orelse, *node.finalbody])
        else:
            out.append(node)
    return out


def imports(at_import_time: bool = False) -> list[tuple[str, str, int, str]]:
    """(importing module, imported swarm module, line, file) for every import in swarm
    (with ``at_import_time``, only those that run when the module is imported)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        nodes = module_level(tree) if at_import_time else list(ast.walk(tree))
        for node in nodes:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")[: len(module.split(".")) - node.level + is_pkg]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # ``from swarm import faults`` imports swarm.faults; ``from swarm.x import y``
                # imports swarm.x (and y, when y is a module of it: same unit either way).
                names = [f"{source}.{a.name}" for a in node.names] if source == "swarm" \
                    else [source]
            else:
                continue
            for name in names:
                if name == "swarm" or name.startswith("swarm."):
                    found.append((module, name, node.lineno, str(path)))
    return found


def layer_of(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    raise AssertionError(f"swarm.{name} is in no layer of tests/test_layers.py; add it")


def test_every_package_is_in_a_layer() -> None:
    for path in PACKAGE.iterdir():
        if path.suffix == ".py" or (path.is_dir() and (path / "__init__.py").exists()):
            layer_of(path.stem)


def test_layers_import_downwards_only() -> None:
    upward = []
    for module, name, line, path in imports():
        src, dst = unit(module), unit(name)
        if layer_of(dst) > layer_of(src):
            upward.append(f"{path}:{line} {module} imports {name}")
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                cycles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif len(path) < 8:
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    return sorted(set(cycles))


def test_no_import_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, name, _, _ in imports():
        if unit(module) != unit(name):
            graph[unit(module)].add(unit(name))
    cycles = find_cycles(graph)
    assert not cycles, "import cycles between packages:\n" + "\n".join(cycles)


def test_no_import_cycle_between_modules() -> None:
    """No module needs another to be half-imported (e.g. a group importing its commands
    while they import it back)."""
    known = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(
        ".__init__") for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for module, name, _, _ in imports(at_import_time=True):
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        if name != module and not module.startswith(name + "."):
            graph[module].add(name)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles between modules:\n" + "\n".join(cycles)
