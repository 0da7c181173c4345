"""A typed tool's JSON schema, read from its file's syntax alone: the file is parsed, never
run (:func:`swarm.agent.folder._load_tool` finds ``run`` and ``PARAMETERS`` in a
:class:`Scope`). ``run``'s type hints become a schema (:func:`parameters_of`), or
``PARAMETERS`` is read as a literal and checked (:func:`literal_parameters`); a type that
cannot be known without running the file raises :class:`Unusable`, saying why."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


class Unusable(Exception):
    """A tool file that cannot be used; the message says why."""


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


def literal_parameters(node: ast.AST) -> dict[str, Any]:
    """``PARAMETERS = {...}``, read as a literal and checked as a JSON schema."""
    value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
    if value is None:
        raise Unusable("PARAMETERS must be assigned a dict holding a JSON schema")
    try:
        override = ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise Unusable("PARAMETERS must be a literal dict (a JSON schema written out: no "
                    "names, calls or expressions), as a tool's file is never run to read "
                    "it") from None
    if not isinstance(override, dict):
        raise Unusable("PARAMETERS must be a dict holding a JSON schema")
    from jsonschema import Draft202012Validator, SchemaError

    try:
        Draft202012Validator.check_schema(override)
    except SchemaError as exc:
        raise Unusable(f"PARAMETERS is not a valid JSON schema: {exc.message}") from None
    return override


class Scope:
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
        (``"str"``), or :class:`Unusable` saying why it cannot be known without running."""
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in self.typing_modules:
            return node.attr if node.attr in _TYPING_NAMES else f"typing.{node.attr}"
        if not isinstance(node, ast.Name):
            raise Unusable(f"the type {ast.unparse(node)} cannot be read without running the "
                        f"file; {_WRITE_IT}")
        name = node.id
        if name in self.typing_names:
            return self.typing_names[name]
        where = self.bound.get(name)
        if isinstance(where, ast.Import | ast.ImportFrom):
            source = where.module if isinstance(where, ast.ImportFrom) else name
            raise Unusable(f"the type {name} is imported from {source or 'a module'}, and "
                        f"{_WRITE_IT}")
        if where is not None:
            raise Unusable(f"the type {name} is defined in the file (line "
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


def parameters_of(fn: ast.FunctionDef, scope: Scope) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The JSON schema of ``run``'s parameters, and those that are ``X | None`` with no
    default, from its signature's syntax."""
    args = fn.args
    if args.posonlyargs:
        raise Unusable(f"run's parameter {args.posonlyargs[0].arg!r} must be a plain named "
                    "parameter")
    plain = list(zip(args.args, [None] * (len(args.args) - len(args.defaults))
                     + list(args.defaults), strict=True))
    if args.vararg is not None:
        raise Unusable(f"run's parameter {args.vararg.arg!r} must be a plain named parameter")
    plain += list(zip(args.kwonlyargs, args.kw_defaults, strict=True))
    if args.kwarg is not None:
        raise Unusable(f"run's parameter {args.kwarg.arg!r} must be a plain named parameter")
    properties: dict[str, Any] = {}
    required: list[str] = []
    nullable: list[str] = []
    for param, default in plain:
        pname = param.arg
        if pname == "workspace":
            continue
        if param.annotation is None:
            raise Unusable(f"run's parameter {pname!r} has no type hint")
        try:
            hint = _Hint.of(param.annotation, scope)
            hint, doc = hint.unannotated()
            inner, optional = hint.strip_none()
            prop = inner.schema()
        except Unusable as exc:
            raise Unusable(f"run's parameter {pname!r}: {exc}") from None
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
    scope: Scope

    @classmethod
    def of(cls, node: ast.expr, scope: Scope) -> _Hint:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            try:  # a quoted hint: "int", "list[str]"
                parsed = ast.parse(text.strip(), mode="eval").body
            except SyntaxError:
                raise Unusable(f"the type {text!r} is not a valid expression") from None
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
            raise Unusable(f"the type {self.name} cannot be mapped to JSON schema")
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
                raise Unusable(f"the values of {self.name} must be literals")
            values = list(dict.fromkeys((type(v), v) for v in values))  # as typing dedupes
            kinds = {_JSON_TYPES.get(t) for t, _ in values}
            if None in kinds:
                raise Unusable(f"the Literal values of {self.name} must be str, int or bool")
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
                raise Unusable(f"{self.name}: JSON object keys are strings, use dict[str, ...]")
            item = _Hint.of(self.args[1], self.scope).schema()
            return {"type": "object", "additionalProperties": item} if item else {"type": "object"}
        raise Unusable(f"the type {self.name} cannot be mapped to JSON schema")


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
