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
    """(importing module, imported swarm module, line, file) for every import in swarm,
    those by a module's name in a string included (:func:`string_imports`); with
    ``at_import_time``, only the import statements that run when the module is imported."""
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
        if not at_import_time:
            found += [(module, name, line, str(path)) for name, line in string_imports(tree)]
    return found


#: Calls that import the module a string names: ``importlib.import_module("swarm.x")``,
#: ``__import__``, Celery's ``autodiscover_tasks([...])``.
IMPORTING_CALLS = {"import_module", "__import__", "autodiscover_tasks"}


def _module_string(node: ast.expr) -> str:
    """The swarm module a string names ("" when none): the whole string, or the fixed start
    of an f-string (``f"swarm.cli.{name}"`` names ``swarm.cli``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value
    elif isinstance(node, ast.JoinedStr) and node.values and \
            isinstance(node.values[0], ast.Constant) and isinstance(node.values[0].value, str):
        text = node.values[0].value.rstrip(".")
    else:
        return ""
    return text if text.startswith("swarm.") and " " not in text else ""


def string_imports(tree: ast.AST) -> list[tuple[str, int]]:
    """(module, line) for every swarm module ``tree`` imports by its name in a string, where
    that can be seen: the argument of an importing call (:data:`IMPORTING_CALLS`), the
    strings of an ``include=`` (Celery's list of task modules), and ``-m swarm.x`` in a
    command line."""
    found = []
    for node in ast.walk(tree):
        named: list[ast.expr] = []
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else \
                func.id if isinstance(func, ast.Name) else ""
            if name in IMPORTING_CALLS:
                for arg in node.args[:1]:
                    named += arg.elts if isinstance(arg, ast.List | ast.Tuple) else [arg]
            for kw in node.keywords:
                if kw.arg == "include":
                    value = kw.value
                    named += value.elts if isinstance(value, ast.List | ast.Tuple) else [value]
        elif isinstance(node, ast.List | ast.Tuple):
            named += [b for a, b in zip(node.elts, node.elts[1:], strict=False)
                      if isinstance(a, ast.Constant) and a.value == "-m"]
        found += [(m, node.lineno) for m in map(_module_string, named) if m]
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


def test_imports_by_a_string_are_seen() -> None:
    source = """
app = Celery("swarm", include=["swarm.workers.tasks", "swarm.schedules.tasks"])
app.autodiscover_tasks(["swarm.serve"])
importlib.import_module(f"swarm.cli.{name}")
__import__("swarm.runtime.root")
subprocess.run([sys.executable, "-m", "swarm.testing.server", "-h"])
log = logging.getLogger("swarm.workers")
"""
    assert sorted(string_imports(ast.parse(source))) == sorted([
        ("swarm.workers.tasks", 2), ("swarm.schedules.tasks", 2), ("swarm.serve", 3),
        ("swarm.cli", 4), ("swarm.runtime.root", 5), ("swarm.testing.server", 6)])


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


#: The packages that show the store's records (views) rather than write them.
VIEWS = ("report", "cli", "serve")
#: Keys of the ledger's records and sessions: a view reads them as typed records through
#: ``swarm.store`` (:mod:`swarm.store.reads`, the ledger, the session store), never itself.
RECORD_KEYS = {"agent", "run", "swarm", "session", "swarm_agents", "swarm_counters",
               "swarms_index", "events"}


def record_keys_named(path: Path) -> list[str]:
    """``path:line keys.x`` for every record key ``path`` names (``keys.x`` of
    :data:`RECORD_KEYS`)."""
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path}:{node.lineno} keys.{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "keys" and node.attr in RECORD_KEYS]


def test_record_keys_named_are_seen(tmp_path: Path) -> None:
    path = tmp_path / "probe.py"
    path.write_text("x = keys.agent('a')\ny = keys.session_id_for('/')\n")
    assert record_keys_named(path) == [f"{path}:1 keys.agent"]


def test_views_read_records_through_the_store() -> None:
    named = [hit for unit_ in VIEWS for path in sorted((PACKAGE / unit_).rglob("*.py"))
             for hit in record_keys_named(path)]
    assert not named, ("views that read a record's key themselves (read it through "
                       "swarm.store instead):\n" + "\n".join(named))
