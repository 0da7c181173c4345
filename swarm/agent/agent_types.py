"""Declared agent types: ``.swarm/agents/NAME.md`` (and the user's ``SWARM_HOME/agents``).

A type is a kind of child a parent may start with ``agent(type=NAME)``: its own
instructions (the file's body), tools, model, approval policy and turn limit::

    ---
    description: Reviews a diff and reports problems; changes nothing.
    tools: read_file, grep
    model: small-model
    approval: "*=never"
    max_turns: 20
    ---
    You review code. ...

The front matter is ``key: value`` lines (a strict subset of YAML: no nesting; a list is
``a, b``, ``[a, b]`` or ``- a`` lines under ``key:``); an error names the file and line.

Types are read where the swarm starts, like its MCP servers (:mod:`swarm.mcp_client.config`):
by a root in a terminal as it starts, by the process that submits a job. They travel with
the swarm's record (:meth:`AgentTypes.to_json`); a worker never reads them from a
workspace, which its boxes write. A type holds no key: a child of a type with its own
``base_url`` uses the worker's key, as any child.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from swarm.config import POLICIES, parse_policies
from swarm.errors import ConfigError
from swarm.text import public_url

TYPES_DIR = ".swarm/agents"
USER_DIR = "agents"
"""The user's own types, under ``SWARM_HOME``."""
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
TOOL = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,127}$")
BODY_MAX = 20_000
"""Characters of a type's instructions."""
DESCRIPTION_MAX = 500
FILE_MAX = 100_000
MCP_PREFIX = "mcp__"
#: Always offered: the loop needs it to compact a full context.
HOUSEKEEPING = frozenset({"leave_memory_hints"})
#: Offered with ``agent``: they come back to the children it starts in the background.
BACKGROUND = frozenset({"agent_status", "agent_join", "agent_cancel"})
INHERITABLE = ("instructions",)
_KEYS = ("name", "description", "model", "base_url", "tools", "approval", "max_turns",
         "inherit")
_LISTS = ("tools", "inherit")


@dataclass(frozen=True)
class AgentType:
    """One declared type of child."""

    name: str
    description: str
    instructions: str = ""
    """The file's body: the child's system prompt, in place of swarm's own."""
    model: str = ""
    base_url: str = ""
    tools: tuple[str, ...] | None = None
    """The tools it is offered (None: those a copy of its parent would get). ``mcp__SERVER``
    stands for every tool of that server."""
    approval: str = ""
    """Its approval policies, in ``SWARM_APPROVAL``'s form ("": the swarm's)."""
    max_turns: int = 0
    inherit: tuple[str, ...] = ()
    """What it takes of the agent folder besides: ``instructions`` (AGENTS.md,
    .swarm/instructions.md)."""

    def allows(self, tool: str) -> bool:
        """Whether the type offers ``tool``."""
        if self.tools is None or tool in HOUSEKEEPING or tool in self.tools:
            return True
        if tool in BACKGROUND and "agent" in self.tools:
            return True
        return tool.startswith(MCP_PREFIX) and any(
            tool.startswith(f"{t}__") for t in self.tools if t.startswith(MCP_PREFIX))

    def mcp_servers(self) -> frozenset[str] | None:
        """The MCP servers its tools name (None: all of its swarm's)."""
        if self.tools is None:
            return None
        return frozenset(t[len(MCP_PREFIX):].split("__")[0] for t in self.tools
                         if t.startswith(MCP_PREFIX))

    def policies(self) -> dict[str, str] | None:
        return parse_policies(self.approval) if self.approval else None

    def to_json(self) -> dict[str, Any]:
        return {"description": self.description, "instructions": self.instructions,
                "model": self.model, "base_url": self.base_url,
                "tools": list(self.tools) if self.tools is not None else None,
                "approval": self.approval, "max_turns": self.max_turns,
                "inherit": list(self.inherit)}

    @classmethod
    def from_json(cls, name: str, data: dict[str, Any]) -> AgentType:
        tools = data.get("tools")
        return cls(name=name, description=str(data.get("description", "")),
                   instructions=str(data.get("instructions", "")),
                   model=str(data.get("model", "")), base_url=str(data.get("base_url", "")),
                   tools=tuple(str(t) for t in tools) if isinstance(tools, list) else None,
                   approval=str(data.get("approval", "")),
                   max_turns=int(data.get("max_turns") or 0),
                   inherit=tuple(str(i) for i in data.get("inherit") or ()))


@dataclass(frozen=True)
class AgentTypes:
    """The types a swarm's agents may start, by name."""

    types: dict[str, AgentType] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.types)

    def get(self, name: str) -> AgentType | None:
        return self.types.get(name)

    def names(self) -> list[str]:
        return sorted(self.types)

    def known(self) -> str:
        """The names, for a message: ``leaf, reviewer`` or why there are none."""
        return ", ".join(self.names()) or (f"none (no {TYPES_DIR}/NAME.md files when the "
                                           "swarm started)")

    def to_json(self) -> dict[str, Any]:
        return {name: t.to_json() for name, t in sorted(self.types.items())}

    @classmethod
    def from_json(cls, data: Any) -> AgentTypes:
        if not isinstance(data, dict):
            return cls()
        return cls({str(k): AgentType.from_json(str(k), v) for k, v in data.items()
                    if isinstance(v, dict)})


def load(workspace: Path | None, home: Path | None) -> AgentTypes:
    """The types of ``home``'s ``agents/*.md`` and ``workspace``'s ``.swarm/agents/*.md`` (a
    workspace's type replaces the user's of the same name); :class:`ConfigError` names the
    file and line of the first that is wrong."""
    found: dict[str, AgentType] = {}
    folders = ([home / USER_DIR] if home is not None else []) + \
        ([workspace / TYPES_DIR] if workspace is not None else [])
    for folder in folders:
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.md")):
            if path.is_file():
                kind = read_type(path)
                found[kind.name] = kind
    return AgentTypes(found)


def read_type(path: Path) -> AgentType:
    """The type declared by ``path``; :class:`ConfigError` naming the file and line."""
    try:
        size = path.stat().st_size
        if size > FILE_MAX:
            raise ConfigError(f"{path}: it is {size} bytes, over the {FILE_MAX} an agent "
                              "type's file may have")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read as UTF-8 text: {exc}") from None
    return parse_type(path.stem, text, str(path))


def parse_type(name: str, text: str, where: str) -> AgentType:
    """The type ``name`` from a file's ``text`` (``where``: its path, for errors)."""
    if not NAME.match(name):
        raise ConfigError(f"{where}: the type's name {name!r} (the file's name) must match "
                          f"{NAME.pattern}; rename the file")
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        raise ConfigError(f"{where}:1: an agent type starts with a front matter: a line "
                          "'---', 'description: ...' (and the other keys), a line '---', "
                          "then the instructions")
    end = next((i for i, line in enumerate(lines[1:], 1) if line.strip() == "---"), None)
    if end is None:
        raise ConfigError(f"{where}:1: the front matter is not closed: add a line '---' "
                          "after its last key")
    values = _front_matter(lines[1:end], where)
    body = "\n".join(lines[end + 1:]).strip()
    at = {k: line for k, (_, line) in values.items()}

    def fail(key: str, why: str) -> ConfigError:
        return ConfigError(f"{where}:{at.get(key, 1)}: {why}")

    def one(key: str) -> str:
        value = values.get(key, ("", 0))[0]
        if isinstance(value, list):
            raise fail(key, f"{key} takes one value, not a list")
        return value

    def many(key: str) -> tuple[str, ...] | None:
        if key not in values:
            return None
        value = values[key][0]
        return tuple(value) if isinstance(value, list) else tuple(
            v.strip() for v in value.split(",") if v.strip())

    if one("name") and one("name") != name:
        raise fail("name", f"name {one('name')!r} is not the file's name {name!r}: a type "
                           "is named by its file; remove the key or rename the file")
    description = one("description")
    if not description:
        raise fail("description", "description is required: one line that tells a parent "
                                  "when to start a child of this type")
    if len(description) > DESCRIPTION_MAX:
        raise fail("description", f"description is {len(description)} characters; keep it "
                                  f"under {DESCRIPTION_MAX}")
    base_url = one("base_url")
    if base_url and not base_url.startswith(("http://", "https://")):
        raise fail("base_url", f"base_url {public_url(base_url)!r} is not an http(s) URL")
    try:
        netloc = urlsplit(base_url).netloc
    except ValueError:
        raise fail("base_url", f"base_url {public_url(base_url)!r} is not a URL") from None
    if "@" in netloc:
        raise fail("base_url", "base_url holds credentials; a type travels with the swarm's "
                               "record, so it holds no key: give the workers the key in "
                               "their environment (SWARM_API_KEY)")
    tools = many("tools")
    for tool in tools or ():
        if not TOOL.match(tool):
            raise fail("tools", f"tool {tool!r} is not a tool's name (run_cli, agent, "
                                "load_skill, a .swarm/tools NAME, mcp__SERVER or "
                                "mcp__SERVER__TOOL)")
    approval = one("approval")
    if approval:
        try:
            policies = parse_policies(approval)
        except ConfigError as exc:
            raise fail("approval", str(exc).replace("SWARM_APPROVAL", "approval")) from None
        bad = next((p for p in policies.values() if p not in POLICIES), None)
        if bad is not None:
            raise fail("approval", f"approval policy {bad!r} is not one of "
                                   f"{', '.join(POLICIES)}")
    raw_turns = one("max_turns")
    try:
        max_turns = int(raw_turns) if raw_turns else 0
    except ValueError:
        max_turns = -1
    if max_turns < 0:
        raise fail("max_turns", f"max_turns {raw_turns!r} is not a number of model calls "
                                "(0 or more)")
    inherit = many("inherit") or ()
    for item in inherit:
        if item not in INHERITABLE:
            raise fail("inherit", f"inherit {item!r}: a type may inherit "
                                  f"{', '.join(INHERITABLE)}")
    if len(body) > BODY_MAX:
        raise ConfigError(f"{where}: its instructions are {len(body)} characters; keep them "
                          f"under {BODY_MAX} (put the rest in a skill)")
    return AgentType(name=name, description=description, instructions=body,
                     model=one("model"), base_url=base_url, tools=tools, approval=approval,
                     max_turns=max_turns, inherit=inherit)


def _front_matter(lines: list[str], where: str) -> dict[str, tuple[str | list[str], int]]:
    """``key: value`` lines (from line 2 of the file): each value with its line number."""
    values: dict[str, tuple[str | list[str], int]] = {}
    listing = ""
    for n, raw in enumerate(lines, 2):
        line = raw.rstrip()
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.lstrip().startswith("- "):
            if not listing:
                raise ConfigError(f"{where}:{n}: a list item ('- ...') belongs under a key "
                                  "written 'tools:' alone on its line")
            items = values[listing][0]
            assert isinstance(items, list)
            items.append(_scalar(line.lstrip()[2:], where, n))
            continue
        if line[0].isspace():
            raise ConfigError(f"{where}:{n}: an indented line; the front matter is flat "
                              "'key: value' lines (a value on one line)")
        key, sep, value = line.partition(":")
        key = key.strip()
        if not sep:
            raise ConfigError(f"{where}:{n}: {line.strip()[:60]!r} is not 'key: value'")
        if key not in _KEYS:
            raise ConfigError(f"{where}:{n}: unknown key {key!r}; an agent type takes "
                              f"{', '.join(_KEYS)}")
        if key in values:
            raise ConfigError(f"{where}:{n}: {key} is given twice")
        value = value.strip()
        listing = ""
        if not value and key in _LISTS:
            values[key], listing = ([], n), key
        elif value.startswith("["):
            if not value.endswith("]") or key not in _LISTS:
                raise ConfigError(f"{where}:{n}: {key}: a list is written [a, b] on one line"
                                  + ("" if key in _LISTS else f", and {key} takes no list"))
            values[key] = ([_scalar(v, where, n) for v in value[1:-1].split(",")
                            if v.strip()], n)
        else:
            values[key] = (_scalar(value, where, n), n)
    return values


def _scalar(text: str, where: str, line: int) -> str:
    """A value: plain (a ``#`` after a space starts a comment) or quoted."""
    text = text.strip()
    if text[:1] in ("'", '"'):
        quote = text[0]
        end = text.find(quote, 1)
        rest = text[end + 1:].strip() if end > 0 else "?"
        if end < 0 or (rest and not rest.startswith("#")):
            raise ConfigError(f"{where}:{line}: the quoted value {text[:60]} is not closed "
                              f"by {quote} (or has text after it)")
        return text[1:end]
    comment = text.find(" #")
    return (text[:comment] if comment >= 0 else text).strip()
