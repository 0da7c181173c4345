"""AgentFolder: instructions, skills and typed tools straight from the workspace files."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import jsonschema
import pytest

from swarm.agent.folder import AgentFolder, Skill
from swarm.errors import ToolError


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())


def test_instructions_from_both_files(tmp_path: Path) -> None:
    assert AgentFolder(tmp_path).instructions() == ""
    _write(tmp_path / "AGENTS.md", "Use tabs.\n")
    _write(tmp_path / ".swarm/instructions.md", "Never push.\n")
    assert AgentFolder(tmp_path).instructions() == (
        "## AGENTS.md\n\nUse tabs.\n\n## .swarm/instructions.md\n\nNever push."
    )


def test_instructions_capped_with_a_note(tmp_path: Path) -> None:
    _write(tmp_path / "AGENTS.md", "a" * 25_000)
    text = AgentFolder(tmp_path).instructions()
    note = "\n[... 5000 more characters of AGENTS.md cut]"
    assert text == "## AGENTS.md\n\n" + "a" * 20_000 + note


def test_skills_listed_loaded_and_traversal_refused(tmp_path: Path) -> None:
    folder = AgentFolder(tmp_path)
    assert folder.skills() == []
    skills_dir = tmp_path / ".swarm/skills"
    _write(skills_dir / "deploy.md", "\n\n# Deploy the app  \nsteps...\n")
    _write(skills_dir / "lint.md", "Run ruff first.\n")
    _write(skills_dir / "notes.txt", "not a skill")
    _write(tmp_path / ".swarm/secret.md", "do not read")
    assert folder.skills() == [
        Skill("deploy", "Deploy the app", skills_dir / "deploy.md"),
        Skill("lint", "Run ruff first.", skills_dir / "lint.md"),
    ]
    assert folder.load_skill("lint") == "Run ruff first.\n"
    for bad in ("../secret", "nope", "notes", "deploy.md", ""):
        with pytest.raises(ToolError, match="available skills: deploy, lint"):
            folder.load_skill(bad)


GOOD_TOOL = '''
"""Count words in a file of the workspace."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal


def run(
    path: Annotated[str, "file to read, relative to the workspace"],
    workspace: Path,
    note: str | None,
    min_len: int = 1,
    ratio: float | None = None,
    tags: list[str] | None = None,
    ids: list[int] = [],  # noqa: B006
    flag: bool = False,
    mode: Literal["words", "lines"] = "words",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    text = (workspace / path).read_text()
    items = text.split() if mode == "words" else text.splitlines()
    return {"count": len([w for w in items if len(w) >= min_len]), "note": note,
            "flag": flag, "tags": tags, "where": workspace}
'''


def test_typed_tools_schema_and_call(tmp_path: Path) -> None:
    _write(tmp_path / ".swarm/tools/count_words.py", GOOD_TOOL)
    (tmp_path / "doc.txt").write_text("a bb ccc\ndd\n")
    tools, errors = AgentFolder(tmp_path).typed_tools()
    assert errors == []
    (tool,) = tools
    assert tool.schema() == {
        "type": "function",
        "function": {
            "name": "count_words",
            "description": "Count words in a file of the workspace.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string",
                             "description": "file to read, relative to the workspace"},
                    "note": {"type": "string"},
                    "min_len": {"type": "integer", "default": 1},
                    "ratio": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "ids": {"type": "array", "items": {"type": "integer"}, "default": []},
                    "flag": {"type": "boolean", "default": False},
                    "mode": {"type": "string", "enum": ["words", "lines"], "default": "words"},
                    "extra": {"type": "object"},
                },
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    }
    out = json.loads(tool.call({"path": "doc.txt", "min_len": 2, "tags": ["x"]}, tmp_path))
    assert out == {"count": 3, "note": None, "flag": False, "tags": ["x"],
                   "where": str(tmp_path)}
    out = json.loads(tool.call({"path": "doc.txt", "mode": "lines", "note": None}, tmp_path))
    assert out["count"] == 2
    with pytest.raises(ToolError, match="count_words: bad arguments"):
        tool.call({"path": "doc.txt", "bogus": 1}, tmp_path)
    with pytest.raises(ToolError, match="count_words: bad arguments at min_len"):
        tool.call({"path": "doc.txt", "min_len": "two"}, tmp_path)


def test_broken_tools_are_skipped_with_reasons(tmp_path: Path) -> None:
    tools_dir = tmp_path / ".swarm/tools"
    _write(tools_dir / "good.py", '''
        def run(text: str) -> str:
            """Shout."""
            return text.upper()
    ''')
    _write(tools_dir / "broken.py", "x = 1\ny = 2\ndef run(:\n    pass\n")
    _write(tools_dir / "no_run.py", "VALUE = 1\n")
    _write(tools_dir / "odd_type.py", "def run(items: set[int]) -> str:\n    return ''\n")
    _write(tools_dir / "no_hint.py", "def run(items) -> str:\n    return ''\n")
    _write(tools_dir / "run_cli.py", "def run(command: str) -> str:\n    return ''\n")
    _write(tools_dir / "bad name.py", "def run() -> str:\n    return ''\n")
    _write(tools_dir / "imports.py", "import no_such_module_xyz\n")
    tools, errors = AgentFolder(tmp_path).typed_tools()
    assert [t.name for t in tools] == ["good"]
    assert tools[0].description == "Shout."
    assert tools[0].call({"text": "hi"}, tmp_path) == "HI"
    assert errors == [
        ".swarm/tools/bad name.py skipped: the name 'bad name' must match "
        "^[A-Za-z_][A-Za-z0-9_-]{0,63}$",
        ".swarm/tools/broken.py skipped: SyntaxError at line 3: invalid syntax",
        ".swarm/tools/imports.py skipped: ModuleNotFoundError: "
        "No module named 'no_such_module_xyz'",
        ".swarm/tools/no_hint.py skipped: run's parameter 'items' has no type hint",
        ".swarm/tools/no_run.py skipped: it defines no function run(...)",
        ".swarm/tools/odd_type.py skipped: run's parameter 'items': "
        "the type set[int] cannot be mapped to JSON schema",
        ".swarm/tools/run_cli.py skipped: the name 'run_cli' clashes with the built-in "
        "tool run_cli; rename the file",
    ]


def test_parameters_override_and_failing_tool(tmp_path: Path) -> None:
    _write(tmp_path / ".swarm/tools/custom.py", '''
        PARAMETERS = {"type": "object", "properties": {"n": {"type": "integer"}},
                      "required": ["n"], "additionalProperties": False}

        def run(n: object) -> int:
            """Invert n."""
            return 1 // n
    ''')
    (tool,), errors = AgentFolder(tmp_path).typed_tools()
    assert errors == []
    assert tool.parameters["properties"] == {"n": {"type": "integer"}}
    assert tool.call({"n": 1}, tmp_path) == "1"
    with pytest.raises(ToolError, match=r"^custom failed: ZeroDivisionError: "):
        tool.call({"n": 0}, tmp_path)


def test_no_tools_folder(tmp_path: Path) -> None:
    assert AgentFolder(tmp_path).typed_tools() == ([], [])


def test_a_long_result_is_cut_to_head_and_tail(tmp_path: Path) -> None:
    _write(tmp_path / ".swarm/tools/flood.py", '''
        def run(n: int) -> str:
            """Flood."""
            return "H" * 5 + "x" * (n - 10) + "T" * 5
    ''')
    (tool,), _ = AgentFolder(tmp_path).typed_tools()
    assert tool.call({"n": 20_000}, tmp_path) == "HHHHH" + "x" * 19_990 + "TTTTT"
    out = tool.call({"n": 1_000_000}, tmp_path)
    assert len(out) < 20_100
    head, marker, tail = out.split("\n")
    assert head.startswith("HHHHHx") and len(head) == 10_000
    assert tail.endswith("xTTTTT") and len(tail) == 10_000
    assert marker == "[... 980000 characters cut ...]"
    out = tool.call({"n": 100}, tmp_path, output_cap=20)
    assert out == "HHHHHxxxxx\n[... 80 characters cut ...]\nxxxxxTTTTT"


def test_a_result_that_is_not_json_is_a_tool_error(tmp_path: Path) -> None:
    _write(tmp_path / ".swarm/tools/loop.py", '''
        def run() -> list:
            """Circular."""
            items: list = []
            items.append(items)
            return items
    ''')
    (tool,), _ = AgentFolder(tmp_path).typed_tools()
    with pytest.raises(ToolError, match="loop returned a value that cannot be sent as JSON"):
        tool.call({}, tmp_path)


def test_arguments_are_checked_without_checking_the_schema_each_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path / ".swarm/tools/count_words.py", GOOD_TOOL)
    (tmp_path / "doc.txt").write_text("a b\n")
    (tool,), _ = AgentFolder(tmp_path).typed_tools()
    checked: list[object] = []
    monkeypatch.setattr(jsonschema.Draft202012Validator, "check_schema",
                        classmethod(lambda cls, schema, **kw: checked.append(schema)))
    for _ in range(3):
        assert json.loads(tool.call({"path": "doc.txt"}, tmp_path))["count"] == 2
        with pytest.raises(ToolError, match="bad arguments at min_len"):
            tool.call({"path": "doc.txt", "min_len": "two"}, tmp_path)
    assert checked == []
