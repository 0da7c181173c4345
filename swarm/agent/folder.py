"""The filesystem-first agent folder: a file's presence is the switch, no registry.

- ``AGENTS.md`` and ``.swarm/instructions.md`` join the system prompt;
- ``.swarm/skills/<name>.md`` are listed by name and first line, loaded on demand;
- ``.swarm/tools/<name>.py`` define typed tools: a ``run(...)`` function with type hints.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from swarm.errors import ToolError
from swarm.text import cap_middle

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
_SUMMARY_MAX = 200

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


@dataclass(frozen=True)
class Skill:
    """A skill file: its name (the file stem), its first line, and where it is."""

    name: str
    summary: str
    path: Path


@dataclass(frozen=True)
class TypedTool:
    """A tool defined by ``.swarm/tools/<name>.py``."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]
    nullable: tuple[str, ...] = field(default=(), repr=False)
    """Parameters typed ``X | None`` without a default: passed as None when left out."""

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

    def call(self, arguments: dict[str, Any], workspace: Path, *,
             output_cap: int = OUTPUT_CAP) -> str:
        """Run the tool; raise :class:`ToolError` for bad arguments or when it fails.

        The arguments are checked here too, not only by ``swarm.agent.tools.parse_call``:
        this method is public and callers may use it directly. A result longer than
        ``output_cap`` characters keeps its head and tail, with a marker of what was cut.
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
        if "workspace" in inspect.signature(self.fn).parameters:
            kwargs["workspace"] = workspace
        try:
            result = self.fn(**kwargs)
        except (Exception, SystemExit) as exc:
            raise ToolError(f"{self.name} failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(result, str):
            try:
                result = json.dumps(result, default=str)
            except (TypeError, ValueError) as exc:  # e.g. a circular structure
                raise ToolError(f"{self.name} returned a value that cannot be sent as JSON: "
                                f"{exc}") from exc
        return cap_middle(result, output_cap)


class AgentFolder:
    """Reads the agent folder of ``workspace``; every call looks at the files afresh,
    except :meth:`typed_tools`, which imports the tool modules once."""

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
                text = path.read_text(encoding="utf-8", errors="replace").strip()
            except OSError as exc:
                parts.append(f"## {rel}\n\n[cannot read {rel}: {exc.strerror or exc}]")
                continue
            if not text:
                continue
            if len(text) > INSTRUCTIONS_CAP:
                left = len(text) - INSTRUCTIONS_CAP
                text = f"{text[:INSTRUCTIONS_CAP]}\n[... {left} more characters of {rel} cut]"
            parts.append(f"## {rel}\n\n{text}")
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

        Loaded once per folder object: a tool module's top level runs only once per agent.
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
        for path in sorted(folder.glob("*.py")):
            if path.name == "__init__.py" or not path.is_file():
                continue
            try:
                tools.append(_load_tool(path))
            except _Skip as exc:
                errors.append(f"{TOOLS_DIR}/{path.name} skipped: {exc}")
        return tools, errors


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


def _load_tool(path: Path) -> TypedTool:
    name = path.stem
    if not TOOL_NAME.match(name):
        raise _Skip(f"the name {name!r} must match {TOOL_NAME.pattern}")
    if name in BUILTIN_TOOLS:
        raise _Skip(f"the name {name!r} clashes with the built-in tool {name}; rename the file")
    module = _import(path)
    fn = getattr(module, "run", None)
    if not inspect.isfunction(fn):
        raise _Skip("it defines no function run(...)")
    if inspect.iscoroutinefunction(fn):
        raise _Skip("run must be a plain function, not async")
    description = inspect.getdoc(module) or inspect.getdoc(fn) or f"The {name} tool."
    override = getattr(module, "PARAMETERS", None)
    nullable: tuple[str, ...] = ()
    if override is not None:
        if not isinstance(override, dict):
            raise _Skip("PARAMETERS must be a dict holding a JSON schema")
        from jsonschema import Draft202012Validator, SchemaError

        try:
            Draft202012Validator.check_schema(override)
        except SchemaError as exc:
            raise _Skip(f"PARAMETERS is not a valid JSON schema: {exc.message}") from None
        parameters = override
    else:
        parameters, nullable = _parameters(fn)
    return TypedTool(name=name, description=description, parameters=parameters, fn=fn,
                     nullable=nullable)


def _import(path: Path) -> types.ModuleType:
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    mod_name = f"_swarm_tool_{digest}_{path.stem.replace('-', '_')}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise _Skip("it cannot be imported")
    module = importlib.util.module_from_spec(spec)
    # In sys.modules while it runs, as for a normal import (dataclasses look it up there).
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(mod_name, None)
        raise _Skip(f"SyntaxError at line {exc.lineno}: {exc.msg}") from None
    except (Exception, SystemExit) as exc:
        sys.modules.pop(mod_name, None)
        raise _Skip(f"{type(exc).__name__}: {exc}") from None
    return module


def _parameters(fn: Callable[..., Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The JSON schema of ``fn``'s parameters, and those that are ``X | None`` with no default."""
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:
        raise _Skip(f"its type hints cannot be resolved: {type(exc).__name__}: {exc}") from None
    properties: dict[str, Any] = {}
    required: list[str] = []
    nullable: list[str] = []
    for pname, param in inspect.signature(fn).parameters.items():
        if pname == "workspace":
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise _Skip(f"run's parameter {pname!r} must be a plain named parameter")
        if pname not in hints:
            raise _Skip(f"run's parameter {pname!r} has no type hint")
        hint, doc = _unannotate(hints[pname])
        inner, optional = _strip_none(hint)
        try:
            prop = _type_schema(inner)
        except _Skip as exc:
            raise _Skip(f"run's parameter {pname!r}: {exc}") from None
        if doc:
            prop = {**prop, "description": doc}
        has_default = param.default is not param.empty
        if has_default and param.default is not None and _jsonable(param.default):
            prop = {**prop, "default": param.default}
        properties[pname] = prop
        if not has_default and not optional:
            required.append(pname)
        elif not has_default:
            nullable.append(pname)
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    schema["additionalProperties"] = False
    return schema, tuple(nullable)


def _unannotate(hint: Any) -> tuple[Any, str]:
    """``Annotated[T, "text"]`` -> (T, "text"); anything else -> (hint, "")."""
    if typing.get_origin(hint) is typing.Annotated:
        base, *extras = typing.get_args(hint)
        doc = next((e for e in extras if isinstance(e, str)), "")
        return base, doc
    return hint, ""


def _strip_none(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (hint, False)."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) < len(typing.get_args(hint)):
            if len(args) == 1:
                return args[0], True
            raise _Skip(f"the type {_type_name(hint)} cannot be mapped to JSON schema")
    return hint, False


def _type_schema(hint: Any) -> dict[str, Any]:
    hint, _ = _unannotate(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if hint is Any:
        return {}
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        values = list(args)
        kinds = {_JSON_TYPES.get(type(v)) for v in values}
        if None in kinds:
            raise _Skip(f"the Literal values of {_type_name(hint)} must be str, int or bool")
        if len(kinds) == 1:
            return {"type": kinds.pop(), "enum": values}
        return {"enum": values}
    if origin is list or hint is list:
        if not args:
            return {"type": "array"}
        return {"type": "array", "items": _type_schema(args[0])}
    if origin is dict or hint is dict:
        if not args:
            return {"type": "object"}
        if args[0] is not str:
            raise _Skip(f"{_type_name(hint)}: JSON object keys are strings, use dict[str, ...]")
        item = _type_schema(args[1])
        return {"type": "object", "additionalProperties": item} if item else {"type": "object"}
    raise _Skip(f"the type {_type_name(hint)} cannot be mapped to JSON schema")


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
