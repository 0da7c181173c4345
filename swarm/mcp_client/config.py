"""MCP server configurations: read from the agent folder and ``SWARM_HOME``, merged, expanded.

The format is the one users already keep for other agents (``.mcp.json``)::

    {"mcpServers": {
        "github": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-github"],
                   "env": {"GITHUB_TOKEN": "${GITHUB_TOKEN}"}},
        "docs": {"type": "http", "url": "https://example.com/mcp",
                 "headers": {"Authorization": "Bearer ${DOCS_TOKEN}"}}}}

Files, a later one replacing a server of the same name: ``SWARM_HOME/mcp.json`` (the
user's), ``.mcp.json`` at the workspace root, ``.swarm/mcp.json``. They are read where the
user starts the swarm: by a root in a terminal as it starts, by the process that submits a
job (``swarm serve``; a schedule's firing reads ``SWARM_HOME/mcp.json`` only), and recorded
with the swarm; a worker never reads them from a workspace, which its boxes write. ``${VAR}`` and
``${VAR:-default}`` are expanded from the environment of the process that starts the server,
when it starts (:meth:`ServerSpec.expand`): a :class:`McpConfig` holds the references, never
their values, so it travels to children (in the swarm's record) without a secret.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from swarm.errors import ConfigError
from swarm.secrets import SECRET_VARS
from swarm.text import public_url

USER_FILE = "mcp.json"
"""The user's own servers, under ``SWARM_HOME``."""
WORKSPACE_FILES = (".mcp.json", ".swarm/mcp.json")
_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_HTTP_TYPES = ("http", "streamable-http", "streamableHttp")

Transport = Literal["stdio", "http"]
Pairs = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ServerSpec:
    """One configured server: a command to run (stdio) or a URL (Streamable HTTP)."""

    name: str
    transport: Transport
    command: str = ""
    args: tuple[str, ...] = ()
    env: Pairs = ()
    url: str = ""
    headers: Pairs = ()

    def to_json(self) -> dict[str, Any]:
        """The entry as it is written in a config file."""
        if self.transport == "http":
            return {"type": "http", "url": self.url, "headers": dict(self.headers)}
        return {"command": self.command, "args": list(self.args), "env": dict(self.env)}

    def describe(self) -> str:
        """What it runs or where it is, for messages (no header, no URL credentials)."""
        if self.transport == "http":
            return public_url(self.url)
        return " ".join([self.command, *self.args])[:200]

    def expand(self, environ: Mapping[str, str]) -> ServerSpec:
        """The spec with every ``${VAR}`` replaced from ``environ``; :class:`ConfigError`
        names a variable that is unset (and has no ``:-default``)."""
        def one(text: str) -> str:
            return _expand(text, environ, self.name)

        expanded = replace(
            self, command=one(self.command), args=tuple(one(a) for a in self.args),
            env=tuple((k, one(v)) for k, v in self.env), url=one(self.url),
            headers=tuple((k, one(v)) for k, v in self.headers))
        if expanded.transport == "http" \
                and not expanded.url.startswith(("http://", "https://")):
            raise ConfigError(f"MCP server {self.name}: url {public_url(expanded.url)!r} is "
                              "not an http(s) URL; set it to the server's Streamable HTTP "
                              "endpoint, e.g. https://example.com/mcp")
        return expanded


@dataclass(frozen=True)
class McpConfig:
    """The servers an agent uses, and what was skipped while reading them (and why)."""

    servers: tuple[ServerSpec, ...] = ()
    problems: tuple[str, ...] = ()
    cwd: Path | None = None
    """Where stdio servers start: the workspace the files were read from; None for a
    configuration inherited through the swarm (its servers start in the worker's folder)."""

    def to_json(self) -> dict[str, Any]:
        """The servers in the file format, ``${VAR}`` references unexpanded."""
        return {"mcpServers": {s.name: s.to_json() for s in self.servers}}

    @classmethod
    def from_json(cls, data: Any, where: str = "the swarm's record") -> McpConfig:
        servers, problems = parse(data, where)
        return cls(tuple(servers), tuple(problems))


def load(workspace: Path | None, home: Path | None) -> McpConfig:
    """The servers of ``SWARM_HOME/mcp.json``, ``.mcp.json`` and ``.swarm/mcp.json`` (those
    of ``home`` and ``workspace``; None: none of its files)."""
    merged: dict[str, ServerSpec] = {}
    problems: list[str] = []
    files = ([home / USER_FILE] if home is not None else []) + \
        ([workspace / rel for rel in WORKSPACE_FILES] if workspace is not None else [])
    for path in files:
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            problems.append(f"{path} skipped: it is not readable JSON ({exc}); fix it")
            continue
        servers, found = parse(data, str(path))
        merged.update((s.name, s) for s in servers)
        problems.extend(found)
    return McpConfig(tuple(merged.values()), tuple(problems), workspace)


def parse(data: Any, where: str) -> tuple[list[ServerSpec], list[str]]:
    """The servers of one ``{"mcpServers": {...}}`` document; an entry that cannot be used
    is skipped with a message saying why."""
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        return [], [f"{where} skipped: it has no \"mcpServers\" object (the format is "
                    "{\"mcpServers\": {\"NAME\": {\"command\": ..., \"args\": [...]}}})"]
    found: list[ServerSpec] = []
    problems: list[str] = []
    for name, raw in servers.items():
        try:
            found.append(_server(str(name), raw))
        except ConfigError as exc:
            problems.append(f"{where}: {exc}")
    return found, problems


def _server(name: str, raw: Any) -> ServerSpec:
    if not name.strip():
        raise ConfigError("a server has an empty name; give it one")
    if not isinstance(raw, dict):
        raise ConfigError(f"MCP server {name} skipped: its entry must be an object, not "
                          f"{_a(raw)}")
    kind = raw.get("type") or ("http" if "url" in raw and "command" not in raw else "stdio")
    if not isinstance(kind, str):
        raise ConfigError(f"MCP server {name} skipped: \"type\" must be a string, \"stdio\" "
                          f"(a command) or \"http\" (a URL), not {_a(kind)}")
    if kind == "sse":
        raise ConfigError(f"MCP server {name} skipped: the old SSE transport is not "
                          "supported; use the server's Streamable HTTP endpoint with "
                          "\"type\": \"http\"")
    if kind in _HTTP_TYPES:
        url = raw.get("url")
        if url is not None and not isinstance(url, str):
            raise ConfigError(f"MCP server {name} skipped: \"url\" must be a string, the "
                              "server's Streamable HTTP endpoint (e.g. "
                              f"\"https://example.com/mcp\"), not {_a(url)}")
        if not url:
            raise ConfigError(f"MCP server {name} skipped: \"type\": \"http\" needs a \"url\"")
        return ServerSpec(name, "http", url=url, headers=_pairs(name, raw, "headers"))
    if kind != "stdio":
        raise ConfigError(f"MCP server {name} skipped: unknown type {kind!r}; use \"stdio\" "
                          "(a command) or \"http\" (a URL)")
    command = raw.get("command")
    if command is not None and not isinstance(command, str):
        raise ConfigError(f"MCP server {name} skipped: \"command\" must be a string, the "
                          f"program to run, not {_a(command)} (its arguments go in \"args\")")
    if not command or not command.strip():
        raise ConfigError(f"MCP server {name} skipped: it needs a \"command\" (or "
                          "\"type\": \"http\" and a \"url\")")
    args = raw.get("args", [])
    if not isinstance(args, list):
        raise ConfigError(f"MCP server {name} skipped: \"args\" must be a list of strings, "
                          f"not {_a(args)}")
    for i, arg in enumerate(args):
        if not isinstance(arg, str):
            raise ConfigError(f"MCP server {name} skipped: \"args\" must be a list of "
                              f"strings; item {i + 1} is {_a(arg)}")
    return ServerSpec(name, "stdio", command=command, args=tuple(args),
                      env=_pairs(name, raw, "env"))


def _pairs(name: str, raw: dict[str, Any], field: str) -> Pairs:
    value = raw.get(field) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"MCP server {name} skipped: \"{field}\" must be an object mapping "
                          f"names to strings, not {_a(value)}")
    for key, item in value.items():
        if not isinstance(item, str):
            raise ConfigError(f"MCP server {name} skipped: \"{field}\" must map names to "
                              f"strings; {json.dumps(key)} is {_a(item)}")
    return tuple(sorted((str(k), v) for k, v in value.items()))


def _a(value: Any) -> str:
    """What JSON calls the type of ``value``, for messages (never the value: it may be a
    secret)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


#: The swarm's own credentials: never handed to an MCP server, whoever configured it (a
#: configuration may come from a folder a box once wrote, and a server sees what it is given).
REFUSED_VARS = (*SECRET_VARS, "SWARM_SERVE_TOKEN")


def _expand(text: str, environ: Mapping[str, str], server: str) -> str:
    def sub(match: re.Match[str]) -> str:
        var, default = match[1], match[2]
        if var in REFUSED_VARS:
            raise ConfigError(
                f"MCP server {server}: ${{{var}}} names the swarm's own credentials, which no "
                f"MCP server is given; give the server a variable of its own (set "
                f"{server.upper()}_API_KEY, say, and write ${{{server.upper()}_API_KEY}})")
        value = environ.get(var)
        if default is not None and not value:
            return default
        if value is None:
            raise ConfigError(
                f"MCP server {server}: ${{{var}}} is not set in the environment of this "
                f"process; set {var} (on a worker: in the worker's environment) or give a "
                f"default with ${{{var}:-default}}")
        return value

    return _REF.sub(sub, text)
