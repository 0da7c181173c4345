"""The docs match the code: every ``SWARM_*`` variable the package reads has a knob in
``swarm.config.KNOBS`` (and the README names each user setting), every ``swarm`` command
is in the README's command table, and no file cites a repository file that is missing."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import click

from swarm.cli import main
from swarm.config import KNOBS, Settings

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "swarm"
README = ROOT / "README.md"
#: A string that is a variable's whole name, or its start before a computed part.
VAR = re.compile(r"SWARM_[A-Z0-9_]*")


def knob_vars() -> set[str]:
    return {var for knob in KNOBS.values() for var in knob.env}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of ``tree`` (they name variables without reading them)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) \
                and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant):
            out.add(id(body[0].value))
    return out


def names_in_source(source: str) -> tuple[set[str], set[str]]:
    """The ``SWARM_*`` names a module can read, and the prefixes of computed ones.

    A name is read through a string that is exactly that name (``environ.get("SWARM_X")``,
    ``envvar="SWARM_X"``, ``FD_VAR = "SWARM_X"`` read later); a computed one starts as a
    string ending in ``_`` (``f"SWARM_PRICE_{kind}"``, ``"SWARM_PRICE_" + kind``). Strings
    that merely mention a variable (``"set SWARM_X"``) do neither.
    """
    tree = ast.parse(source)
    skip = _docstrings(tree)
    names: set[str] = set()
    prefixes: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            first = node.values[0] if node.values else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str) \
                    and len(node.values) > 1 and VAR.fullmatch(first.value):
                prefixes.add(first.value)
            skip.update(id(v) for v in node.values)  # parts of an f-string, handled here
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) \
                and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str) \
                and VAR.fullmatch(node.left.value) and node.left.value.endswith("_"):
            prefixes.add(node.left.value)
            skip.add(id(node.left))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in skip and VAR.fullmatch(node.value):
            (prefixes if node.value.endswith("_") else names).add(node.value)
    return names, prefixes


def package_vars(top: Path = PACKAGE) -> Iterator[tuple[str, str]]:
    """(file, name-or-prefix) of every variable the code under ``top`` reads."""
    for path in sorted(top.rglob("*.py")):
        if path == Path(__file__).resolve():
            continue
        names, prefixes = names_in_source(path.read_text(encoding="utf-8"))
        for name in sorted(names | prefixes):
            yield str(path.relative_to(ROOT)), name


def missing_knobs(found: Iterable[tuple[str, str]], known: set[str]) -> list[str]:
    return [f"{file}: {name}" for file, name in found
            if not (name in known if not name.endswith("_")
                    else any(var.startswith(name) for var in known))]


def test_the_scanner_finds_reads_and_skips_mentions() -> None:
    source = '''
"""Module doc naming SWARM_DOCSTRING."""
import os
import click
FD = "SWARM_INDIRECT"
a = os.environ.get("SWARM_GET")
b = os.environ["SWARM_ITEM"]
c = os.getenv("SWARM_GETENV", "")
d = click.option("--x", envvar="SWARM_ENVVAR")
e = os.environ.get(f"SWARM_PRICE_{kind}")
f = os.environ.get("SWARM_COST_" + kind)
g = f"SWARM_BASE_URL={url!r} is not an http(s) URL"
h = "set SWARM_MENTIONED to fix it"
def fn():
    """SWARM_FUNCDOC"""
'''
    names, prefixes = names_in_source(source)
    assert names == {"SWARM_INDIRECT", "SWARM_GET", "SWARM_ITEM", "SWARM_GETENV",
                     "SWARM_ENVVAR"}
    assert prefixes == {"SWARM_PRICE_", "SWARM_COST_"}
    assert missing_knobs([("m.py", "SWARM_PRICE_"), ("m.py", "SWARM_COST_")],
                         {"SWARM_PRICE_INPUT"}) == ["m.py: SWARM_COST_"]


def test_every_variable_the_package_reads_has_a_knob() -> None:
    found = list(package_vars())
    # The scan sees the ways the package reads variables today, so it is not vacuous.
    seen = {name for _, name in found}
    assert {"SWARM_WORKER_CONCURRENCY", "SWARM_SERVE_TOKEN", "SWARM_PRICE_INPUT",
            "SWARM_SECRETS_FD", "SWARM_PARENT_PID"} <= seen
    missing = missing_knobs(found, knob_vars())
    assert not missing, ("read by the package but not in swarm.config.KNOBS (add a Knob with "
                         f"help, read_by for a non-Settings one): {missing}")


def test_knobs_and_settings_fields_agree() -> None:
    fields = set(Settings.__dataclass_fields__) - {"explicit"}
    assert {name for name, knob in KNOBS.items() if not knob.read_by} == fields
    for name, knob in KNOBS.items():
        assert knob.help and knob.env, name
        assert not knob.internal or knob.read_by, f"{name}: internal knobs name their reader"


def test_the_readme_names_every_user_setting() -> None:
    readme = README.read_text(encoding="utf-8")
    unnamed = sorted(knob.env[0] for knob in KNOBS.values()
                     if not knob.internal and f"`{knob.env[0]}`" not in readme)
    assert not unnamed, f"README.md's Configuration table lacks: {unnamed}"


def test_the_docs_name_only_variables_that_exist() -> None:
    """A variable in the docs or .env.example that no code reads is a dead end."""
    known = knob_vars() | {"SWARM_ID", "SWARM_IMAGE"}  # a placeholder; compose's image tag
    known |= {name for top in ("tests", "bench") for _, name in package_vars(ROOT / top)}
    for doc in ("README.md", "docs/deploy.md", ".env.example", "docker-compose.yml"):
        text = (ROOT / doc).read_text(encoding="utf-8")
        unknown = sorted({m for m in re.findall(r"SWARM_[A-Z0-9_]*[A-Z0-9]", text)} - known)
        assert not unknown, f"{doc} names variables swarm does not read: {unknown}"


def command_table(readme: str) -> list[str]:
    """The first cells of the README's command table (the one headed ``| command |``)."""
    lines = readme.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| command |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1])
    return rows


def test_every_command_is_in_the_readme_table() -> None:
    rows = command_table(README.read_text(encoding="utf-8"))
    listed = {m for row in rows for m in re.findall(r"`swarm ([a-z][a-z-]*)", row)}
    registered = main.all_commands()
    commands = set(registered)
    assert commands, "no commands registered"
    assert not commands - listed, f"README.md's command table lacks: {commands - listed}"
    assert not listed - commands, f"README.md's command table names no command: " \
                                  f"{listed - commands}"
    for name, command in registered.items():
        if isinstance(command, click.Group):
            row = " ".join(r for r in rows if f"`swarm {name}" in r)
            absent = [sub for sub in command.commands if not re.search(rf"\b{sub}\b", row)]
            assert not absent, f"README.md's row of `swarm {name}` lacks {absent}"


#: Files that name repository files (comments, docstrings, docs). bench/results holds the
#: benchmarks' output: its files are written by a run, not kept.
CITING = ("swarm", "tests", "bench", "docs", "scripts", "examples")
#: A path inside the repository (not ``.swarm/...`` in a user's folder, not a URL part).
REPO_PATH = re.compile(r"(?<![\w./-])((?:swarm|tests|bench|docs|scripts|examples|requirements)/"
                       r"[\w./-]*\w\.(?:md|py|txt|json|toml|ya?ml|png|html|cfg|ini))\b")
#: A top-level document such as ``README.md`` (``AGENTS.md`` is a user's, not ours).
TOP_DOC = re.compile(r"(?<![\w./-])([A-Z][A-Z0-9_]+\.md)\b")


def citing_files() -> Iterator[Path]:
    for top in CITING:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".md", ".txt", ".toml", ".yml", "") \
                    and "results" not in path.relative_to(ROOT).parts \
                    and "__pycache__" not in path.parts:
                yield path
    yield from (p for p in sorted(ROOT.iterdir()) if p.is_file() and p.suffix in (".md", ".yml",
                                                                                  ".toml"))
    yield ROOT / "Dockerfile"
    yield ROOT / ".env.example"


def test_no_file_cites_a_missing_repository_file() -> None:
    dead = []
    for path in citing_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        cited = set(REPO_PATH.findall(text)) | {
            doc for doc in TOP_DOC.findall(text) if doc not in ("AGENTS.md", "NAME.md")}
        dead += [f"{path.relative_to(ROOT)}: {name}" for name in sorted(cited)
                 if not (ROOT / name).exists() and not name.startswith("bench/results/")]
    assert not dead, f"cited but not in the repository: {dead}"


#: A test named with its file, as the docs cite one: the path under ``tests/``, ``::``,
#: the test's name.
CITED_TEST = re.compile(r"(?<![\w./-])(tests/[\w/]+\.py)::(\w+)")


def test_every_test_the_docs_cite_exists() -> None:
    """The threat model (docs/deploy.md) backs each claim with a test by name: a test
    renamed or removed must not leave a claim standing on nothing."""
    cited: dict[str, set[str]] = {}
    for path in citing_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for file, name in CITED_TEST.findall(text):
            cited.setdefault(file, set()).add(name)
    # Not vacuous: the threat model cites tests of the sandbox and of the API.
    assert {"tests/test_sandbox_escape.py", "tests/test_serve.py"} <= set(cited), cited
    dead = []
    for file, names in sorted(cited.items()):
        source = (ROOT / file).read_text(encoding="utf-8") if (ROOT / file).exists() else ""
        defined = {node.name for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
        dead += [f"{file}::{name}" for name in sorted(names - defined)]
    assert not dead, f"cited but not a test in the repository: {dead}"
