"""The filesystem-first agent folder: a file's presence is the switch, no registry.

- ``AGENTS.md`` and ``.swarm/instructions.md`` join the system prompt;
- ``.swarm/skills/<name>.md`` are listed by name and first line, loaded on demand;
- ``.swarm/tools/<name>.py`` define typed tools: a ``run(...)`` function with type hints.

A tool file is code the agent's own commands may have written: the process that reads the
folder (a worker, as root, with the model key and the Redis password in its memory) never
runs it. Its schema is read from its syntax (:func:`_load_tool`, with
:mod:`swarm.agent.tool_schema`), and a call runs it in the
agent's command environment, its box on a worker (:meth:`TypedTool.call`, through
:mod:`swarm.agent.tool_runner`).
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import sys
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.agent.protocols import Environment
from swarm.agent.tool_schema import Scope, Unusable, literal_parameters, parameters_of
from swarm.errors import ToolError

if TYPE_CHECKING:  # jsonschema is imported when a tool is checked (see swarm.agent.tools)
    import jsonschema

INSTRUCTION_FILES = ("AGENTS.md", ".swarm/instructions.md")
INSTRUCTIONS_CAP = 20_000
SKILLS_DIR = ".swarm/skills"
TOOLS_DIR = ".swarm/tools"
BUILTIN_TOOLS = frozenset({"run_cli", "agent", "load_skill", "leave_memory_hints"})
TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
OUTPUT_CAP = 20_000
"""Characters of a typed tool's result kept (head and tail), so no tool floods the context."""
SOURCE_MAX = 1_000_000
"""Bytes of a tool file read to describe it."""
ARGUMENTS_MAX = 100_000
"""Bytes of a call's arguments (as JSON): they travel on the runner's command line, where
one argument holds at most 128 KiB (:data:`COMMAND_MAX` for the whole, quoted)."""
COMMAND_MAX = 120_000
_SUMMARY_MAX = 200

#: The line the runner ends with (:data:`swarm.agent.tool_runner.MARK`).
MARK = "\x1eswarm-tool-result:"
NO_PYTHON = ("[no python3 in the box: typed tools run with the python3 on the commands' PATH, "
             "or the worker's own python when the box can read it; install python3]")


@cache
def _runner_source() -> str:
    return Path(__file__).with_name("tool_runner.py").read_text(encoding="utf-8")


@dataclass(frozen=True)
class Skill:
    """A skill file: its name (the file stem), its first line, and where it is."""

    name: str
    summary: str
    path: Path


@dataclass(frozen=True)
class TypedTool:
    """A tool defined by ``.swarm/tools/<name>.py``, described from its source."""

    name: str
    description: str
    parameters: dict[str, Any]
    path: Path
    nullable: tuple[str, ...] = field(default=(), repr=False)
    """Parameters typed ``X | None`` without a default: passed as None when left out."""
    wants_workspace: bool = False
    """``run`` has a ``workspace`` parameter: it gets the workspace's path."""

    def schema(self) -> dict[str, Any]:
        """The tool in the OpenAI ``tools`` form."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    @cached_property
    def _validator(self) -> jsonschema.Draft202012Validator:
        # Built once: jsonschema.validate() would check the schema itself on every call.
        from jsonschema import Draft202012Validator

        return Draft202012Validator(self.parameters)

    def call(self, arguments: dict[str, Any], env: Environment, *, timeout: int = 300,
             output_cap: int = OUTPUT_CAP) -> str:
        """Run the tool in ``env`` (the agent's command environment: its box, its
        cancellation), for at most ``timeout`` seconds; raise :class:`ToolError` for bad
        arguments or when it fails.

        The arguments are checked here too, not only by ``swarm.agent.tools.parse_call``:
        this method is public and callers may use it directly. A result longer than
        ``output_cap`` characters keeps its head and tail, with a marker of what was cut.
        The file is read when the tool runs: as it is then, with the schema read when the
        agent started.
        """
        if output_cap <= 0:
            raise ValueError("output_cap must be positive")
        if not isinstance(arguments, dict):
            raise ToolError(f"{self.name}: arguments must be a JSON object")
        required = set(self.parameters.get("required", []))
        kwargs = {k: v for k, v in arguments.items() if v is not None or k in required}
        from jsonschema.exceptions import best_match

        error = best_match(self._validator.iter_errors(kwargs))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path)
            raise ToolError(
                f"{self.name}: bad arguments{f' at {where}' if where else ''}: {error.message}"
            )
        for name in self.nullable:
            kwargs.setdefault(name, None)
        payload = json.dumps({"kwargs": kwargs, "workspace": self.wants_workspace})
        command = runner_command(self.path, payload, env.workspace, output_cap, self.name)
        if len(payload.encode()) > ARGUMENTS_MAX or len(command.encode()) > COMMAND_MAX:
            raise ToolError(f"{self.name}: its arguments are {len(payload.encode())} bytes as "
                            f"JSON, more than a call may pass (at most {ARGUMENTS_MAX}, less "
                            "with many quotes); write the data to a file in the workspace "
                            "and pass its path")
        # Room for the envelope around a result of output_cap characters, each of which
        # JSON may write as six (a control character's \uXXXX).
        done = env.execute(command, timeout, output_cap=6 * output_cap + 4096)
        if done.cancelled:
            raise ToolError(f"{self.name} was cancelled: it and its processes were killed")
        if done.timed_out:
            raise ToolError(f"{self.name} failed: it ran for more than {timeout} s and was "
                            "killed")
        _, found, line = done.output.rpartition(MARK)
        try:
            envelope = json.loads(line) if found else None
        except ValueError:
            envelope = None
        if not isinstance(envelope, dict):
            said = done.output.rstrip("\n")[-1000:] or "no output"
            raise ToolError(f"{self.name} failed: it ended (exit code {done.exit_code}) "
                            f"without a result: {said}")
        if "error" in envelope:
            raise ToolError(f"{self.name} failed: {envelope['error']}")
        if "unjson" in envelope:
            raise ToolError(f"{self.name} returned a value that cannot be sent as JSON: "
                            f"{envelope['unjson']}")
        return str(envelope.get("result", ""))


def runner_command(path: Path, payload: str, workspace: Path, output_cap: int,
                   name: str) -> str:
    """The shell command that runs the tool file ``path`` with the JSON ``payload``
    (:mod:`swarm.agent.tool_runner`): with the ``python3`` on the commands' ``PATH``, else
    this process's own python where the command can run it."""
    try:
        rel = path.relative_to(workspace)
    except ValueError:
        rel = path
    q = shlex.quote
    return (f"p=$(command -v python3) || p={q(sys.executable)}; "
            f"[ -x \"$p\" ] || {{ echo {q(NO_PYTHON)}; exit 127; }}; "
            f"exec \"$p\" -c {q(_runner_source())} {q(str(rel))} {q(payload)} "
            f"{q(str(workspace))} {int(output_cap)} {q(name)}")


class AgentFolder:
    """Reads the agent folder of ``workspace``; every call looks at the files afresh,
    except :meth:`typed_tools`, which reads the tool files once."""

    def __init__(self, workspace: Path) -> None:
        self.workspace = Path(workspace)
        self._typed: tuple[list[TypedTool], list[str]] | None = None

    def instructions(self) -> str:
        """``AGENTS.md`` and ``.swarm/instructions.md``, each under a heading; "" when neither."""
        parts: list[str] = []
        for rel in INSTRUCTION_FILES:
            path = self.workspace / rel
            if not path.is_file():
                continue
            try:
                text = path.read_text(encoding="utf-8", errors="replace")
            except OSError as exc:
                parts.append(f"## {rel}\n\n[cannot read {rel}: {exc.strerror or exc}]")
                continue
            parts += _section(rel, text)
        return "\n\n".join(parts)

    def skills(self) -> list[Skill]:
        """Every ``.swarm/skills/*.md``, sorted by name."""
        folder = self.workspace / SKILLS_DIR
        if not folder.is_dir():
            return []
        found = []
        for path in sorted(folder.glob("*.md")):
            if path.is_file():
                found.append(Skill(name=path.stem, summary=_summary(path), path=path))
        return found

    def load_skill(self, name: str) -> str:
        """The text of skill ``name``; :class:`ToolError` naming the skills there are otherwise."""
        skills = {s.name: s for s in self.skills()}
        skill = skills.get(name)
        if skill is None:
            available = ", ".join(skills) or f"none (no {SKILLS_DIR}/*.md files)"
            raise ToolError(f"unknown skill {name!r}; available skills: {available}")
        try:
            return skill.path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise ToolError(f"cannot read skill {name!r}: {exc.strerror or exc}") from exc

    def typed_tools(self) -> tuple[list[TypedTool], list[str]]:
        """Load ``.swarm/tools/*.py``: the tools that loaded, and one message per skipped file.

        Read once per folder object, and never run: see :func:`_load_tool`.
        """
        if self._typed is None:
            self._typed = self._load_typed_tools()
        return self._typed

    def _load_typed_tools(self) -> tuple[list[TypedTool], list[str]]:
        folder = self.workspace / TOOLS_DIR
        if not folder.is_dir():
            return [], []
        tools: list[TypedTool] = []
        errors: list[str] = []
        top = self.workspace.resolve()
        for path in sorted(folder.glob("*.py")):
            if path.name == "__init__.py" or not path.is_file():
                continue
            try:
                if not path.resolve().is_relative_to(top):
                    # Read by the worker, as root on a root worker: never a file outside
                    # the workspace (a link to a key), whose text would become the schema.
                    raise Unusable("it is a link to a file outside the workspace")
                tools.append(_load_tool(path))
            except Unusable as exc:
                errors.append(f"{TOOLS_DIR}/{path.name} skipped: {exc}")
        return tools, errors


def instructions_of(texts: dict[str, str]) -> str:
    """What :meth:`AgentFolder.instructions` says of a folder whose instruction files hold
    ``texts`` (by path; a workspace's files read from its snapshot)."""
    return "\n\n".join(part for rel in INSTRUCTION_FILES if rel in texts
                        for part in _section(rel, texts[rel]))


def _section(rel: str, text: str) -> list[str]:
    """The instruction file ``rel`` under its heading, capped; nothing when empty."""
    text = text.strip()
    if not text:
        return []
    if len(text) > INSTRUCTIONS_CAP:
        left = len(text) - INSTRUCTIONS_CAP
        text = f"{text[:INSTRUCTIONS_CAP]}\n[... {left} more characters of {rel} cut]"
    return [f"## {rel}\n\n{text}"]


def _summary(path: Path) -> str:
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                text = line.strip().lstrip("#").strip()
                if text:
                    return text[:_SUMMARY_MAX]
    except OSError:
        pass
    return ""


def _load_tool(path: Path) -> TypedTool:
    """The tool of ``path``, described from its source alone: the file is parsed, never
    run (it runs, in the agent's box, when the tool is called)."""
    name = path.stem
    if not TOOL_NAME.match(name):
        raise Unusable(f"the name {name!r} must match {TOOL_NAME.pattern}")
    if name in BUILTIN_TOOLS:
        raise Unusable(f"the name {name!r} clashes with the built-in tool {name}; rename the file")
    try:
        size = path.stat().st_size
        if size > SOURCE_MAX:
            raise Unusable(f"it is {size} bytes, over the {SOURCE_MAX} a tool's file may have")
        source = path.read_bytes()
    except OSError as exc:
        raise Unusable(f"it cannot be read: {exc.strerror or exc}") from None
    try:
        tree = ast.parse(source, str(path))
    except SyntaxError as exc:
        raise Unusable(f"SyntaxError at line {exc.lineno}: {exc.msg}") from None
    except (ValueError, MemoryError, RecursionError) as exc:  # a NUL byte, too deep
        raise Unusable(f"it cannot be parsed: {type(exc).__name__}: {exc}") from None
    scope = Scope(tree)
    fn = scope.bound.get("run")
    if isinstance(fn, ast.AsyncFunctionDef):
        raise Unusable("run must be a plain function, not async")
    if not isinstance(fn, ast.FunctionDef):
        raise Unusable("it defines no function run(...)")
    if fn.decorator_list:
        raise Unusable("run has a decorator, which could change it in ways a file that is "
                    "never run does not tell; remove the decorator")
    description = ast.get_docstring(tree) or ast.get_docstring(fn) or f"The {name} tool."
    override = scope.bound.get("PARAMETERS")
    nullable: tuple[str, ...] = ()
    if override is not None:
        parameters = literal_parameters(override)
    else:
        try:
            parameters, nullable = parameters_of(fn, scope)
        except RecursionError:
            raise Unusable("run's type hints are nested too deeply to read") from None
    wants = any(a.arg == "workspace" for a in (*fn.args.args, *fn.args.kwonlyargs))
    return TypedTool(name=name, description=description, parameters=parameters, path=path,
                     nullable=nullable, wants_workspace=wants)
