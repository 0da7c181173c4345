"""The filesystem-first agent folder: a file's presence is the switch, no registry.

- ``AGENTS.md`` and ``.swarm/instructions.md`` join the system prompt;
- ``.swarm/skills/<name>.md`` are listed by name and first line, loaded on demand;
- ``.swarm/tools/<name>.py`` define typed tools: a ``run(...)`` function with type hints.

A tool file is code the agent's own commands may have written: the process that reads the
folder (a worker, as root, with the model key and the Redis password in its memory) never
runs it. Its schema is read from its syntax (:func:`_load_tool`), and a call runs it in the
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

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}

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
                    raise _Skip("it is a link to a file outside the workspace")
                tools.append(_load_tool(path))
            except _Skip as exc:
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


class _Skip(Exception):
    """A tool file that cannot be used; the message says why."""


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


#: Where a typed tool's types may come from: these modules' names (``from typing import
#: Literal``, ``typing.Literal``) and the builtins (unless the file binds their name).
_TYPING = ("typing", "typing_extensions")
_BUILTIN_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "list": list,
                  "dict": dict}
_TYPING_NAMES = {"Any", "Literal", "Optional", "Union", "Annotated", "List", "Dict"}
_WRITE_IT = ("a tool's file is never run to read its schema: write the type out in run's "
             "signature with str, int, float, bool, Any, Literal[...], list[...], "
             "dict[str, ...], X | None, Optional[X] or Annotated[T, \"doc\"] (the typing "
             "names imported from typing), or give PARAMETERS = {...}, a JSON schema written "
             "as a literal")


def _load_tool(path: Path) -> TypedTool:
    """The tool of ``path``, described from its source alone: the file is parsed, never
    run (it runs, in the agent's box, when the tool is called)."""
    name = path.stem
    if not TOOL_NAME.match(name):
        raise _Skip(f"the name {name!r} must match {TOOL_NAME.pattern}")
    if name in BUILTIN_TOOLS:
        raise _Skip(f"the name {name!r} clashes with the built-in tool {name}; rename the file")
    try:
        size = path.stat().st_size
        if size > SOURCE_MAX:
            raise _Skip(f"it is {size} bytes, over the {SOURCE_MAX} a tool's file may have")
        source = path.read_bytes()
    except OSError as exc:
        raise _Skip(f"it cannot be read: {exc.strerror or exc}") from None
    try:
        tree = ast.parse(source, str(path))
    except SyntaxError as exc:
        raise _Skip(f"SyntaxError at line {exc.lineno}: {exc.msg}") from None
    except (ValueError, MemoryError, RecursionError) as exc:  # a NUL byte, too deep
        raise _Skip(f"it cannot be parsed: {type(exc).__name__}: {exc}") from None
    scope = _Scope(tree)
    fn = scope.bound.get("run")
    if isinstance(fn, ast.AsyncFunctionDef):
        raise _Skip("run must be a plain function, not async")
    if not isinstance(fn, ast.FunctionDef):
        raise _Skip("it defines no function run(...)")
    if fn.decorator_list:
        raise _Skip("run has a decorator, which could change it in ways a file that is "
                    "never run does not tell; remove the decorator")
    description = ast.get_docstring(tree) or ast.get_docstring(fn) or f"The {name} tool."
    override = scope.bound.get("PARAMETERS")
    nullable: tuple[str, ...] = ()
    if override is not None:
        parameters = _literal_parameters(override)
    else:
        try:
            parameters, nullable = _parameters(fn, scope)
        except RecursionError:
            raise _Skip("run's type hints are nested too deeply to read") from None
    wants = any(a.arg == "workspace" for a in (*fn.args.args, *fn.args.kwonlyargs))
    return TypedTool(name=name, description=description, parameters=parameters, path=path,
                     nullable=nullable, wants_workspace=wants)


def _literal_parameters(node: ast.AST) -> dict[str, Any]:
    """``PARAMETERS = {...}``, read as a literal and checked as a JSON schema."""
    value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
    if value is None:
        raise _Skip("PARAMETERS must be assigned a dict holding a JSON schema")
    try:
        override = ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise _Skip("PARAMETERS must be a literal dict (a JSON schema written out: no "
                    "names, calls or expressions), as a tool's file is never run to read "
                    "it") from None
    if not isinstance(override, dict):
        raise _Skip("PARAMETERS must be a dict holding a JSON schema")
    from jsonschema import Draft202012Validator, SchemaError

    try:
        Draft202012Validator.check_schema(override)
    except SchemaError as exc:
        raise _Skip(f"PARAMETERS is not a valid JSON schema: {exc.message}") from None
    return override


class _Scope:
    """What a tool file's top level binds, read from its syntax: the last statement that
    binds each name (outside functions and classes), and where typing's names are."""

    def __init__(self, tree: ast.Module) -> None:
        self.bound: dict[str, ast.AST] = {}
        self.typing_modules: set[str] = set()
        """Names bound to the typing module itself (``import typing as t``)."""
        self.typing_names: dict[str, str] = {}
        """Names bound to typing's (``from typing import Optional as Opt``: Opt -> Optional)."""
        self._visit(tree.body)

    def _visit(self, body: list[ast.stmt]) -> None:
        for node in body:
            self._bind(node)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            for field_name in ("body", "orelse", "finalbody", "handlers", "cases"):
                for inner in getattr(node, field_name, None) or ():
                    if isinstance(inner, ast.stmt):
                        self._visit([inner])
                    elif isinstance(inner, ast.ExceptHandler | ast.match_case):
                        for name in _caught(inner):
                            self._forget(name)
                            self.bound[name] = node
                        self._visit(inner.body)

    def _bind(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                self._forget(bound)
                if alias.name in _TYPING:
                    self.typing_modules.add(bound)
                else:
                    self.bound[bound] = node
            return
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if node.module in _TYPING and not node.level:
                    if alias.name == "*":
                        for name in _TYPING_NAMES:
                            self._forget(name)
                            self.typing_names[name] = name
                    else:
                        self._forget(alias.asname or alias.name)
                        self.typing_names[alias.asname or alias.name] = alias.name
                elif alias.name != "*":
                    self._forget(alias.asname or alias.name)
                    self.bound[alias.asname or alias.name] = node
            return
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [node.name]
        else:
            names = _stored(node)
        for name in names:
            self._forget(name)
            self.bound[name] = node

    def _forget(self, name: str) -> None:
        self.bound.pop(name, None)
        self.typing_names.pop(name, None)
        self.typing_modules.discard(name)

    def resolve(self, node: ast.expr) -> str:
        """What a name in a type stands for: a typing name (``"Literal"``), a builtin
        (``"str"``), or :class:`_Skip` saying why it cannot be known without running."""
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in self.typing_modules:
            return node.attr if node.attr in _TYPING_NAMES else f"typing.{node.attr}"
        if not isinstance(node, ast.Name):
            raise _Skip(f"the type {ast.unparse(node)} cannot be read without running the "
                        f"file; {_WRITE_IT}")
        name = node.id
        if name in self.typing_names:
            return self.typing_names[name]
        where = self.bound.get(name)
        if isinstance(where, ast.Import | ast.ImportFrom):
            source = where.module if isinstance(where, ast.ImportFrom) else name
            raise _Skip(f"the type {name} is imported from {source or 'a module'}, and "
                        f"{_WRITE_IT}")
        if where is not None:
            raise _Skip(f"the type {name} is defined in the file (line "
                        f"{getattr(where, 'lineno', '?')}), and {_WRITE_IT}")
        return name


def _caught(node: ast.ExceptHandler | ast.match_case) -> list[str]:
    """The names ``except E as NAME`` or a ``case`` pattern binds."""
    if isinstance(node, ast.ExceptHandler):
        return [node.name] if node.name else []
    names: list[str] = []
    for sub in ast.walk(node.pattern):
        if isinstance(sub, ast.MatchAs | ast.MatchStar) and sub.name:
            names.append(sub.name)
        elif isinstance(sub, ast.MatchMapping) and sub.rest:
            names.append(sub.rest)
    return names


def _stored(node: ast.AST) -> list[str]:
    """The names a statement binds itself (not those of the statements it holds)."""
    names: list[str] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.stmt | ast.excepthandler | ast.match_case):
            continue
        if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store | ast.Del):
            names.append(child.id)
        names.extend(_stored(child))
    return names


def _parameters(fn: ast.FunctionDef, scope: _Scope) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The JSON schema of ``run``'s parameters, and those that are ``X | None`` with no
    default, from its signature's syntax."""
    args = fn.args
    if args.posonlyargs:
        raise _Skip(f"run's parameter {args.posonlyargs[0].arg!r} must be a plain named "
                    "parameter")
    plain = list(zip(args.args, [None] * (len(args.args) - len(args.defaults))
                     + list(args.defaults), strict=True))
    if args.vararg is not None:
        raise _Skip(f"run's parameter {args.vararg.arg!r} must be a plain named parameter")
    plain += list(zip(args.kwonlyargs, args.kw_defaults, strict=True))
    if args.kwarg is not None:
        raise _Skip(f"run's parameter {args.kwarg.arg!r} must be a plain named parameter")
    properties: dict[str, Any] = {}
    required: list[str] = []
    nullable: list[str] = []
    for param, default in plain:
        pname = param.arg
        if pname == "workspace":
            continue
        if param.annotation is None:
            raise _Skip(f"run's parameter {pname!r} has no type hint")
        try:
            hint = _Hint.of(param.annotation, scope)
            hint, doc = hint.unannotated()
            inner, optional = hint.strip_none()
            prop = inner.schema()
        except _Skip as exc:
            raise _Skip(f"run's parameter {pname!r}: {exc}") from None
        if doc:
            prop = {**prop, "description": doc}
        if default is not None:
            value = _literal(default)
            if value is not None and value is not _NOT_LITERAL and _jsonable(value):
                prop = {**prop, "default": json.loads(json.dumps(value))}
        properties[pname] = prop
        if default is None and not optional:
            required.append(pname)
        elif default is None:
            nullable.append(pname)
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    schema["additionalProperties"] = False
    return schema, tuple(nullable)


_NOT_LITERAL = object()


def _literal(node: ast.expr) -> Any:
    """The value of a literal (``_NOT_LITERAL`` for anything else)."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_LITERAL


@dataclass(frozen=True)
class _Hint:
    """A type hint from the syntax: what its head stands for, and its arguments."""

    node: ast.expr
    head: str
    """``"str"``, ``"Literal"``, ``"|"`` (a union written with ``|``), ``"None"``..."""
    args: tuple[ast.expr, ...]
    scope: _Scope

    @classmethod
    def of(cls, node: ast.expr, scope: _Scope) -> _Hint:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            try:  # a quoted hint: "int", "list[str]"
                parsed = ast.parse(text.strip(), mode="eval").body
            except SyntaxError:
                raise _Skip(f"the type {text!r} is not a valid expression") from None
            return cls.of(parsed, scope)
        if isinstance(node, ast.Constant) and node.value is None:
            return cls(node, "None", (), scope)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return cls(node, "|", tuple(_union_members(node)), scope)
        if isinstance(node, ast.Subscript):
            inner = node.slice
            args = tuple(inner.elts) if isinstance(inner, ast.Tuple) else (inner,)
            return cls(node, scope.resolve(node.value), args, scope)
        return cls(node, scope.resolve(node), (), scope)

    @property
    def name(self) -> str:
        return ast.unparse(self.node).replace("typing.", "")

    def unannotated(self) -> tuple[_Hint, str]:
        """``Annotated[T, "text"]`` -> (T, "text"); anything else -> (self, "")."""
        if self.head != "Annotated" or not self.args:
            return self, ""
        doc = next((v for v in map(_literal, self.args[1:]) if isinstance(v, str)), "")
        return _Hint.of(self.args[0], self.scope), doc

    def members(self) -> list[_Hint]:
        """The members of a union (``X | Y``, ``Union[X, Y]``, ``Optional[X]``), flattened;
        [self] for anything else."""
        if self.head == "|" or self.head == "Union":
            return [m for a in self.args for m in _Hint.of(a, self.scope).members()]
        if self.head == "Optional" and len(self.args) == 1:
            return [*_Hint.of(self.args[0], self.scope).members(),
                    _Hint(ast.Constant(None), "None", (), self.scope)]
        return [self]

    def strip_none(self) -> tuple[_Hint, bool]:
        """``X | None`` -> (X, True); anything else -> (self, False)."""
        members = self.members()
        others = [m for m in members if m.head != "None"]
        if len(others) < len(members):
            if len(others) == 1:
                return others[0], True
            raise _Skip(f"the type {self.name} cannot be mapped to JSON schema")
        return self, False

    def schema(self) -> dict[str, Any]:
        hint, _ = self.unannotated()
        if hint is not self:
            return hint.schema()
        if self.head in ("str", "int", "float", "bool") and not self.args \
                and isinstance(self.node, ast.Name | ast.Attribute):
            return {"type": _JSON_TYPES[_BUILTIN_TYPES[self.head]]}
        if self.head == "Any" and not self.args:
            return {}
        if self.head == "Literal":
            values = [_literal(a) for a in self.args]
            if any(v is _NOT_LITERAL for v in values):
                raise _Skip(f"the values of {self.name} must be literals")
            values = list(dict.fromkeys((type(v), v) for v in values))  # as typing dedupes
            kinds = {_JSON_TYPES.get(t) for t, _ in values}
            if None in kinds:
                raise _Skip(f"the Literal values of {self.name} must be str, int or bool")
            plain = [v for _, v in values]
            if len(kinds) == 1:
                return {"type": kinds.pop(), "enum": plain}
            return {"enum": plain}
        if self.head in ("list", "List"):
            if not self.args:
                return {"type": "array"}
            return {"type": "array", "items": _Hint.of(self.args[0], self.scope).schema()}
        if self.head in ("dict", "Dict"):
            if not self.args:
                return {"type": "object"}
            key = _Hint.of(self.args[0], self.scope).unannotated()[0]
            if key.head != "str" or len(self.args) != 2:
                raise _Skip(f"{self.name}: JSON object keys are strings, use dict[str, ...]")
            item = _Hint.of(self.args[1], self.scope).schema()
            return {"type": "object", "additionalProperties": item} if item else {"type": "object"}
        raise _Skip(f"the type {self.name} cannot be mapped to JSON schema")


def _union_members(node: ast.expr) -> list[ast.expr]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return [*_union_members(node.left), *_union_members(node.right)]
    return [node]


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
